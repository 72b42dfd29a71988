"""One GPU, one process: does JAX_UB_GEMM_TUNE make the GEMMs the overlapped ops run faster?

Times each GEMM schedule of split_gemm_probe.py (the whole GEMM, and the tp row-chunk GEMMs back
to back) in two variants side by side, in interleaved rounds (each in a new order, every burst after
an untimed one: ``harness.time_impls``, as the bench), so that no process-to-process or clock
difference between two runs (5% and more on an H100/H200) enters the ratio:
- ``heuristic``: cuBLASLt's first candidate (``gemm_tune=0``);
- ``tuned``: as tuned at trace time (``gemm_tune=8``).
The two get distinct plans in one process through the workspace size, which is part of cuBLASLt's
plan key (33 MiB against 32 MiB, the default; no candidate here uses that much).

    python3 scripts/tune_ab_probe.py [reps] [iters]

Prints, per op, tp and bench shape: the heuristic's whole GEMM (ms), its chunks over it, and the
tuned whole GEMM and chunks over the heuristic's (below 1: tuning gains), with the kept candidate
per GEMM shape (rank in the heuristic's order).
"""
from __future__ import annotations

import argparse
import sys

from addend_probe import BENCH  # scripts/ is on sys.path when run as a script
from split_gemm_probe import bf16_normal, chunk_gemms

VARIANTS = {"heuristic": {"gemm_tune": 0, "gemm_workspace_mib": 33},
            "tuned": {"gemm_tune": 8, "gemm_workspace_mib": 32}}


def main() -> None:
    import jax

    from jax_ub import config
    from jax_ub import gemm as g
    from jax_ub.bench import harness as h

    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    iters = int(sys.argv[2]) if len(sys.argv) > 2 else 10

    # One jitted function per variant: the config is read at trace time.
    runs = {v: jax.jit(lambda *a: chunk_gemms(*a)) for v in VARIANTS}
    rand = bf16_normal()

    print(f"{reps} rounds of {iters} calls, median ms; ratios over the heuristic's whole GEMM, and "
          f"tuned over heuristic")
    print(f"{'op':>2} {'tp':>2} {'M,K,N':>18} | heur. whole | heur. chunks | tuned whole | tuned chunks"
          f" | tuned/heur. chunks | kept (rows: candidate)")
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
                # A new order every round, each burst after an untimed one (harness.time_impls):
                # under the power cap a fixed order favoured some positions by several percent
                # (plans that kept the same algorithm came out 0.97-1.07 apart).
                got = h.time_impls(f"{op} {tp} {M},{K},{N}",
                                   {f"{v} {s}": (runs[v], scheds[s]) for v in VARIANTS for s in scheds},
                                   argparse.Namespace(warmup=0, iters=iters, reps=reps, settle_ms=25.0))
                ms = {(v, s): got[f"{v} {s}"] for v in VARIANTS for s in scheds}
                w0 = ms[("heuristic", "whole")]
                kept = {kk[1]: r["chosen"] for kk, r in g._warmed.items()
                        if kk[2] == n and kk[3] == k and kk[7] == 8 and kk[1] in (M, m)}
                print(f"{op:>2} {tp:>2} {f'{M},{K},{N}':>18} | {w0:11.4f} | "
                      f"{ms[('heuristic', 'chunks')] / w0:12.3f} | {ms[('tuned', 'whole')] / w0:11.3f} | "
                      f"{ms[('tuned', 'chunks')] / w0:12.3f} | "
                      f"{ms[('tuned', 'chunks')] / ms[('heuristic', 'chunks')]:18.3f} | {dict(sorted(kept.items()))}",
                      flush=True)
                del a, b, scheds


if __name__ == "__main__":
    main()
