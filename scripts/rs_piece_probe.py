"""Is the first GEMM piece of a GEMM->RS op slower than the others in steady state, as the
single-call timelines suggest (tp=2 chain at 2048,8192,28672: 0.30 ms against 0.18 ms for the
same-shaped second piece)? Per shape and method: the benchmark's timing, then the traced spans of
6 back-to-back calls on device 0 (GEMM and copy starts and durations per call).

    python scripts/rs_piece_probe.py [M,K,N ...]     (over all local GPUs; run from scripts/)
"""

from __future__ import annotations

import sys

import jax
from ag_gap_probe import mm, print_traces, rs_inputs, setup, timed  # scripts/ is on sys.path
from jax.sharding import PartitionSpec as P

import jax_ub


def main():
    tp = len(jax.devices())
    mesh, shapes, smap = setup(tp, sys.argv[1:], [(2048, 8192, 28672), (8192, 8192, 8192)])
    for M, K, N in shapes:
        x, w = rs_inputs(mesh, M, K, N)
        gemm = smap(mm, (P(None, "tp"), P("tp", None)), P(None, None))
        print(f"PIECE tp {tp} {M},{K},{N} gemm alone (every GPU): {timed(gemm, (x, w)):.3f} ms", flush=True)
        for method in ("chain", "ring", "pipeline"):
            f = smap(lambda x, w, m=method: jax_ub.matmul_reduce_scatter(x, w, "tp", method=m),
                     (P(None, "tp"), P("tp", None)), P("tp", None))
            print(f"PIECE tp {tp} {M},{K},{N} {method}: {timed(f, (x, w)):.3f} ms", flush=True)
            print_traces(f"{M},{K},{N} {method}", f, (x, w), max_device=0)
    jax_ub.shutdown()


if __name__ == "__main__":
    main()
