"""Quick GPU probe: times the overlap ops per algorithm beside XLA plain, and prints one traced
call's timeline (rank 0) per case. Usage: python scripts/probe_overlap.py [--tp 4] [--out DIR]."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ub


def med_ms(fn, args, iters=10, reps=5):
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    xs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        xs.append((time.perf_counter() - t0) * 1e3 / iters)
    return statistics.median(xs)


def timeline(fn, args):
    jax_ub.overlap.trace_enable(True)
    try:
        jax.block_until_ready(fn(*args))
    finally:
        jax_ub.overlap.trace_enable(False)
    return jax_ub.overlap.trace_collect()


def show(recs, rank=0):
    for r in sorted((r for r in recs if r["rank"] == rank), key=lambda r: r["start_ms"]):
        print(f"    {r['stream']:9s} {r['name']:10s} chunk {r['chunk']:2d} "
              f"{r['start_ms']:8.3f} -> {r['end_ms']:8.3f}  ({r['end_ms'] - r['start_ms']:.3f})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", nargs="*", default=["8192,8192,28672", "8192,8192,8192"])
    a = ap.parse_args()
    tp = a.tp
    mesh = Mesh(np.array(jax.devices()[:tp]), ("tp",))
    jax_ub.initialize(mesh, "tp")
    results = []
    dt = jnp.bfloat16
    for shp in a.shapes:
        M, K, N = map(int, shp.split(","))
        key = jax.random.key(0)
        # AG: x[M, K] sharded on rows, w[K, N] sharded on columns.
        x = jax.device_put(jax.random.normal(key, (M, K), dt), NamedSharding(mesh, P("tp", None)))
        w = jax.device_put(jax.random.normal(key, (K, N), dt), NamedSharding(mesh, P(None, "tp")))
        sm = dict(mesh=mesh, check_vma=False)
        cases = {
            "xla_plain": jax.jit(jax.shard_map(
                lambda x, w: lax.all_gather(x, "tp", tiled=True) @ w,
                in_specs=(P("tp", None), P(None, "tp")), out_specs=P(None, "tp"), **sm)),
            "comm_nccl": jax.jit(jax.shard_map(
                lambda x, w: lax.all_gather(x, "tp", tiled=True),
                in_specs=(P("tp", None), P(None, "tp")), out_specs=P(), **sm)),
        }
        for m in ("ring", "push", "all_peer"):
            cases[f"comm_{m}"] = jax.jit(jax.shard_map(
                lambda x, w, m=m: jax_ub.overlap.all_gather(x, "tp", method=m),
                in_specs=(P("tp", None), P(None, "tp")), out_specs=P(), **sm))
            cases[m] = jax.jit(jax.shard_map(
                lambda x, w, m=m: jax_ub.all_gather_matmul(x, w, "tp", method=m),
                in_specs=(P("tp", None), P(None, "tp")), out_specs=P(None, "tp"), **sm))
        d0 = jax.devices()[0]
        xf = jax.device_put(jax.random.normal(key, (M, K), dt), d0)
        wl = jax.device_put(jax.random.normal(key, (K, N // tp), dt), d0)
        cases["gemm_alone"] = jax.jit(jax_ub.matmul)
        for name, fn in cases.items():
            args = (xf, wl) if name == "gemm_alone" else (x, w)
            ms = med_ms(fn, args)
            results.append(dict(op="ag", M=M, K=K, N=N, tp=tp, impl=name, ms=ms))
            print(f"ag {M},{K},{N} {name:12s} {ms:.3f} ms", flush=True)
            if name in ("ring", "push", "comm_ring", "comm_push"):
                recs = timeline(fn, args)
                results[-1]["timeline"] = recs
                show(recs)
        # RS: x[M, K] sharded on columns, w[K, N] sharded on rows -> rows scattered.
        xr = jax.device_put(jax.random.normal(key, (M, K), dt), NamedSharding(mesh, P(None, "tp")))
        wr = jax.device_put(jax.random.normal(key, (K, N), dt), NamedSharding(mesh, P("tp", None)))
        ins = (P(None, "tp"), P("tp", None))
        cases = {
            "xla_plain": jax.jit(jax.shard_map(
                lambda x, w: lax.psum_scatter(x @ w, "tp", tiled=True),
                in_specs=ins, out_specs=P("tp", None), **sm)),
        }
        part = jax.device_put(jax.random.normal(key, (M * tp, N), dt), NamedSharding(mesh, P("tp", None)))
        cases["comm_nccl"] = jax.jit(jax.shard_map(
            lambda p: lax.psum_scatter(p, "tp", tiled=True), in_specs=P("tp", None),
            out_specs=P("tp", None), **sm))
        cases["comm_ring"] = jax.jit(jax.shard_map(
            lambda p: jax_ub.overlap.reduce_scatter(p, "tp"), in_specs=P("tp", None),
            out_specs=P("tp", None), **sm))
        for m in ("ring", "pipeline"):
            cases[m] = jax.jit(jax.shard_map(
                lambda x, w, m=m: jax_ub.matmul_reduce_scatter(x, w, "tp", method=m),
                in_specs=ins, out_specs=P("tp", None), **sm))
        for name, fn in cases.items():
            args = (part,) if name.startswith("comm") else (xr, wr)
            ms = med_ms(fn, args)
            results.append(dict(op="rs", M=M, K=K, N=N, tp=tp, impl=name, ms=ms))
            print(f"rs {M},{K},{N} {name:12s} {ms:.3f} ms", flush=True)
            if name in ("ring", "comm_ring"):
                recs = timeline(fn, args)
                results[-1]["timeline"] = recs
                show(recs)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"probe-tp{tp}.json"), "w") as f:
        json.dump(results, f)
    jax_ub.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
