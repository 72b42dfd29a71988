"""Which piece geometry wins? Over all local GPUs (tp = device count, or argv[1]), per shape, the
median over 7 interleaved rounds (each variant once per round in a new order, 10 back-to-back calls
after an untimed burst, so clock and power drift hits every variant alike) of the GEMM on every
GPU, then:

* AG->GEMM push with its last peer chunk in 1, 2 and 4 row pieces (``ag_push_pieces``);
* GEMM->RS ring, chain with 2 and 4 pieces per step cut into rows or into columns
  (``rs_chain_pieces`` x ``rs_chain_split``), and columns with 4 and 8 blocks
  (``rs_column_pieces``), the 4-block one also with its block sums held to one block per SM.

    python scripts/piece_probe.py TP [M,K,N ...]   (default: the four tp-4 bench shapes)

PROBE_OPS=ag runs the AG part only.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
from ag_gap_probe import mm, setup  # scripts/ is on sys.path when run as a script
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub import config, overlap
from jax_ub.bench.harness import time_fn, time_impls

SHAPES = [(8192, 8192, 28672), (8192, 8192, 8192), (16384, 12288, 12288), (2048, 8192, 28672)]


def interleaved(variants, rounds=7, label="probe"):
    """{name: median ms per call} of ``variants`` ({name: (f, args)}), timed as the bench times its
    impls (``harness.time_impls``): every round in a new order, each timed burst of 10 calls after
    an untimed burst of the same variant, so neither a fixed order nor the load just before a
    burst (under the power cap, clocks follow the last few ms) favours a variant."""
    for f, args in variants.values():
        time_fn(f, args, warmup=3, iters=1, reps=1)  # compile and warm
    return time_impls(label, variants, argparse.Namespace(warmup=0, iters=10, reps=rounds, settle_ms=25.0))


def main():
    tp = int(sys.argv[1]) if len(sys.argv) > 1 else len(jax.devices())
    mesh, shapes, smap = setup(tp, sys.argv[2:], SHAPES)
    key = iter(range(100))

    def rand(shape, spec):
        return jax.device_put(jax.random.normal(jax.random.key(next(key)), shape, jnp.bfloat16),
                              NamedSharding(mesh, spec))

    for M, K, N in shapes:
        # AG: x[M/tp, K] gathered, @ w[K, N/tp].
        x, w = rand((M, K), P("tp", None)), rand((K, N), P(None, "tp"))
        xf = rand((M * tp, K), P("tp", None))  # the full [M, K] on every GPU
        v = {"gemm all GPUs": (smap(mm, (P("tp", None), P(None, "tp")), P("tp", None)), (xf, w))}
        for pieces in (1, 2, 4):
            with config.override(ag_push_pieces=pieces):  # read at trace time: trace it here
                f = smap(lambda x, w: jax_ub.all_gather_matmul(x, w, "tp", method="push"),
                         (P("tp", None), P(None, "tp")), P(None, "tp"))
                time_fn(f, (x, w), warmup=1, iters=1, reps=1)
            v[f"push{pieces}"] = (f, (x, w))
        r = interleaved(v)
        print(f"PIECES ag tp{tp} {M},{K},{N}: " + ", ".join(f"{k} {t:.3f}" for k, t in r.items()), flush=True)
        if os.environ.get("PROBE_OPS", "ag,rs") == "ag":
            continue
        # RS: x[M, K/tp] @ w[K/tp, N], reduce-scattered over M.
        x, w = rand((M, K), P(None, "tp")), rand((K, N), P("tp", None))
        v = {"gemm all GPUs": (smap(lambda a, b: mm(a, b)[None], (P(None, "tp"), P("tp", None)),
                                    P("tp", None, None)), (x, w))}

        def rs(m, args):
            f = smap(lambda a, b: jax_ub.matmul_reduce_scatter(a, b, "tp", method=m),
                     (P(None, "tp"), P("tp", None)), P("tp", None))
            time_fn(f, args, warmup=1, iters=1, reps=1)  # traced under the caller's override
            return f, args

        v["ring"] = rs("ring", (x, w))
        for split in ("rows", "cols"):
            for pieces in (2, 4):
                with config.override(rs_chain_pieces=pieces, rs_chain_split=split):
                    v[f"chain {split} {pieces}"] = rs("chain", (x, w))
        for pieces in (4, 8):
            with config.override(rs_column_pieces=pieces):
                v[f"columns {pieces}"] = rs("columns", (x, w))
        sms = jax.devices()[0].core_count
        with config.override(rs_column_pieces=4):
            overlap.REDUCE_BLOCKS = sms
            v[f"columns 4, sums on {sms} blocks"] = rs("columns", (x, w))
            overlap.REDUCE_BLOCKS = 0
        r = interleaved(v)
        print(f"PIECES rs tp{tp} {M},{K},{N}: " + ", ".join(f"{k} {t:.3f}" for k, t in r.items()), flush=True)
    jax_ub.shutdown()


if __name__ == "__main__":
    main()
