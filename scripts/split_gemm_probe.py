"""One GPU: what splitting the GEMM into tp row chunks costs AG->GEMM and GEMM->RS, before any
communication: a floor under T/T_ideal of every schedule that runs one cuBLASLt GEMM per chunk.
For AG, also whether the push schedule would gain by running the peers' chunks (which at tp 4's
bench shapes have all landed before the local chunk's GEMM ends) as one or two GEMMs.

    python3 scripts/split_gemm_probe.py [reps] [iters]
    JAX_UB_GEMM_TUNE=8 python3 scripts/split_gemm_probe.py     # cuBLASLt algorithms tuned per shape

Random bf16 data (a fixed pattern draws less power and runs at higher clocks), `jax_ub.matmul`
(cuBLASLt, the GEMM the overlapped ops run), each schedule one jitted program of back-to-back
GEMMs over pre-sliced row pieces; `reps` rounds in which every schedule of a shape runs `iters`
calls, each round in a new order after an untimed burst (``harness.time_impls``, as the bench);
medians. For each bench shape and tp, ms of the whole GEMM ([M, K] @ [K, N/tp] for
AG, [M, K/tp] @ [K/tp, N] for RS) and, over it, of:
- tp chunk GEMMs of M/tp rows;
- AG: the local chunk, then the peers' rows in one GEMM (rank 0 or tp-1: contiguous rows);
- AG: the local chunk, then the peers' rows in two GEMMs (a middle rank r: r chunks, tp-1-r).
"""
from __future__ import annotations

import argparse
import sys

from addend_probe import BENCH  # scripts/ is on sys.path when run as a script


def chunk_gemms(*args):
    """Row pieces of x, then w: one cuBLASLt GEMM per piece (``jax_ub.matmul``), back to back."""
    import jax_ub

    *pieces, w = args
    return tuple(jax_ub.matmul(p, w, method="cublaslt") for p in pieces)


def bf16_normal(seed: int = 0):
    """A function of a shape giving a new standard-normal bf16 array at each call."""
    import jax
    import jax.numpy as jnp

    key = iter(jax.random.split(jax.random.key(seed), 1024))
    return lambda shape: jax.random.normal(next(key), shape, jnp.float32).astype(jnp.bfloat16)


def main() -> None:
    import jax

    import jax_ub
    from jax_ub.bench import harness as h

    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    iters = int(sys.argv[2]) if len(sys.argv) > 2 else 10

    run = jax.jit(chunk_gemms)
    rand = bf16_normal()

    print(f"JAX_UB_GEMM_TUNE={jax_ub.config.get().gemm_tune}, {reps} rounds of {iters} calls, "
          f"median ms")
    print(f"{'op':>2} {'tp':>2} {'M,K,N':>18} | whole ms | tp row chunks: ms / whole | "
          f"AG: local + merged peers | AG: local + two ranges (middle rank)")
    for tp in (4, 2):
        for M, K, N in BENCH:
            m, r = M // tp, tp // 2
            for op, n, k in (("ag", N // tp, K), ("rs", N, K // tp)):
                a, b = rand((M, k)), rand((k, n))
                scheds = {"whole": [M], "chunks": [m] * tp}
                if op == "ag":
                    scheds["merged"] = [m, (tp - 1) * m]
                    scheds["two"] = [m, r * m] + ([(tp - 1 - r) * m] if tp - 1 - r else [])
                args = {}
                for name, rows in scheds.items():
                    starts = [sum(rows[:i]) for i in range(len(rows))]
                    args[name] = [a[s:s + n_] for s, n_ in zip(starts, rows, strict=True)] + [b]
                    jax.block_until_ready(run(*args[name]))  # compile, warm up
                ms = h.time_impls(f"{op} {tp} {M},{K},{N}", {name: (run, args[name]) for name in scheds},
                                  argparse.Namespace(warmup=0, iters=iters, reps=reps, settle_ms=25.0))
                line = f"{op:>2} {tp:>2} {f'{M},{K},{N}':>18} | {ms['whole']:.4f}"
                for name in ("chunks", "merged", "two"):
                    if name in ms:
                        line += f" | {ms[name]:.4f} / {ms[name] / ms['whole']:.3f}"
                if jax_ub.config.get().gemm_tune > 1:  # the candidate tuning kept per GEMM shape
                    from jax_ub import gemm as g
                    kept = {key[1]: f"{r['chosen']}/{r['candidates']}:{r['heuristic_ms']:.3f}/{r['best_ms']:.3f}"
                            for key, r in g._warmed.items()
                            if key[2] == n and key[3] == k and any(key[1] in r_ for r_ in scheds.values())}
                    line += f" | kept {dict(sorted(kept.items()))}"
                print(line, flush=True)
                del a, b, args


if __name__ == "__main__":
    main()
