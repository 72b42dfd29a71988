"""Worker for test_nccl_host.py: one rank of a 2-rank NCCL communicator made directly through
jax_ub._nccl (no jax.distributed). Rank 0 writes the unique id to $JAX_UB_TEST_DIR/uid; the other
rank reads it. Prints RESULT lines.

Modes: "lengths" (rank 1 passes 0 bytes, rank 0 passes 16; both must fail naming the lengths),
"gather" (both pass 16 random bytes; each gets both in rank order), "absent" (rank 1 never creates
its member: rank 0's creation must fail within the timeout naming itself), "attach" (attaching the
communicator to a jax_ub member that does not exist fails, and the communicator stays in the table,
where destroy finds it).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from jax_ub import _nccl


def main() -> None:
    mode = sys.argv[1]
    rank = int(os.environ["JAX_UB_TEST_RANK"])
    uid_path = Path(os.environ["JAX_UB_TEST_DIR"]) / "uid"
    if rank == 0:
        uid = bytes(_nccl.unique_id())
        tmp = uid_path.with_suffix(".tmp")
        tmp.write_bytes(uid)
        tmp.rename(uid_path)
    else:
        deadline = time.monotonic() + 30
        while not uid_path.exists():
            if time.monotonic() > deadline:
                raise SystemExit("no unique id from rank 0")
            time.sleep(0.05)
        uid = uid_path.read_bytes()
    if mode == "absent" and rank == 1:
        time.sleep(12)  # alive (rank 0's bootstrap socket stays up) but never joins
        print("RESULT absent_done", flush=True)
        return
    t0 = time.monotonic()
    try:
        _nccl.create_comm(7, uid, rank, 2, 0, 6.0)
    except RuntimeError as e:
        print(f"RESULT create_failed {time.monotonic() - t0:.1f} {e}", flush=True)
        return
    print(f"RESULT created {time.monotonic() - t0:.1f}", flush=True)
    if mode == "attach":
        from jax_ub import _ext

        try:
            _ext.extension().comm_attach_nccl(987654, 0, 7)
            print("RESULT attach_ran", flush=True)
        except Exception as e:
            print(f"RESULT attach_failed {type(e).__name__}: {e}", flush=True)
        print(f"RESULT listed {sorted(_ext.extension().nccl_comm_list())}", flush=True)
        print(f"RESULT destroyed_count {_nccl.destroy_comm(7)}", flush=True)
        return
    payload = os.urandom(16) if not (mode == "lengths" and rank == 1) else b""
    try:
        got = _nccl.allgather_bytes(7, 0, payload, 20.0)
    except RuntimeError as e:
        print(f"RESULT gather_failed {e}", flush=True)
    else:
        print(f"RESULT gather_ok {int(got[rank * 16:(rank + 1) * 16] == payload)} {got.hex()}",
              flush=True)
    _nccl.destroy_comm(7)
    print("RESULT destroyed", flush=True)


if __name__ == "__main__":
    main()
