"""Where should the bulk all-gather's same-device copies run? Over all local GPUs (tp = device
count, or argv[1]), per bench bulk shape, the median over 7 interleaved rounds (each variant once
per round, 10 back-to-back calls) of the GEMM alone, jax_ub's all-gather alone, and
``bulk_all_gather`` with ``bulk_copy_sms`` 0 (the GEMM waits for the copies) and 8 / 16 / 32 (the
copies as a kernel beside the GEMM's first rows), then the ratio to max(GEMM, all-gather): the
bulk target is 1.10. Also the reduce-scatter with its sum after the GEMM (bulk_reduce_sms 0).
Then one traced call of each variant: device 0's spans (name, chunk @ stream, start-end ms).

    python scripts/bulk_probe.py TP [M,K,N ...]   (default: the bench's bulk shapes)
"""

from __future__ import annotations

import sys

import jax
from piece_probe import interleaved  # scripts/ is on sys.path when run as a script

import jax_ub
from jax_ub import config
from jax_ub.bench import bulk
from jax_ub.bench.__main__ import BULK_SHAPES, capture_timeline, time_fn


def main():
    tp = int(sys.argv[1]) if len(sys.argv) > 1 else len(jax.devices())
    shapes = [tuple(int(v) for v in s.split(",")) for s in sys.argv[2:]] or BULK_SHAPES
    mesh = jax.make_mesh((tp,), ("tp",), devices=jax.devices()[:tp])
    jax_ub.initialize(mesh, "tp")
    for M, K, N in shapes:
        for kind in bulk.KINDS:
            impls = bulk.build(kind, mesh, M, K, N, dtype_name="bfloat16", cuda=True)
            v = {name: impls[name]() for name in ("gemm_alone", "comm_jax_ub")}
            variants = (0, 8, 16, 32) if kind == "ag" else (0,)
            for sms in variants:
                with config.override(bulk_copy_sms=sms):  # read at trace time: trace it here
                    f, args = impls["jax_ub"]()
                    time_fn(f, args, warmup=1, iters=1, reps=1)
                v[f"copy_sms {sms}"] = (f, args)
            r = interleaved(v)
            bound = max(r["gemm_alone"], r["comm_jax_ub"])
            print(f"BULK {kind} tp{tp} {M},{K},{N}: " + ", ".join(f"{k} {t:.3f}" for k, t in r.items())
                  + " | /max: " + ", ".join(f"{k} {t / bound:.2f}" for k, t in r.items() if k.startswith("copy")),
                  flush=True)
            for name in [k for k in v if k.startswith("copy")]:  # one traced call each, device 0
                records, why = capture_timeline(*v[name])
                spans = sorted((r for r in records or [] if int(r["device"]) == 0), key=lambda r: r["start_ms"])
                print(f"  trace {kind} {name} dev0: " + (why or " ".join(
                    f"{r['name']}{r['chunk']}@{r['stream']} {r['start_ms']:.3f}-{r['end_ms']:.3f}" for r in spans)))
    jax_ub.shutdown()


if __name__ == "__main__":
    main()
