"""jax_ub.initialize / shutdown across real jax.distributed processes (CPU backend).

The workers (``_init_worker.py``) run jax_ub.comm's multi-process logic with a stand-in CUDA extension
and stand-in GPUs: what every process agrees on, how a failure on one process reaches the others
(at once, naming it, not after the timeout), and what shutdown does when a peer is missing.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

try:
    from tests.launcher import format_failures, parallel_launch
except ImportError:  # tests/ is not a package: import launcher.py from its folder
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from launcher import format_failures, parallel_launch

WORKER = Path(__file__).resolve().with_name("_init_worker.py")
T = 20.0  # jax_ub's timeout in the workers: every failure below must come long before it


def _launch(scenario: str, **env: str) -> list[dict[str, dict]]:
    """Each process's results: {step name: result}, plus "calls" (the extension calls made) and
    "logs" (jax_ub's log messages, where the worker runs with CAPTURE_LOG)."""
    res = parallel_launch(
        2, WORKER, [scenario], env={"JAX_PLATFORMS": "cpu", "T": str(T), **env}, timeout_s=120
    )
    assert all(r.returncode == 0 and not r.timed_out for r in res), format_failures(res)
    out = []
    for r in res:
        steps = {}
        for line in r.lines("RESULT "):
            item = json.loads(line)
            if item.get("step") == "log":
                steps.setdefault("logs", []).append(item["msg"])
            else:
                steps[item.get("step", "calls")] = item
        out.append(steps)
    return out


def test_both_processes_set_up_and_free_one_set():
    p0, p1 = _launch("ok")
    for p in (p0, p1):
        assert p["init"]["ok"] and p["init"]["set"] == 1, p
        assert p["shutdown"]["ok"], p
        calls = p["calls"]["calls"]
        assert calls.count("comm_create") == 2 and calls.count("comm_connect_ipc") == 2, calls
        assert "comm_destroy_set" in calls, calls


def test_a_peer_whose_process_cannot_be_watched_is_named_once_at_setup():
    """Where the extension says a peer's process cannot be checked (another pid namespace, hidden
    /proc), setup says so once, with the reason and what it means: a crash there ends in the
    timeout, not at once. A grow's reconnection does not repeat it."""
    why = "it runs in another pid namespace (another container)"
    for p in _launch("ok", UNCHECKED=why, CAPTURE_LOG="1", JAX_UB_LOG="INFO"):
        assert p["init"]["ok"], p
        said = [m for m in p.get("logs", []) if "cannot be watched for an exit" in m]
        assert len(said) == 1, p.get("logs")
        assert f"({why})" in said[0] and f"after the timeout ({T:g} s)" in said[0], said
        assert "rank(s) 0" in said[0] or "rank(s) 1" in said[0], said
    for p in _launch("ok", CAPTURE_LOG="1", JAX_UB_LOG="INFO"):  # every peer checkable: nothing said
        assert p["init"]["ok"], p
        assert not [m for m in p.get("logs", []) if "watched" in m], p.get("logs")


@pytest.mark.parametrize("fail_on", ["comm_create", "comm_connect_ipc"])
def test_a_failure_on_one_process_fails_the_other_at_once_naming_it(fail_on):
    """comm_create fails before the handle exchange, comm_connect_ipc after it, i.e. once process
    0 is done with every step but the last barrier. Either way process 0 fails in well under the
    timeout with process 1's own error, and frees what it created."""
    p0, p1 = _launch("fail", FAIL_ON=fail_on)
    assert not p1["init"]["ok"] and f"injected {fail_on} failure on process 1" in p1["init"]["err"]
    assert not p0["init"]["ok"], p0
    err = p0["init"]["err"]
    assert "rank 1 (process 1) failed and will not take part" in err, err
    assert f"injected {fail_on} failure on process 1" in err, err
    if fail_on == "comm_connect_ipc":
        assert "process 0 set up its communicators for axis 'tp', but a peer did not" in err, err
    assert p0["init"]["dt"] < T / 4, p0["init"]
    for p in (p0, p1):
        assert "comm_destroy_set" in p["calls"]["calls"], p["calls"]


def test_a_setting_refused_on_one_process_fails_the_other_at_once_naming_it():
    """Process 1's JAX_UB_TIMEOUT is not a number, so its initialize() refuses the call before any
    exchange: process 0 hears why at once instead of waiting its timeout for it. Both calls keep
    the same init number, so the next initialize() (setting fixed) pairs up and succeeds."""
    p0, p1 = _launch("bad_setting")
    assert not p1["init"]["ok"] and p1["init"]["err"].startswith("ValueError"), p1["init"]
    assert "JAX_UB_TIMEOUT" in p1["init"]["err"], p1["init"]
    err = p0["init"]["err"]
    assert "rank 1 (process 1) failed and will not take part" in err, err
    assert (
        "refused its arguments or JAX_UB_* settings on process 1: ValueError" in err
        and "JAX_UB_TIMEOUT" in err
    ), err
    assert p0["init"]["dt"] < T / 4, p0["init"]
    for p in (p0, p1):
        assert p["again"]["ok"] and p["again"]["set"] is not None, p
        assert p["shutdown"]["ok"], p


@pytest.mark.parametrize("scenario", ["refuse_exit", "mismatch_exit"])
def test_process_0_exiting_at_once_after_its_error_still_lets_the_peer_read_why(scenario):
    """Process 0 hosts jax.distributed's service. When it fails (refuses a setting) or the
    processes disagree, and it exits right after raising, process 1 (arriving 3 s later) must still
    get jax_ub's error naming the cause, not a read from a service that is gone: process 0 waits
    (a few seconds at most) until its peers have read what they need before raising."""
    res = parallel_launch(2, WORKER, [scenario], env={"JAX_PLATFORMS": "cpu", "T": str(T)}, timeout_s=120)
    steps = [{json.loads(line).get("step"): json.loads(line) for line in r.lines("RESULT ")} for r in res]
    assert all("init" in p for p in steps), format_failures(res)
    p0, p1 = (p["init"] for p in steps)
    if scenario == "refuse_exit":
        assert p0["err"].startswith("ValueError") and "JAX_UB_TIMEOUT" in p0["err"], p0
        assert p1["err"].startswith("PeerFailedError"), p1
        assert "rank 0 (process 0) failed and will not take part" in p1["err"], p1
        assert "JAX_UB_TIMEOUT" in p1["err"], p1
    else:
        for p in (p0, p1):
            assert p["err"].startswith("AgreementError"), p
            assert "schedule.ag_push_pieces=0 (rank 0: 2)" in p["err"], p
    assert p1["dt"] < T / 4, p1


def test_processes_on_different_paths_fail_naming_the_difference():
    """Process 1 has no CUDA path (the reference), process 0 has: both fail at once instead of
    process 0 waiting for a peer that will never create communicators."""
    for p in _launch("path_mismatch"):
        err = p["init"]["err"]
        assert err.startswith("AgreementError") and p["init"]["dt"] < T / 4, p["init"]
        assert 'path="reference path" (rank 0: "communicators")' in err, err


def test_a_different_communication_schedule_is_refused():
    for p in _launch("schedule_mismatch"):
        err = p["init"]["err"]
        assert err.startswith("AgreementError") and "schedule.ag_push_pieces=2 (rank 0: 0)" in err, err
        assert err.count("ag_push_merge") == 0, err  # only the key that differs, once


def test_reinitialize_is_decided_alike_on_every_process():
    p0, p1 = _launch("reinit")
    for p in (p0, p1):
        assert p["same"]["set"] == 1, p  # the same arguments keep the set
        assert p["bigger"]["set"] == 2, p  # a larger buffer replaces it
        err = p["transport"]["err"]  # process 0 asks for another transport, process 1 does not
        assert err.startswith("AgreementError") and p["transport"]["dt"] < T / 4, p["transport"]
        assert 'existing_set="keeps set 2" (rank 0: "replaces set 2 (other arguments)")' in err, err


def test_shutdown_keeps_the_buffers_when_a_peer_never_arrives():
    p0, _ = _launch("shutdown_one", T="3")
    err = p0["shutdown"]["err"]
    assert "did it call jax_ub.shutdown()?" in err and "set 1 stay allocated" in err, err
    assert "comm_destroy_set" not in p0["calls"]["calls"], p0["calls"]


def test_shutdown_after_jax_distributed_shutdown_says_so():
    for p in _launch("distributed_first"):
        err = p["shutdown"]["err"]
        assert "call jax_ub.shutdown() before it" in err, err
        # nothing freed: only the drain, and the read of the host stats for summary()'s line
        freeing = [c for c in p["calls"]["calls"] if c != "comm_host_stats"]
        assert freeing == ["comm_drain"], p["calls"]


def test_every_process_runs_nccl_when_one_process_cannot_map_a_pair():
    """Groups [0, 2] and [1, 3]: process 1's CUDA says GPUs 0 and 2 cannot access each other,
    process 0's says they can (its report comes first). Both processes choose nccl, for the same
    reason; with no such pair, both choose ipc."""
    pair = "GPU 0 (process 0) and GPU 2 (process 1) cannot access each other"
    for p in _launch("p2p", P2P_NO="0,2"):
        assert p["init"]["ok"] and p["init"]["transport"] == "nccl", p
        assert p["init"]["reason"] == pair, p["init"]
        assert "comm_connect_ipc" not in p["calls"]["calls"], p["calls"]
        assert p["shutdown"]["ok"], p
    for p in _launch("p2p", P2P_NO="1,2"):  # not a pair of one group
        assert p["init"]["transport"] == "ipc", p
        assert p["init"]["reason"] == "every pair of GPUs of each group can map each other's memory"


def _bench(times: dict[str, float]) -> str:
    """A tuning file: gemm_rs tp2 bfloat16 4096^3 at these ms per method."""
    recs = [
        {
            "op": "gemm_rs",
            "tp": 2,
            "dtype": "bfloat16",
            "M": 4096,
            "K": 4096,
            "N": 4096,
            "impl": f"jax_ub_{m}",
            "ms": ms,
        }
        for m, ms in times.items()
    ]
    return json.dumps({"machine": "2xTest", "date": "20260101", "records": recs})


def test_a_tuning_file_missing_on_one_process_fails_naming_both_files(tmp_path):
    """With communicators, auto chooses from the tables: a file that one process cannot read
    fails every process, naming each one's file and the OS error. On the reference path auto
    reads no table: the same launch initializes (returns None) on both."""
    rng = random.Random(7)
    good, missing = tmp_path / "mine.json", tmp_path / "absent.json"
    good.write_text(_bench({m: rng.uniform(0.5, 2.0) for m in ("ring", "pipeline", "columns")}))
    p0, p1 = _launch("tables", TUNING_FILE_0=str(good), TUNING_FILE_1=str(missing))
    assert p0["init"]["err"] == p1["init"]["err"], (p0, p1)
    err = p0["init"]["err"]
    assert err.startswith("AgreementError") and p0["init"]["dt"] < T / 4, err
    assert 'auto_tables="unreadable file"' in err, err
    assert (
        f"[rank 1: JAX_UB_TUNING_FILE {str(missing)!r}: cannot read a bench JSON: [Errno 2] "
        "No such file or directory"
    ) in err, err
    assert f"rank 0: JAX_UB_TUNING_FILE {str(good)!r} (1 measured shapes, file sha256 " in err, err
    assert "schedule=" not in err, err  # only what differs
    for p in (p0, p1):
        assert p["reference"]["ok"] and p["reference"]["set"] is None, p["reference"]


def test_tables_that_fail_to_agree_are_not_adopted_by_any_process(tmp_path):
    """Both processes agree on one content; process 0's file is then rewritten, and initializing
    again fails. The set of the first initialize stays, and both processes keep choosing from the
    tables they agreed on (process 0 must not switch to its new file alone)."""
    rng = random.Random(11)
    slow, fast = rng.uniform(1.0, 2.0), rng.uniform(0.2, 0.5)
    first, second = _bench({"ring": fast, "columns": slow}), _bench({"ring": slow, "columns": fast})
    files = []
    for r in range(2):
        files.append(tmp_path / f"tuning{r}.json")
        files[-1].write_text(first)
    procs = _launch(
        "tables_changed", TUNING_FILE_0=str(files[0]), TUNING_FILE_1=str(files[1]), TUNING_REWRITE=second
    )
    for p in procs:
        assert p["init"]["ok"] and p["chosen"]["method"] == "ring", p
        assert not p["again"]["ok"] and p["again"]["err"].startswith("AgreementError"), p["again"]
        assert p["chosen_after"]["method"] == "ring", p
        assert p["shutdown"]["ok"], p
