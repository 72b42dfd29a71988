"""Where should the bulk all-gather's same-device copies run? Over all local GPUs (tp = device
count, or argv[1]), per bench bulk shape, the median over 7 interleaved rounds (each variant once
per round, 10 back-to-back calls) of the GEMM alone, jax_ub's all-gather alone, and
``bulk_all_gather`` with ``bulk_copy_sms`` 0 (the GEMM waits for the copies) and 8 / 16 / 32 (the
copies as a kernel beside the GEMM's first rows), then the ratio to max(GEMM, all-gather): the
bulk target is 1.10. The reduce-scatter: alone with its push and fp32 sum in 1 / 2 / 4 / 8 row pieces
(``rs_pieces``), and in bulk with its sum after the GEMM (``bulk_reduce_sms`` 0) or beside it on
16 SMs the GEMM leaves. PROBE_KINDS=ag or rs runs one kind only.
Then one traced call of each variant: device 0's spans (name, chunk @ stream, start-end ms).

    python scripts/bulk_probe.py TP [M,K,N ...]   (default: the bench's bulk shapes)
"""

from __future__ import annotations

import os
import sys

import jax
from piece_probe import interleaved  # scripts/ is on sys.path when run as a script

import jax_ub
from jax_ub import config
from jax_ub.bench import bulk
from jax_ub.bench.harness import BULK_SHAPES, capture_timeline, time_fn

RS_PIECES = (1, 2, 4, 8)
RS_BULK_SMS = (0, 16)


def main():
    tp = int(sys.argv[1]) if len(sys.argv) > 1 else len(jax.devices())
    shapes = [tuple(int(v) for v in s.split(",")) for s in sys.argv[2:]] or BULK_SHAPES
    mesh = jax.make_mesh((tp,), ("tp",), devices=jax.devices()[:tp])
    jax_ub.initialize(mesh, "tp")
    for M, K, N in shapes:
        for kind in os.environ.get("PROBE_KINDS", ",".join(bulk.KINDS)).split(","):
            impls = bulk.build(kind, mesh, M, K, N, dtype_name="bfloat16", cuda=True)
            v = {"gemm_alone": impls["gemm_alone"]()}
            if kind == "ag":
                comm = {"comm_jax_ub": {}}
                variants = {f"copy_sms {n}": dict(bulk_copy_sms=n) for n in (0, 8, 16, 32)}
            else:  # row pieces of the push and sum (rs_pieces), SMs kept from the GEMM for the sum
                comm = {f"comm_jax_ub p{p}": dict(rs_pieces=p) for p in RS_PIECES}
                variants = {f"bulk sms{n}": dict(bulk_reduce_sms=n) for n in RS_BULK_SMS}
            for group, make in ((comm, impls["comm_jax_ub"]), (variants, impls["jax_ub"])):
                for name, kw in group.items():
                    with config.override(**kw):  # read at trace time: trace it here
                        f, args = make()
                        time_fn(f, args, warmup=1, iters=1, reps=1)
                        if "rs_pieces" in kw:  # the traced op got this variant's pieces
                            hlo = f.lower(*args).as_text()
                            assert f"splits = {kw['rs_pieces']} : i32" in hlo, (name, hlo[-2000:])
                    v[name] = (f, args)
            r = interleaved(v)
            bound = max(r["gemm_alone"], min(t for k, t in r.items() if k.startswith("comm")))
            print(f"BULK {kind} tp{tp} {M},{K},{N}: " + ", ".join(f"{k} {t:.3f}" for k, t in r.items())
                  + " | /max(gemm, best comm): " + ", ".join(f"{k} {t / bound:.2f}" for k, t in r.items()
                                                             if k in variants), flush=True)
            for name in variants:  # one traced call each, device 0
                records, why = capture_timeline(*v[name])
                spans = sorted((r for r in records or [] if int(r["device"]) == 0), key=lambda r: r["start_ms"])
                print(f"  trace {kind} {name} dev0: " + (why or " ".join(
                    f"{r['name']}{r['chunk']}@{r['stream']} {r['start_ms']:.3f}-{r['end_ms']:.3f}" for r in spans)))
    jax_ub.shutdown()


if __name__ == "__main__":
    main()
