"""CPU tier: the fault-injection matrix of jax_ub's host side (``tools/fault_matrix.py``).

Three processes under a real ``jax.distributed`` service on localhost, jax_ub's host side for real
(agreements, the IPC handle exchange, buffer growth's collective steps, check_processes,
shutdown's barrier) over a stand-in extension and stand-in GPUs. The last process fails (exits,
is killed, stalls, raises) at each phase; every other process must end with a jax_ub error that
names it within JAX_UB_TIMEOUT + 5 s, and no process may be left running. Cases run in parallel
(about a minute on two cores). The GPU phases (an op in flight) run on GPU machines:
``python tools/fault_matrix.py --backend gpu`` (docs/reliability.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import fault_matrix  # noqa: E402

T = 3.0


@pytest.fixture(scope="module")
def matrix():
    import concurrent.futures

    phases, kinds = fault_matrix.CPU_PHASES, fault_matrix.KINDS
    cases = [fault_matrix.Case(kind, phase, "ipc") for phase in phases for kind in kinds]

    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        return list(pool.map(lambda c: fault_matrix.run_case(c, "cpu", 3, T), cases))


@pytest.mark.parametrize("phase", fault_matrix.CPU_PHASES)
def test_every_survivor_names_the_faulty_process_in_time(matrix, phase):
    for c in [c for c in matrix if c.phase == phase]:
        assert c.ok, f"{c.name}: {c.why}"
        assert not c.hang and len(c.times) == 2, c
        assert all(t <= T + fault_matrix.GRACE_S for t in c.times), c


def test_an_exited_peer_is_seen_at_once_not_at_the_timeout(matrix):
    """Where the faulty process had taken part in an exchange before it exited (every phase after
    before_init), its exit is seen through its exit mark (exit, raise) or /proc (kill)."""
    for c in matrix:
        if c.kind != "stall" and c.phase != "before_init":
            assert max(c.times) < T / 2, c
        if c.kind == "stall":  # alive: only the timeout can tell
            assert min(c.times) >= T - 0.5, c
