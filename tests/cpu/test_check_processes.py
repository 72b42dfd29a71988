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
T = 20.0  # the workers' timeout: every answer but "missing" must come long before it


def _launch(scenario: str, t: float = T) -> tuple[list[dict | None], list]:
    res = parallel_launch(2, WORKER, [scenario], env={"JAX_PLATFORMS": "cpu", "T": str(t)},
                          timeout_s=120)
    out = []
    for r in res:
        lines = r.lines("RESULT ")
        out.append(json.loads(lines[0]) if lines else None)
    return out, res


def test_equal_fields_go_on_together():
    (p0, p1), res = _launch("ok")
    assert p0 == {"ok": True, "dt": p0["dt"]} and p1["ok"], format_failures(res)


def test_a_problem_on_one_process_stops_both_at_once_naming_it():
    (p0, p1), res = _launch("problem")
    for p in (p0, p1):
        assert p is not None and not p["ok"], format_failures(res)
        assert p["type"] == "ProcessCheckError", p
        assert p["err"] == "1 of 2 processes cannot go on: process 1: --heads (6) must be divisible by tp (4)"
        assert p["dt"] < T / 2, p  # not after the timeout


def test_problems_on_every_process_are_all_listed():
    (p0, p1), res = _launch("problems")
    assert p0["err"] == p1["err"], format_failures(res)
    assert p0["err"] == ("2 of 2 processes cannot go on:\n"
                         "  process 0: --heads (6) must be divisible by tp (3)\n"
                         "  process 1: --heads (6) must be divisible by tp (4)")


def test_different_settings_name_each_field_and_both_values():
    (p0, p1), res = _launch("fields")
    for p in (p0, p1):
        assert p is not None and p["type"] == "AgreementError", format_failures(res)
        assert p["err"].startswith("jax_ub.check_processes: the 2 processes disagree; every process "
                                   "must be started with the same settings. Process 1 differs"), p
        assert "process 1: seed=1 (process 0: 0); steps=20 (process 0: 10)" in p["err"], p
        assert "shape" not in p["err"], p  # [4, 8] equals (4, 8)
    assert p0["err"] == p1["err"]


def test_a_process_that_never_calls_is_named_after_the_timeout():
    t = 6.0
    (p0, _), res = _launch("missing", t)
    assert p0 is not None and p0["type"] == "PeerTimeoutError", format_failures(res)
    assert ("waited 6 s for rank 1 (process 1) of world 2, which never published; is process 1 "
            "running and did it call jax_ub.check_processes()?") in p0["err"], p0
    assert t - 0.5 < p0["dt"] < t + 5, p0


def test_the_service_host_leaving_at_once_still_tells_the_other():
    """Process 0 hosts jax.distributed's service and exits right after raising: the settle step
    keeps it until process 1 has read the answers."""
    (p0, p1), res = _launch("problem_exit0")
    expected = "1 of 2 processes cannot go on: process 0: the CUDA extension is missing on this host"
    assert p0 is not None and p0["err"] == expected, format_failures(res)
    assert p1 is not None and p1["err"] == expected, format_failures(res)


def test_one_process_raises_its_own_problem_and_otherwise_returns():
    assert jax_ub.check_processes({"steps": 10}) is None
    assert jax_ub.check_processes() is None
    with pytest.raises(jax_ub.ProcessCheckError, match=r"^process 0: no GPU$"):
        jax_ub.check_processes({"steps": 10}, problem="no GPU")


@pytest.mark.parametrize("kwargs,exc,fragment", [
    (dict(fields=[("steps", 1)]), TypeError, "`fields` must be a mapping"),
    (dict(fields={1: 2}), TypeError, "names in `fields` must be str"),
    (dict(problem=2), TypeError, "`problem` must be None or a str"),
    (dict(problem="  "), ValueError, "pass None where there is no problem"),
    (dict(timeout_s=0), ValueError, "timeout_s must be a finite number of seconds > 0; got 0"),
    (dict(timeout_s="5"), ValueError, "got '5'"),
    (dict(timeout_s=float("inf")), ValueError, "got inf"),
])
def test_bad_arguments_say_what_was_expected(kwargs, exc, fragment):
    with pytest.raises(exc, match="check_processes") as info:
        jax_ub.check_processes(**kwargs)
    assert fragment in str(info.value)
