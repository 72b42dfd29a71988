"""One GPU, one process: does JAX_UB_GEMM_TUNE make the GEMMs the overlapped ops run faster, and
do the screened kernel variants (JAX_UB_GEMM_TUNE_VARIANTS) add to it?

Times each GEMM schedule of split_gemm_probe.py (the whole GEMM, and the tp row-chunk GEMMs back
to back) in three plans side by side, in interleaved rounds, so that no process-to-process or
clock difference between two runs (5% and more on an H100/H200) enters the ratio:
- ``heuristic``: cuBLASLt's first candidate (``gemm_tune=0``);
- ``tuned``: the heuristic's 8 candidates timed at trace time (``gemm_tune=8``, no variants);
- ``wide``: as tuned by default (``gemm_tune=8``, ``gemm_tune_variants=4``).
They get distinct plans in one process through the workspace size, which is part of cuBLASLt's
plan key (33, 32 and 34 MiB; no candidate here uses that much).

    python3 scripts/tune_ab_probe.py [reps] [iters]

Prints, per op, tp and bench shape: the heuristic's whole GEMM (ms), its chunks over it, the tuned
and wide whole GEMM and chunks over the heuristic's whole GEMM, and wide over tuned (below 1: the
variants gain), with the kept candidate per GEMM shape and plan (index: the heuristic's rank, or
``v`` for a variant).
"""
from __future__ import annotations

import functools
import statistics
import sys

from addend_probe import BENCH  # scripts/ is on sys.path when run as a script

VARIANTS = {"heuristic": {"gemm_tune": 0, "gemm_workspace_mib": 33},
            "tuned": {"gemm_tune": 8, "gemm_tune_variants": 0, "gemm_workspace_mib": 32},
            "wide": {"gemm_tune": 8, "gemm_tune_variants": 4, "gemm_workspace_mib": 34}}


def _kept(warmed: dict, n: int, k: int, ws_mib: int, rows: int) -> str:
    """The candidate tuning kept for the GEMM [rows, k] @ [k, n] of the plan with that workspace:
    its rank in the heuristic's order, or ``v<i>`` for a screened variant; ``-`` if not tuned."""
    for key, r in warmed.items():
        if key[1:4] == (rows, n, k) and key[6] == ws_mib << 20 and r["candidates"]:
            c, h = r["chosen"], r["heuristic_candidates"]
            return f"v{c - h}" if c >= h else str(c)
    return "-"


def main() -> None:
    import jax
    import jax.numpy as jnp

    import jax_ub
    from jax_ub import config
    from jax_ub import gemm as g
    from jax_ub.bench import harness as h

    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    iters = int(sys.argv[2]) if len(sys.argv) > 2 else 10

    def gemms(*args):  # row pieces, then b: one GEMM per piece, back to back
        *pieces, b = args
        return tuple(jax_ub.matmul(p, b, method="cublaslt") for p in pieces)

    # One jitted function per variant: the config is read at trace time.
    runs = {v: jax.jit(lambda *a: gemms(*a)) for v in VARIANTS}
    key = iter(jax.random.split(jax.random.key(0), 1024))

    def rand(shape):
        return jax.random.normal(next(key), shape, jnp.float32).astype(jnp.bfloat16)

    print(f"{reps} rounds of {iters} calls, median ms; ratios over the heuristic's whole GEMM, and "
          f"wide over tuned")
    print(f"{'op':>2} {'tp':>2} {'M,K,N':>18} | heur. whole | heur. chunks | tuned whole | tuned chunks"
          f" | wide whole | wide chunks | wide/tuned whole | wide/tuned chunks | kept (rows: tuned, wide)")
    for tp in (4, 2):
        for M, K, N in BENCH:
            m = M // tp
            for op, n, k in (("ag", N // tp, K), ("rs", N, K // tp)):
                a, b = rand((M, k)), rand((k, n))
                scheds = {"whole": [a, b], "chunks": [a[i * m:(i + 1) * m] for i in range(tp)] + [b]}
                for v, cfg in VARIANTS.items():
                    with config.override(**cfg):
                        for args in scheds.values():
                            jax.block_until_ready(runs[v](*args))  # trace (tune), compile, warm up
                times = {(v, s): [] for v in VARIANTS for s in scheds}
                for _ in range(reps):
                    for v, s in times:
                        times[(v, s)].append(h.time_fn(runs[v], scheds[s], warmup=1, iters=iters, reps=1))
                ms = {vs: statistics.median(t) for vs, t in times.items()}
                w0 = ms[("heuristic", "whole")]
                kept = functools.partial(_kept, g._warmed, n, k)

                print(f"{op:>2} {tp:>2} {f'{M},{K},{N}':>18} | {w0:11.4f} | "
                      f"{ms[('heuristic', 'chunks')] / w0:12.3f} | {ms[('tuned', 'whole')] / w0:11.3f} | "
                      f"{ms[('tuned', 'chunks')] / w0:12.3f} | {ms[('wide', 'whole')] / w0:10.3f} | "
                      f"{ms[('wide', 'chunks')] / w0:11.3f} | "
                      f"{ms[('wide', 'whole')] / ms[('tuned', 'whole')]:16.3f} | "
                      f"{ms[('wide', 'chunks')] / ms[('tuned', 'chunks')]:17.3f} | "
                      f"{M}: {kept(32, M)}, {kept(34, M)}; {m}: {kept(32, m)}, {kept(34, m)}",
                      flush=True)
                del a, b, scheds


if __name__ == "__main__":
    main()
