"""jax_ub.check_processes: every process of a jax.distributed run stops together, naming why, or
goes on together (two real processes on the CPU backend; single-process calls in-process)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import jax_ub

try:
    from tests.launcher import format_failures, parallel_launch
except ImportError:  # tests/ is not a package: import launcher.py from its folder
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from launcher import format_failures, parallel_launch

WORKER = Path(__file__).resolve().with_name("_check_worker.py")
T = 20.0  # the workers' timeout: every answer but the missing peer's must come long before it
WHO = "jax_ub.check_processes"


def _launch(scenario: str, t: float = T, n: int = 2) -> tuple[list[list[dict]], str]:
    """Each process's results (one per call), and the processes' output for a failure message."""
    res = parallel_launch(n, WORKER, [scenario], env={"JAX_PLATFORMS": "cpu", "T": str(t)}, timeout_s=120)
    return [[json.loads(line) for line in r.lines("RESULT ")] for r in res], format_failures(res)


def test_equal_fields_go_on_together():
    (p0, p1), why = _launch("ok")
    assert [r["ok"] for r in p0] == [True], why
    assert [r["ok"] for r in p1] == [True, True], why  # the call before initialize, then the check


def test_a_problem_on_one_process_stops_both_at_once_naming_it():
    (p0, p1), why = _launch("problem")
    for (p,) in (p0, p1):
        assert p["type"] == "ProcessCheckError", why
        assert (
            p["err"]
            == f"{WHO}: 1 of 2 processes cannot go on: process 1: --heads (6) must be divisible by tp (4)"
        )
        assert p["problems"] == {"1": "--heads (6) must be divisible by tp (4)"} and p["differences"] == []
        assert p["dt"] < T / 2, p  # not after the timeout


def test_problems_on_every_process_are_all_listed_with_the_settings_that_differ():
    (p0, p1), why = _launch("problems")
    assert p0[0]["err"] == p1[0]["err"], why
    assert p0[0]["err"] == (
        f"{WHO}: 2 of 2 processes cannot go on:\n"
        "  process 0: --heads (6) must be divisible by tp (3)\n"
        "  process 1: --heads (6) must be divisible by tp (4)\n"
        "The processes' settings differ as well:\n"
        "  process 1: cpu_devices=4 (process 0: <absent>)"
    )


def test_one_problem_on_many_processes_is_one_line():
    (p0, p1), why = _launch("same_problem")
    assert (
        p0[0]["err"]
        == p1[0]["err"]
        == (f"{WHO}: 2 of 2 processes cannot go on: processes 0-1: --heads (6) must be divisible by tp (4)")
    ), why


def test_processes_with_the_same_problem_are_named_in_runs():
    from jax_ub.comm.processes import _grouped

    assert _grouped({0: "a", 1: "a", 2: "a", 5: "a", 3: "b"}) == [
        ("processes 0-2, 5", "a"),
        ("process 3", "b"),
    ]
    assert _grouped({4: "x", 0: "x", 2: "x", 3: "y"}) == [("processes 0, 2, 4", "x"), ("process 3", "y")]
    assert _grouped({7: "z"}) == [("process 7", "z")]


def test_different_settings_name_each_field_and_both_values():
    (p0, p1), why = _launch("fields")
    for (p,) in (p0, p1):
        assert p["type"] == "AgreementError", why
        assert p["err"] == (
            f"{WHO}: the 2 processes disagree; every process must be started with the "
            "same settings. 1 process differs from process 0:\n"
            "  process 1: seed=1 (process 0: 0); steps=20 (process 0: 10)"
        )  # shape: [4, 8] == (4, 8)


def test_processes_that_differ_alike_are_one_line():
    results, why = _launch("fields_many", n=3)
    errors = {r[0]["err"] for r in results}
    assert errors == {
        f"{WHO}: the 3 processes disagree; every process must be started with the same "
        "settings. 2 processes differ from process 0:\n"
        "  processes 1-2: seed=1 (process 0: 0)"
    }, why


def test_no_fields_on_one_process_is_a_difference_not_a_hang():
    (p0, p1), why = _launch("no_fields")
    for (p,) in (p0, p1):
        assert p["type"] == "AgreementError" and p["dt"] < T / 2, why
        assert (
            "process 1: seed=<absent> (process 0: 0); shape=<absent> (process 0: [4,8]); "
            "steps=<absent> (process 0: 10)" in p["err"]
        ), p


def test_a_process_that_never_calls_is_named_after_the_timeout():
    t = 6.0
    (p0, _), why = _launch("missing", t)
    (p,) = p0
    assert p["type"] == "PeerTimeoutError", why
    assert p["err"] == (
        f"{WHO}: process 0 waited 6 s for process 1 of 2, which did not call {WHO}() "
        "(this process's call 1); is it running, and did it stop before the check? "
        "(timeout: timeout_s)"
    ), p
    assert t - 0.5 < p["dt"] < t + 5, p


def test_a_process_with_a_problem_keeps_it_when_a_peer_never_comes():
    """It raises its own problem (as ProcessCheckError) with the timeout's message, not only the
    timeout: the problem is what its user must fix."""
    (p0, _), why = _launch("problem_missing", 6.0)
    (p,) = p0
    assert p["type"] == "ProcessCheckError" and p["problems"] == {
        "0": "the CUDA extension is missing on this host"
    }, why
    assert p["err"].startswith(
        f"{WHO}: process 0 cannot go on: the CUDA extension is missing on this host; "
        f"and process 0 waited 6 s for process 1 of 2"
    ), p


def test_calls_made_unevenly_are_named_as_such():
    (p0, p1), why = _launch("twice", 6.0)
    assert [r["ok"] for r in p0] == [True] and p1[0]["ok"], why
    second = p1[1]
    assert second["type"] == "PeerTimeoutError", why
    assert "process 0's latest call of jax_ub.check_processes() was its call 1" in second["err"], second


def test_a_peer_at_a_later_call_is_named_as_making_other_calls():
    """On a timeout, where the missing process made a *later* call, the calls differ; where it
    made an earlier one, it may only be slow (both said, over a LocalStore)."""
    from jax_ub.comm import bootstrap, processes

    store = bootstrap.LocalStore()
    store.set(f"{processes._namespace(3)}/answers/1", b"{}")
    ex = bootstrap.KVExchange(processes._namespace(2), 0, 2, 5.0, client=store)
    said = processes._timeout_message(ex, 2, True, [1])
    assert (
        "process 1 made its call 3 of jax_ub.check_processes() already, this process is at its "
        "call 2: every process must make the same calls"
    ) in said, said
    assert said.endswith("(timeout: JAX_UB_TIMEOUT)")
    ex = bootstrap.KVExchange(processes._namespace(5), 0, 2, 5.0, client=store)
    said = processes._timeout_message(ex, 5, False, [1])
    assert "process 1's latest call of jax_ub.check_processes() was its call 3" in said, said
    assert "same calls" not in said and said.endswith("(timeout: timeout_s)")


def test_a_process_that_arrives_after_its_peer_gave_up_stops_too():
    t = 6.0
    (p0, p1), why = _launch("late", t)
    assert p0[0]["type"] == "PeerTimeoutError" and "waited 6 s for process 1" in p0[0]["err"], why
    assert p1[0]["type"] == "PeerTimeoutError", why
    assert p1[0]["err"] == (
        f"{WHO}: process 1 arrived after process 0 had given up waiting for it "
        "(their timeout: JAX_UB_TIMEOUT or timeout_s), so they have stopped and this "
        "process stops too"
    ), p1


def test_fields_json_cannot_encode_are_refused_after_taking_part():
    (p0, p1), why = _launch("bad_fields")
    assert p1[0]["type"] == "TypeError" and "`fields` cannot be encoded as JSON" in p1[0]["err"], why
    assert p0[0]["type"] == "ProcessCheckError" and p0[0]["dt"] < T / 2, why
    assert p0[0]["err"].startswith(
        f"{WHO}: 1 of 2 processes cannot go on: process 1: {WHO}() refused its "
        "arguments here: `fields` cannot be encoded"
    ), p0


def test_bad_arguments_are_raised_after_taking_part():
    (p0, p1), why = _launch("bad_argument")
    assert p1[0]["type"] == "TypeError" and "`problem` must be None or a str" in p1[0]["err"], why
    assert p0[0]["type"] == "ProcessCheckError" and p0[0]["dt"] < T / 2, why
    assert p0[0]["err"] == (
        f"{WHO}: 1 of 2 processes cannot go on: process 1: {WHO}() refused its "
        "arguments here: `problem` must be None or a str saying why this process "
        "cannot go on; got int"
    ), p0  # its valid fields are still compared: equal


def test_the_service_host_leaving_at_once_still_tells_the_other():
    """Process 0 hosts jax.distributed's service and exits right after raising: the settle step
    keeps it until process 1 has read the answers."""
    (p0, p1), why = _launch("problem_exit0")
    expected = f"{WHO}: 1 of 2 processes cannot go on: process 0: the CUDA extension is missing on this host"
    assert p0 and p0[0]["err"] == expected, why
    assert p1 and p1[0]["err"] == expected, why


def test_one_process_raises_its_own_problem_and_otherwise_returns():
    assert jax_ub.check_processes({"steps": 10}) is None
    assert jax_ub.check_processes() is None
    with pytest.raises(jax_ub.ProcessCheckError, match=rf"^{WHO}: process 0 cannot go on: no GPU$") as info:
        jax_ub.check_processes({"steps": 10}, problem="no GPU")
    assert info.value.problems == {0: "no GPU"} and info.value.differences == []


@pytest.mark.parametrize(
    "kwargs,exc,fragment",
    [
        (dict(fields=[("steps", 1)]), TypeError, "`fields` must be a mapping"),
        (dict(fields={1: 2}), TypeError, "names in `fields` must be str"),
        (dict(problem=2), TypeError, "`problem` must be None or a str"),
        (dict(problem="  "), ValueError, "pass None where there is no problem"),
        (dict(timeout_s=0), ValueError, "timeout_s must be a finite number of seconds > 0; got 0"),
        (dict(timeout_s="5"), ValueError, "got '5'"),
        (dict(timeout_s=float("inf")), ValueError, "got inf"),
        (dict(fields={"table": {(4, 8): 1}}), TypeError, "`fields` cannot be encoded as JSON"),
    ],
)
def test_bad_arguments_say_what_was_expected(kwargs, exc, fragment):
    with pytest.raises(exc, match="check_processes") as info:
        jax_ub.check_processes(**kwargs)
    assert fragment in str(info.value)


def test_functions_and_default_reprs_compare_without_their_memory_address():
    """vars(args) with argparse's set_defaults(func=train): the same function on every process has a
    different address in each, so fields compare functions by module and qualified name and strip
    the address from other default reprs; different functions still differ."""
    from jax_ub.comm import bootstrap

    def make():
        def train():
            pass

        return train

    class Opaque:
        pass

    one, other = make(), make()  # equal functions at different addresses, as in two processes
    assert one is not other and str(one) != str(other)
    assert bootstrap._canonical({"func": one}) == bootstrap._canonical({"func": other})
    assert "0x" not in bootstrap._canonical({"func": one, "obj": Opaque(), "cls": Opaque})
    assert bootstrap._canonical({"obj": Opaque()}) == bootstrap._canonical({"obj": Opaque()})
    assert bootstrap._canonical({"func": one}) != bootstrap._canonical({"func": make})
    assert "test_check_processes" in bootstrap._canonical({"func": one})


def test_after_jax_distributed_shutdown_it_raises_instead_of_acting_as_one_process(monkeypatch):
    """After jax.distributed.shutdown() in a run of several processes the client is gone but the
    process count stays: check_processes raises the documented RuntimeError (it returned None, and a
    problem was reported as process 0's)."""
    from jax._src import distributed

    monkeypatch.setattr(distributed.global_state, "client", None)
    monkeypatch.setattr(distributed.global_state, "num_processes", 2)
    monkeypatch.setattr(distributed.global_state, "process_id", 1)
    for kwargs in ({}, {"problem": "no GPU"}, {"fields": {"steps": 10}}):
        with pytest.raises(
            RuntimeError,
            match=r"jax.distributed was shut down in this run of 2 processes "
            r"\(this is process 1\).*before jax.distributed.shutdown\(\)",
        ):
            jax_ub.check_processes(**kwargs)
