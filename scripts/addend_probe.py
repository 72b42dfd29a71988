"""One GPU: what an addend (C = A @ B + C_in, beta = 1) costs the chain GEMM->RS's piece GEMMs,
with cuBLASLt's first heuristic candidate and with the fastest of its top candidates.

    python3 scripts/addend_probe.py [candidates] [reps]

For each piece shape of the bench's RS shapes (tp 4 and 2, two row pieces per step) and the whole
GEMM, prints the heuristic's and the best candidate's ms without and with the addend (cuBLASLt
timing through jax_ub's trace-time tuner: `reps` back-to-back runs per candidate, bf16).
"""
from __future__ import annotations

import sys

from jax_ub import _ext

BENCH = [(8192, 8192, 28672), (8192, 8192, 8192), (16384, 12288, 12288), (2048, 8192, 28672)]


def tune_args() -> tuple[int, int]:
    """(candidates, reps) from argv[1:3] (default 16, 20): how the GEMM probes time cuBLASLt."""
    cands = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    return cands, reps


def main() -> None:
    cands, reps = tune_args()
    mod = _ext.extension()
    print(f"{'tp':>2} {'M,K,N':>18} {'piece m,n,k':>18} {'pieces':>6} | plain: heur  best (#) | "
          f"addend: heur  best (#) | addend/plain best | pieces sum / whole")
    for tp in (4, 2):
        for M, K, N in BENCH:
            k = K // tp
            mo = M // tp
            whole = mod.gemm_warmup(0, M, N, k, 2, False, 32 << 20, tune_candidates=cands,
                                    tune_reps=reps)
            m = mo // 2
            row = []
            for acc in (False, True):
                r = mod.gemm_warmup(0, m, N, k, 2, False, 32 << 20, tune_candidates=cands,
                                    accumulate=acc, tune_reps=reps)
                row.append(r)
            p, a = row
            pieces = 2 * tp
            # The chain: step 0's pieces plain, the other steps' with the addend.
            chain = 2 * p["best_ms"] + (pieces - 2) * a["best_ms"]
            print(f"{tp:>2} {f'{M},{K},{N}':>18} {f'{m},{N},{k}':>18} {pieces:>6} | "
                  f"{p['heuristic_ms']:.4f} {p['best_ms']:.4f} ({p['chosen']:>2}) | "
                  f"{a['heuristic_ms']:.4f} {a['best_ms']:.4f} ({a['chosen']:>2}) | "
                  f"{a['best_ms'] / p['best_ms']:.3f} (heur {a['heuristic_ms'] / p['heuristic_ms']:.3f}) | "
                  f"{chain:.3f} / {whole['best_ms']:.3f} (heur whole {whole['heuristic_ms']:.3f})",
                  flush=True)


if __name__ == "__main__":
    main()
