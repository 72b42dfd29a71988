"""NCCL communicators made directly (jax_ub.comm.nccl, the bootstrap="nccl" path), two processes: the
host all-gather's lengths check, a normal gather, a creation that a peer never joins, and attach
refusals that must not lose the communicator.

Two processes share the GPU where there is one (the launcher makes each its own NCCL host).
Skipped without a GPU; fails where NCCL cannot be loaded on a GPU machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._gpus import nccl
from tests.launcher import format_failures, parallel_launch
from tests.multigpu.test_multiprocess import _layout

WORKER = Path(__file__).with_name("_nccl_host_worker.py")


pytestmark = pytest.mark.gpu  # tests/conftest.py skips it without a GPU


def _run(tmp_path, mode, timeout_s=60):
    nccl()  # a GPU machine without a loadable NCCL fails here
    results = parallel_launch(
        2, WORKER, [mode], env={"JAX_UB_TEST_DIR": str(tmp_path)}, timeout_s=timeout_s, **_layout(2)
    )
    assert all(r.ok for r in results), format_failures(results)
    return results


def test_host_all_gather_returns_every_rank_in_order(tmp_path):
    results = _run(tmp_path, "gather")
    gathered = {r.lines("RESULT gather_ok ")[0].split()[1] for r in results}
    assert len(gathered) == 1, format_failures(results)  # both ranks got the same bytes
    for r in results:
        assert r.lines("RESULT gather_ok ")[0].split()[0] == "1", format_failures(results)
        assert r.lines("RESULT destroyed") == [""], format_failures(results)


def test_host_all_gather_of_different_lengths_fails_on_every_rank(tmp_path):
    """Rank 1 has nothing to send (as when its IPC export failed): both ranks fail at once naming
    each rank's length, instead of rank 0 waiting in a collective that rank 1 skipped."""
    results = _run(tmp_path, "lengths")
    for r in results:
        (msg,) = r.lines("RESULT gather_failed ")
        assert "every rank must pass the same number of bytes" in msg, msg
        assert "rank 0: 16 (differs)" in msg if r.rank == 1 else "rank 1: 0 (differs)" in msg, msg


def test_creation_a_peer_never_joins_times_out_naming_this_rank(tmp_path):
    results = _run(tmp_path, "absent")
    (line,) = results[0].lines("RESULT create_failed ")
    took = float(line.split()[0])
    assert 6.0 <= took < 12.0, line
    assert "communicator creation timed out after 6" in line, line
    assert "s on rank 0 of world 2 (CUDA device 0)" in line, line
    assert "The half-made communicator was aborted" in line, line
    assert results[1].lines("RESULT absent_done") == [""], format_failures(results)


def test_attach_refusals_name_why_and_leave_the_communicator_where_destroy_frees_it(tmp_path):
    """comm_attach_nccl refuses a member that does not exist, a transport-ipc member, a member of
    another rank and a member that has a communicator already, each naming why; a refused
    communicator stays in the table (it was removed first, and so leaked with its proxy thread and
    sockets, before), where destroy frees it. The matching attach takes it out of the table, and
    destroying the member's set frees it."""
    results = _run(tmp_path, "attach")
    for r in results:

        def said(name: str, r=r) -> str:
            (line,) = r.lines(f"RESULT {name} ")
            return line

        assert "987654" in said("no_member") and said("no_member").startswith("failed"), said("no_member")
        assert "was created for transport ipc" in said("ipc_member"), said("ipc_member")
        assert f"does not match (rank {r.rank} of 2 on device 0)" in said(
            "other_rank"
        ) and f"rank {1 - r.rank} of 2" in said("other_rank"), said("other_rank")
        assert said("matching") == "attached", said("matching")
        assert "an NCCL communicator is attached already" in said("second"), said("second")
        assert r.lines("RESULT listed_before ") == ["[(7, 0), (8, 0)]"], format_failures(results)
        assert r.lines("RESULT listed_after ") == ["[(8, 0)]"], format_failures(results)
        # 7 went with set 902; 8 (refused) was still in the table
        assert r.lines("RESULT destroyed_count ") == ["0 1"], format_failures(results)
