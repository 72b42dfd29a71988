"""Hunts the rare hang: runs a random mix of every ipc op kind (AG->GEMM ring/all_peer/push, GEMM->RS
ring/pipeline/chain/columns, bare all-gather and reduce-scatter in 1/2/4 pieces, bulk AG/RS) over
all local GPUs for a time budget. Each round traces fresh programs (so trace-time GEMM warm-ups run
while earlier ops are still in flight, as in the test tier), dispatches a few of them back to back,
puts XLA work between them (a matmul and an NCCL psum), and checks one result per round against
XLA (sometimes after NaN-filling fresh buffers on every GPU, as the tests do). Prints one line
per 20 rounds, the first error (the watchdog's message says how far each rank's GPU got), and a
final count.

HUNT_INPUTS=one keeps every input on the first GPU (as the test tier's ``_rand`` does): each call
then reshards its inputs, i.e. XLA copies device 0's data to the other GPUs right before the op,
and another GPU's op waits for a copy enqueued on device 0 after device 0's own op began. With
CUDA_DEVICE_MAX_CONNECTIONS=1 as well, this hung at once until Begin's host meeting (NOTES,
thirteenth session): a stream wait for a peer stalls its whole hardware queue, copy included.

    JAX_UB_TIMEOUT=20 [HUNT_INPUTS=one] python scripts/hang_hunt.py [seconds] [seed]
"""

from __future__ import annotations

import os
import random
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub import config, overlap

# local (per-rank) rows, K, N: small enough for many ops per second, a few larger ones, and rows of
# unaligned bytes (N = 1001: 2002-byte bf16 rows, as in the test tier's pieces test)
SHAPES = [(256, 1024, 1024), (512, 2048, 1024), (1024, 1024, 2048), (384, 1536, 768),
          (2048, 4096, 2048), (383, 1000, 1001), (4096, 4096, 4096)]


