"""One GPU: how much shorter is a row piece of an AG chunk GEMM than the whole chunk, with
cuBLASLt's first heuristic candidate and with the fastest of its top candidates? (The push AG's
tail after the last copy is the last chunk's GEMM, or with pieces the last piece's.)

    python3 scripts/piece_gemm_probe.py [candidates] [reps]
"""
from __future__ import annotations

from addend_probe import BENCH, tune_args  # scripts/ is on sys.path when run as a script

from jax_ub import _ext


def main() -> None:
    cands, reps = tune_args()
    mod = _ext.extension()
    print(f"{'tp':>2} {'M,K,N':>18} {'rows':>5} {'n':>6} {'k':>6} | heur ms  best ms (#) | "
          f"best / whole chunk's best")
    for tp in (4, 2):
        for M, K, N in BENCH:
            chunk = M // tp
            whole = None
            for div in (1, 2, 4):
                m = chunk // div
                r = mod.gemm_warmup(0, m, N // tp, K, 2, False, 32 << 20, tune_candidates=cands,
                                    tune_reps=reps)
                if r["best_ms"] <= 0:  # already tuned as another case's shape (cached)
                    print(f"{tp:>2} {f'{M},{K},{N}':>18} {m:>5}: {r}")
                    continue
                whole = whole or r["best_ms"]
                print(f"{tp:>2} {f'{M},{K},{N}':>18} {m:>5} {N // tp:>6} {K:>6} | "
                      f"{r['heuristic_ms']:.4f}  {r['best_ms']:.4f} ({r['chosen']:>2}) | "
                      f"{r['best_ms'] / whole:.3f} (1/{div} of the rows)", flush=True)


if __name__ == "__main__":
    main()
