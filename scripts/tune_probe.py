"""Prints what GEMM tuning (JAX_UB_GEMM_TUNE) finds for the chunk GEMMs of the benchmark shapes:
the heuristic's first algorithm vs the fastest of the candidates, per shape, on GPU 0.

    python scripts/tune_probe.py [--tp 4]
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp

from jax_ub import config, gemm

SHAPES = [(8192, 8192, 28672), (8192, 8192, 8192), (16384, 12288, 12288), (2048, 8192, 28672)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=4)
    a = p.parse_args()
    tp = a.tp
    n_cand = config.get().gemm_tune
    print(f"tuning {n_cand} candidates per shape (bf16, GPU 0)")
    print(f"{'what':<10} {'m':>6} {'n':>6} {'k':>6} {'heuristic ms':>13} {'best ms':>8} {'chosen':>6} {'gain':>6}")
    for M, K, N in SHAPES:
        cases = [("ag_full", M, N // tp, K), ("ag_chunk", M // tp, N // tp, K),
                 ("rs_full", M, N, K // tp), ("rs_part", M // tp, N, K // tp)]
        for what, m, n, k in cases:
            r = gemm.warm([0], m, n, k, jnp.bfloat16, None)[0]
            gain = r["heuristic_ms"] / r["best_ms"] if r["best_ms"] else float("nan")
            print(f"{what:<10} {m:>6} {n:>6} {k:>6} {r['heuristic_ms']:>13.3f} {r['best_ms']:>8.3f} "
                  f"{r['chosen']:>6} {gain:>5.2f}x", flush=True)


if __name__ == "__main__":
    main()
