"""jax_ub.initialize / shutdown across real jax.distributed processes (CPU backend).

The workers (``_init_worker.py``) run comm.py's multi-process logic with a stand-in CUDA extension
and stand-in GPUs: what every process agrees on, how a failure on one process reaches the others
(at once, naming it, not after the timeout), and what shutdown does when a peer is missing.
"""

from __future__ import annotations

import json
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
    """Each process's results: {step name: result}, plus "calls" (the extension calls made)."""
    res = parallel_launch(2, WORKER, [scenario], env={"JAX_PLATFORMS": "cpu", "T": str(T), **env},
                          timeout_s=120)
    assert all(r.returncode == 0 and not r.timed_out for r in res), format_failures(res)
    out = []
    for r in res:
        steps = {}
        for line in r.lines("RESULT "):
            item = json.loads(line)
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
        assert err.startswith("AgreementError") and '"ag_push_pieces":2' in err, err


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
        assert p["calls"]["calls"] == ["comm_drain"], p["calls"]  # nothing freed


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
