"""Worker for test_nccl_host.py: one rank of a 2-rank NCCL communicator made directly through
jax_ub.comm.nccl (no jax.distributed). Rank 0 writes the unique id to $JAX_UB_TEST_DIR/uid; the other
rank reads it. Prints RESULT lines.

Modes: "lengths" (rank 1 passes 0 bytes, rank 0 passes 16; both must fail naming the lengths),
"gather" (both pass 16 random bytes; each gets both in rank order), "absent" (rank 1 never creates
its member: rank 0's creation must fail within the timeout naming itself), "attach" (attaching a
communicator to a jax_ub member that does not exist, to a transport-ipc member, to a member of
another rank, or to a member that has one already fails, naming why, and leaves the communicator in
the table, where destroy finds it; a matching attach takes it out of the table).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from jax_ub.comm import nccl


def main() -> None:
    mode = sys.argv[1]
    rank = int(os.environ["JAX_UB_TEST_RANK"])
    uid_path = Path(os.environ["JAX_UB_TEST_DIR"]) / "uid"
    if rank == 0:
        uid = bytes(nccl.unique_id())
        uid2 = bytes(nccl.unique_id())
        tmp = uid_path.with_suffix(".tmp")
        tmp.write_bytes(uid + uid2)
        tmp.rename(uid_path)
    else:
        deadline = time.monotonic() + 30
        while not uid_path.exists():
            if time.monotonic() > deadline:
                raise SystemExit("no unique id from rank 0")
            time.sleep(0.05)
        both = uid_path.read_bytes()
        uid, uid2 = both[: len(both) // 2], both[len(both) // 2 :]
    if mode == "absent" and rank == 1:
        time.sleep(12)  # alive (rank 0's bootstrap socket stays up) but never joins
        print("RESULT absent_done", flush=True)
        return
    t0 = time.monotonic()
    try:
        nccl.create_comm(7, uid, rank, 2, 0, 6.0)
    except RuntimeError as e:
        print(f"RESULT create_failed {time.monotonic() - t0:.1f} {e}", flush=True)
        return
    print(f"RESULT created {time.monotonic() - t0:.1f}", flush=True)
    if mode == "attach":
        attach(rank, uid2)
        return
    payload = os.urandom(16) if not (mode == "lengths" and rank == 1) else b""
    try:
        got = nccl.allgather_bytes(7, 0, payload, 20.0)
    except RuntimeError as e:
        print(f"RESULT gather_failed {e}", flush=True)
    else:
        print(f"RESULT gather_ok {int(got[rank * 16 : (rank + 1) * 16] == payload)} {got.hex()}", flush=True)
    nccl.destroy_comm(7)
    print("RESULT destroyed", flush=True)


def attach(rank: int, uid2: bytes) -> None:
    """Attach refusals, then one attach that takes: see the module docstring."""
    from jax_ub import _ext

    mod = _ext.extension()
    nccl.create_comm(8, uid2, rank, 2, 0, 6.0)  # a second communicator: for "attached already"
    mib = 1 << 20
    mod.comm_create(900, 0, rank, 2, 0, mib, 10.0, nccl=False)  # transport ipc
    mod.comm_create(901, 0, 1 - rank, 2, 0, mib, 10.0, nccl=True)  # the other rank
    mod.comm_create(902, 0, rank, 2, 0, mib, 10.0, nccl=True)  # this rank: matches

    def try_attach(name: str, set_id: int, key: int) -> None:
        try:
            mod.comm_attach_nccl(set_id, 0, key)
            print(f"RESULT {name} attached", flush=True)
        except Exception as e:
            print(f"RESULT {name} failed {type(e).__name__}: {e}", flush=True)

    try_attach("no_member", 987654, 7)
    try_attach("ipc_member", 900, 7)
    try_attach("other_rank", 901, 7)
    print(f"RESULT listed_before {sorted(mod.nccl_comm_list())}", flush=True)
    try_attach("matching", 902, 7)
    try_attach("second", 902, 8)
    print(f"RESULT listed_after {sorted(mod.nccl_comm_list())}", flush=True)
    for set_id in (900, 901, 902):
        mod.comm_destroy_set(set_id)
    print(f"RESULT destroyed_count {nccl.destroy_comm(7)} {nccl.destroy_comm(8)}", flush=True)


if __name__ == "__main__":
    main()
