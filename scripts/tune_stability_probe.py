"""How stable is JAX_UB_GEMM_TUNE's choice? Tunes the same GEMM shape afresh several times (each
trial with its own workspace size, which is part of the plan key, so nothing is cached) at several
`tune_reps` (the minimum runs per timing; each timing also covers >= 1 ms), on GPU 0, and prints
the kept candidate and the timed gain of each trial. With `cool` > 0 seconds of idle GPU before
each trial, every tuning starts from an idle GPU's clocks, as at a program's first trace.

    python3 scripts/tune_stability_probe.py [trials] [cool] [reps ...]
"""
from __future__ import annotations

import sys
import time


def main() -> None:
    import jax

    from jax_ub import _ext, _ffi

    jax.devices()  # the GPU's context first, as in a program
    trials = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    cool = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
    reps_list = [int(r) for r in sys.argv[3:]] or [5, 20, 60]
    mod = _ext.extension()
    tf32 = bool(_ffi.tf32_allowed(None))
    # (what, m, n, k): tp=4 chunk GEMMs of the bench shapes where the candidates differ most.
    shapes = [("ag_chunk 8192,8192,28672", 2048, 7168, 8192), ("rs_part 8192,8192,28672", 2048, 28672, 2048),
              ("ag_chunk 16384,12288,12288", 4096, 3072, 12288), ("rs_part 2048,8192,28672", 512, 28672, 2048)]
    salt = 0
    for what, m, n, k in shapes:
        for reps in reps_list:
            picks = []
            for _ in range(trials):
                salt += 1
                time.sleep(cool)
                ws = (32 << 20) + 256 * salt
                r = mod.gemm_warmup(0, m, n, k, 2, tf32, ws, tune_candidates=8, tune_reps=reps)
                picks.append(f"{r['chosen']}:{r['heuristic_ms'] / r['best_ms']:.3f}")
            print(f"{what:<28} reps {reps:>3}: kept:gain {' '.join(picks)}", flush=True)


if __name__ == "__main__":
    main()
