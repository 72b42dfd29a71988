"""Does splitting each peer's partial of a ring/pipeline GEMM->RS in two row pieces pay at a given
shape? overlap.RS_SPLIT_BYTES decides it by the partial's size (fitted at tp=4); this compiles each
method twice, once as the library decides and once with every partial whole, and times them
interleaved with the benchmark's harness (settled bursts, shuffled order, median of 7), beside the
GEMM alone on every GPU.

    python scripts/rs_split_probe.py [M,K,N ...]     (over all local GPUs; run from scripts/)
"""

from __future__ import annotations

import argparse
import sys

import jax
from ag_gap_probe import mm, rs_inputs, setup  # scripts/ is on sys.path when run as a script
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub import overlap
from jax_ub.bench.harness import time_impls


def compiled(smap, method, x, w, split_bytes):
    f = smap(lambda x, w: jax_ub.matmul_reduce_scatter(x, w, "tp", method=method),
             (P(None, "tp"), P("tp", None)), P("tp", None))
    saved = overlap.RS_SPLIT_BYTES
    overlap.RS_SPLIT_BYTES = split_bytes
    try:
        return f.lower(x, w).compile()  # rs_splits runs while tracing, i.e. here
    finally:
        overlap.RS_SPLIT_BYTES = saved


def main():
    tp = len(jax.devices())
    mesh, shapes, smap = setup(tp, sys.argv[1:], [(2048, 8192, 28672), (16384, 8192, 2048),
                                                 (8192, 8192, 4096), (8192, 4096, 4096)])
    a = argparse.Namespace(warmup=3, iters=10, reps=7, settle_ms=25.0)
    for M, K, N in shapes:
        x, w = rs_inputs(mesh, M, K, N)
        part = (M // tp) * N * 2
        lib = overlap.rs_splits("ring", M // tp, N, 2, K // tp)
        impls = {"gemm": (smap(mm, (P(None, "tp"), P("tp", None)), P(None, None)), (x, w))}
        for method in ("ring", "pipeline"):
            impls[f"{method} lib({lib})"] = (compiled(smap, method, x, w, overlap.RS_SPLIT_BYTES), (x, w))
            impls[f"{method} whole"] = (compiled(smap, method, x, w, (0, 0)), (x, w))
            impls[f"{method} split"] = (compiled(smap, method, x, w, (0, 1 << 60)), (x, w))
        res = time_impls(f"{M},{K},{N}", impls, a)
        print(f"SPLIT tp {tp} {M},{K},{N} partial {part / 2**20:.0f} MiB: "
              + ", ".join(f"{k} {v:.3f}" for k, v in res.items()), flush=True)
    jax_ub.shutdown()


if __name__ == "__main__":
    main()
