"""One rank of the multi-process bootstrap tests (started by ``tests/launcher.py``).

Usage: ``python _bootstrap_worker.py SCENARIO [ARGS...]``; the launcher provides
``JAX_UB_TEST_COORD``, ``JAX_UB_TEST_NPROCS`` and ``JAX_UB_TEST_RANK``. Results are printed as
``RESULT <json>`` lines for the test to parse; a failed check raises (non-zero exit, traceback on
stderr).

Scenarios:
  gather                      binary all_gather, broadcast, barrier, agree (equal fields), two
                              initialize rounds and two groups reusing the same tags.
  disagree BAD_RANK           BAD_RANK passes different fields to agree(); every rank prints
                              the AgreementError message, then all shut down cleanly.
  timeout MODE TIMEOUT R...   ranks R never publish (MODE ``silent``: stay alive, MODE ``exit``:
                              exit at once); the others print their PeerTimeoutError.
  env                         print the launcher's environment variables (no jax).
  hang                        start a grandchild in the same process group, then sleep (no jax).
"""

from __future__ import annotations

import inspect
import json
import os
import random
import subprocess
import sys
import time

rank = int(os.environ["JAX_UB_TEST_RANK"])
nprocs = int(os.environ["JAX_UB_TEST_NPROCS"])
coord = os.environ["JAX_UB_TEST_COORD"]


def emit(**fields: object) -> None:
    print("RESULT " + json.dumps(fields), flush=True)


def init_distributed(heartbeat_s: int = 10) -> None:
    """jax.distributed on the CPU backend with short timeouts, so a failure never hangs long."""
    import jax

    wanted = {
        "initialization_timeout": 30,
        "heartbeat_timeout_seconds": heartbeat_s,
        "shutdown_timeout_seconds": 10,
    }
    accepted = inspect.signature(jax.distributed.initialize).parameters
    jax.distributed.initialize(coord, nprocs, rank, **{k: v for k, v in wanted.items() if k in accepted})


def shutdown_distributed(ex) -> None:
    """Final barrier first, so the coordinator (process 0) never leaves while others need it."""
    import jax

    ex.barrier("final")
    jax.distributed.shutdown()


def blob(rank: int, round_: int) -> bytes:
    """A different binary payload per rank and round: empty, every byte value, larger random."""
    rng = random.Random(1000 * round_ + rank)
    size = (0, 777, 65536 + 13, 5)[rank % 4]
    return bytes(range(256)) * (rank % 2) + rng.randbytes(size) + b"\x00"


def scenario_gather() -> None:
    from jax_ub.comm import bootstrap as bs

    init_distributed()
    # Round 1: one group holding every process.
    ns1 = bs.group_namespace(bs.next_init_id(), 0)
    ex = bs.KVExchange(ns1, rank, nprocs, timeout_s=20)
    got = ex.all_gather("blobs", blob(rank, 1))
    assert len(got) == nprocs
    for r, payload in enumerate(got):
        assert payload == blob(r, 1), f"rank {rank}: rank {r}'s payload differs ({len(payload)} B)"
    root = nprocs - 1
    sent = b"\xffroot\x00" + bytes([root]) * 100
    assert ex.broadcast("bcast", sent if rank == root else None, root=root) == sent
    bs.agree(ex, {"mesh": [nprocs], "dtype": "bfloat16", "sizes": (1, 2, 3)})
    ex.barrier("round1")

    # Round 2: a new initialize() call; same tags again, in two groups (even / odd processes).
    if rank == 0:
        time.sleep(0.3)  # make the others reach round 2's reads first
    init2 = bs.next_init_id()
    assert init2 == 2
    group, members = rank % 2, list(range(rank % 2, nprocs, 2))
    sub = bs.KVExchange(bs.group_namespace(init2, group), members.index(rank), len(members), timeout_s=20)
    got2 = sub.all_gather("blobs", blob(rank, 2))
    assert got2 == [blob(r, 2) for r in members], f"rank {rank}: round 2 read a wrong payload"
    bs.agree(sub, {"group": group, "members": members})
    emit(rank=rank, ok=True, namespaces=[ns1, sub.namespace])
    shutdown_distributed(ex)


def scenario_disagree(bad_rank: int) -> None:
    from jax_ub.comm import bootstrap as bs

    init_distributed()
    ex = bs.KVExchange(bs.group_namespace(bs.next_init_id(), 0), rank, nprocs, timeout_s=20)
    fields = {"mesh": [nprocs], "dtype": "bfloat16", "buffer_mib": 64, "version": "0.1.0"}
    if rank == bad_rank:
        fields.update(dtype="float32", buffer_mib=128)
    try:
        bs.agree(ex, fields)
    except bs.AgreementError as err:
        emit(rank=rank, error=str(err))
    else:
        emit(rank=rank, error=None)
    shutdown_distributed(ex)


def scenario_timeout(mode: str, timeout_s: float, missing: list[int]) -> None:
    from jax_ub.comm import bootstrap as bs

    # Heartbeats outlive the bootstrap timeout: the PeerTimeoutError must come first.
    init_distributed(heartbeat_s=int(timeout_s) + 20)
    if rank in missing:
        if mode == "exit":
            emit(rank=rank, left=True)
            sys.exit(0)
        time.sleep(timeout_s + 3)  # alive, but never publishes
        emit(rank=rank, left=True)
        os._exit(0)  # peers are gone: skip jax's shutdown barrier
    ns = bs.group_namespace(bs.next_init_id(), 0)
    ex = bs.KVExchange(ns, rank, nprocs, timeout_s=timeout_s)
    t0 = time.monotonic()
    try:
        ex.all_gather("handles", b"h%d" % rank)
    except bs.PeerTimeoutError as err:
        emit(rank=rank, error=str(err), elapsed=time.monotonic() - t0)
    else:
        emit(rank=rank, error=None, elapsed=time.monotonic() - t0)
    # Leave in order: once process 0 (which hosts jax.distributed's service) is gone, jax aborts
    # every other process. So the survivors first agree that all have reported, then process 0
    # lets the others exit before it does. No jax shutdown: it would wait for the missing rank.
    survivors = [r for r in range(nprocs) if r not in missing]
    done = bs.KVExchange(ns + "/survivors", survivors.index(rank), len(survivors), timeout_s=20)
    done.barrier("reported")
    if rank == 0:
        time.sleep(1.0)
    os._exit(0)


def scenario_env() -> None:
    keys = [
        "JAX_UB_TEST_COORD",
        "JAX_UB_TEST_NPROCS",
        "JAX_UB_TEST_RANK",
        "CUDA_VISIBLE_DEVICES",
        "NCCL_NVLS_ENABLE",
        "NVSHMEM_DISABLE_NVLS",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST",
        "JAX_UB_TEST_EXTRA",
    ]
    emit(rank=rank, pid=os.getpid(), pgid=os.getpgid(0), env={k: os.environ.get(k) for k in keys})
    print(f"stderr of rank {rank}", file=sys.stderr, flush=True)
    sys.exit(3 if rank == 1 else 0)


def scenario_hang() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    emit(rank=rank, pid=os.getpid(), grandchild=child.pid)
    time.sleep(600)


def main(argv: list[str]) -> None:
    name, rest = argv[0], argv[1:]
    if name == "gather":
        scenario_gather()
    elif name == "disagree":
        scenario_disagree(int(rest[0]))
    elif name == "timeout":
        scenario_timeout(rest[0], float(rest[1]), [int(r) for r in rest[2:]])
    elif name == "env":
        scenario_env()
    elif name == "hang":
        scenario_hang()
    else:
        raise SystemExit(f"unknown scenario {name!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