def main():
    budget = float(sys.argv[1]) if len(sys.argv) > 1 else 120.0
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    rng = random.Random(seed)
    tp = len(jax.devices())
    mesh = Mesh(np.array(jax.devices()), ("tp",))  # auto axes: the references shard freely
    jax_ub.initialize(mesh, "tp")
    one = os.environ.get("HUNT_INPUTS") == "one"
    row = NamedSharding(mesh, P("tp", None))
    col = NamedSharding(mesh, P(None, "tp"))

    def put(a, sharding):  # HUNT_INPUTS=one: leave a where it was made (device 0)
        return a if one else jax.device_put(a, sharding)

    def smap(f, in_specs, out_specs):
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                     check_vma=False))

    def make(kind, m, k, n, dtype):
        """(jitted f, args, reference f) for one op kind at local shape (m, k, n)."""
        key = jax.random.key(rng.randrange(1 << 30))
        ka, kb = jax.random.split(key)
        g = -(-n // 8) * 8  # GEMM widths stay 16-byte aligned; the bare collectives take n as is
        if kind.startswith("ag_"):
            x = put(jax.random.normal(ka, (tp * m, k), dtype), row)
            w = put(jax.random.normal(kb, (k, tp * g), dtype) / k ** 0.5, col)
            meth = kind[3:]
            f = smap(lambda x, w: jax_ub.all_gather_matmul(x, w, "tp", method=meth),
                     (P("tp", None), P(None, "tp")), P(None, "tp"))
            return f, (x, w), lambda x, w: x @ w
        if kind.startswith("rs_"):
            x = put(jax.random.normal(ka, (tp * m, tp * k), dtype), col)
            w = put(jax.random.normal(kb, (tp * k, g), dtype) / k ** 0.5, row)
            meth = kind[3:]
            f = smap(lambda x, w: jax_ub.matmul_reduce_scatter(x, w, "tp", method=meth),
                     (P(None, "tp"), P("tp", None)), P("tp", None))
            return f, (x, w), lambda x, w: x @ w
        if kind.startswith("bare_rs"):
            pieces = int(kind[-1])
            x = put(jax.random.normal(ka, (tp * tp * m, n), dtype), row)
            with config.override(rs_pieces=pieces):
                f = smap(lambda x: overlap.reduce_scatter(x, "tp"), P("tp", None), P("tp", None))
                f.lower(x)  # rs_pieces is read at trace time
            ref = smap(lambda x: lax.psum_scatter(x, "tp", scatter_dimension=0, tiled=True),
                       P("tp", None), P("tp", None))
            return f, (x,), ref
        if kind.startswith("bare_ag"):
            meth = kind[len("bare_ag_"):]
            x = put(jax.random.normal(ka, (tp * m, n), dtype), row)
            f = smap(lambda x: overlap.all_gather(x, "tp", method=meth), P("tp", None), P())
            return f, (x,), lambda x: x
        # bulk: a collective under an independent GEMM a @ b
        a = put(jax.random.normal(ka, (tp * m, k), dtype), row)
        b = put(jax.random.normal(kb, (k, g), dtype) / k ** 0.5,
                           NamedSharding(mesh, P()))
        if kind == "bulk_ag":
            x = put(jax.random.normal(kb, (tp * m, n), dtype), row)
            f = smap(lambda x, a, b: jax_ub.bulk_all_gather(x, a, b, "tp"),
                     (P("tp", None), P("tp", None), P()), (P(), P("tp", None)))
            return f, (x, a, b), lambda x, a, b: (x, a @ b)
        x = put(jax.random.normal(kb, (tp * tp * m, n), dtype), row)
        f = smap(lambda x, a, b: jax_ub.bulk_reduce_scatter(x, a, b, "tp"),
                 (P("tp", None), P("tp", None), P()), (P("tp", None), P("tp", None)))
        ref = smap(lambda x, a, b: (lax.psum_scatter(x, "tp", scatter_dimension=0, tiled=True),
                                    a @ b), (P("tp", None), P("tp", None), P()),
                   (P("tp", None), P("tp", None)))
        return f, (x, a, b), ref

    kinds = ["ag_ring", "ag_all_peer", "ag_push", "rs_ring", "rs_pipeline", "rs_chain",
             "rs_columns", "bare_rs1", "bare_rs2", "bare_rs4", "bare_ag_push", "bare_ag_ring",
             "bulk_ag", "bulk_rs"]
    xla_side = smap(lambda a: lax.psum(a @ a.T, "tp"), P("tp", None), P())  # GEMM + NCCL
    side = jax.device_put(jax.random.normal(jax.random.key(7), (tp * 512, 512), jnp.float32), row)
    t0, rounds, ops = time.perf_counter(), 0, 0
    worst = 0.0
    while time.perf_counter() - t0 < budget:
        batch = []
        for _ in range(rng.randint(1, 4)):
            kind = rng.choice(kinds)
            m, k, n = rng.choice(SHAPES)
            dtype = rng.choice([jnp.bfloat16, jnp.bfloat16, jnp.float32])
            batch.append((kind, m, k, n, dtype, *make(kind, m, k, n, dtype)))
        if rng.random() < 0.3:  # the test tier's NaN poisoning: allocate, fill, free on every GPU
            jax.block_until_ready([jax.device_put(jnp.full((1024, 1001), jnp.nan, jnp.bfloat16), d)
                                   for d in jax.devices() for _ in range(2)])
        try:
            outs = []
            for *_, f, args, _ref in batch:
                for _ in range(rng.randint(1, 3)):
                    outs.append(f(*args))
                    ops += 1
                if rng.random() < 0.5:
                    outs.append(xla_side(side))
            if rng.random() < 0.7:
                jax.block_until_ready(outs)
            kind, m, k, n, dtype, f, args, ref = batch[-1]
            got = jax.tree.leaves(f(*args))
            ops += 1
            want = jax.tree.leaves(jax.jit(ref)(*[a.astype(jnp.float32) for a in args]))
            for g, wv in zip(got, want, strict=True):
                g, wv = np.asarray(g, np.float32), np.asarray(wv, np.float32)
                err = float(np.abs(g - wv).max() / max(np.abs(wv).max(), 1e-30))
                worst = max(worst, err)
                assert err < 3e-2, f"{kind} {m}x{k}x{n} {jnp.dtype(dtype).name}: rel err {err:.3e}"
        except Exception as e:  # report the first failure, then stop
            desc = ", ".join(f"{b[0]} {b[1]}x{b[2]}x{b[3]} {jnp.dtype(b[4]).name}" for b in batch)
            print(f"HUNT round {rounds} ({ops} ops, {time.perf_counter() - t0:.0f} s) FAILED in "
                  f"[{desc}]: {str(e)[:1500]}", flush=True)
            sys.exit(3)
        rounds += 1
        if rounds % 20 == 0:
            print(f"HUNT round {rounds}: {ops} ops in {time.perf_counter() - t0:.0f} s, worst rel "
                  f"err {worst:.2e}", flush=True)
    jax_ub.shutdown()
    print(f"HUNT done: seed {seed}, {rounds} rounds, {ops} ops in {time.perf_counter() - t0:.0f} s, "
          f"no hang; worst rel err {worst:.2e}", flush=True)


if __name__ == "__main__":
    main()
