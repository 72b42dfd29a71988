"""One GPU: what splitting the GEMM into tp row chunks costs AG->GEMM and GEMM->RS on an idle
GPU, before any communication: a floor under T/T_ideal of every schedule that runs one GEMM per
chunk. For AG, also whether the push schedule would gain by running the peers' chunks, which at
tp 4's bench shapes have all landed before the local chunk's GEMM ends, as one or two GEMMs.

    python3 scripts/split_gemm_probe.py [candidates] [reps]

cuBLASLt through jax_ub's trace-time tuner, bf16, `reps` back-to-back runs per GEMM; candidates 1
times the heuristic's first algorithm (JAX_UB_GEMM_TUNE's default), more keep the fastest. For
each bench shape and tp, the sum over the whole GEMM ([M, K] @ [K, N/tp] for AG, [M, K/tp] @
[K/tp, N] for RS) of:
- tp chunk GEMMs of M/tp rows;
- AG: the local chunk, then the peers' rows in one GEMM (rank 0 or tp-1: contiguous rows);
- AG: the local chunk, then the peers' rows in two GEMMs (a middle rank r: r chunks, tp-1-r).
"""
from __future__ import annotations

from addend_probe import BENCH, tune_args  # scripts/ is on sys.path when run as a script

from jax_ub import _ext


def main() -> None:
    cands, reps = tune_args()
    mod = _ext.extension()
    cache: dict[int, float] = {}

    def ms(rows: int, n: int, k: int) -> float:
        key = (rows, n, k)
        if key not in cache:
            # The tuner times nothing below 2 candidates; the first's time is the heuristic's.
            r = mod.gemm_warmup(0, rows, n, k, 2, False, 32 << 20,
                                tune_candidates=max(cands, 2), tune_reps=reps)
            cache[key] = r["best_ms"] if cands > 1 else r["heuristic_ms"]
        return cache[key]

    print(f"{'op':>2} {'tp':>2} {'M,K,N':>18} | whole ms | tp row chunks: sum / whole | "
          f"AG: local + merged peers | AG: local + two ranges (middle rank)")
    for tp in (4, 2):
        for M, K, N in BENCH:
            m = M // tp
            # AG: [M, K] @ [K, N/tp] in tp chunks of rows; RS: [M, K/tp] @ [K/tp, N] in tp
            # partials of rows, one per owner.
            for op, n, k in (("ag", N // tp, K), ("rs", N, K // tp)):
                whole = ms(M, n, k)
                chunks = tp * ms(m, n, k)
                line = (f"{op:>2} {tp:>2} {f'{M},{K},{N}':>18} | {whole:.4f} | "
                        f"{chunks:.4f} / {chunks / whole:.3f}")
                if op == "ag":
                    merged = ms(m, n, k) + ms((tp - 1) * m, n, k)
                    r = tp // 2
                    two = ms(m, n, k) + ms(r * m, n, k) + (ms((tp - 1 - r) * m, n, k)
                                                           if tp - 1 - r else 0)
                    line += (f" | {merged:.4f} / {merged / whole:.3f} | "
                             f"{two:.4f} / {two / whole:.3f}")
                print(line, flush=True)


if __name__ == "__main__":
    main()
