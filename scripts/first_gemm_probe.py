"""Why is the first chunk GEMM of an op slower than the others? Traces several back-to-back calls of
AG->GEMM and GEMM->RS (8192x8192x28672, bf16, tp 4) and prints every GEMM's duration per call, plus
the pointer alignments the GEMMs see.

    python scripts/first_gemm_probe.py
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub import overlap


def main():
    tp = 4
    mesh = Mesh(np.array(jax.devices()[:tp]), ("tp",))
    jax_ub.initialize(mesh, "tp")
    M, K, N = 8192, 8192, 28672
    x = jax.device_put(jax.random.normal(jax.random.key(0), (M, K), jnp.bfloat16),
                       NamedSharding(mesh, P("tp", None)))
    w = jax.device_put(jax.random.normal(jax.random.key(1), (K, N), jnp.bfloat16),
                       NamedSharding(mesh, P(None, "tp")))
    xr = jax.device_put(jax.random.normal(jax.random.key(2), (M, K), jnp.bfloat16),
                        NamedSharding(mesh, P(None, "tp")))
    wr = jax.device_put(jax.random.normal(jax.random.key(3), (K, N), jnp.bfloat16),
                        NamedSharding(mesh, P("tp", None)))
    ag = jax.jit(jax.shard_map(lambda x, w: jax_ub.all_gather_matmul(x, w, "tp"), mesh=mesh,
                               in_specs=(P("tp", None), P(None, "tp")), out_specs=P(None, "tp"),
                               check_vma=False))
    rs = jax.jit(jax.shard_map(lambda x, w: jax_ub.matmul_reduce_scatter(x, w, "tp"), mesh=mesh,
                               in_specs=(P(None, "tp"), P("tp", None)), out_specs=P("tp", None),
                               check_vma=False))
    plain = jax.jit(jax.shard_map(lambda x, w: jax.lax.all_gather(x, "tp", tiled=True) @ w,
                                  mesh=mesh, in_specs=(P("tp", None), P(None, "tp")),
                                  out_specs=P(None, "tp"), check_vma=False))
    import time
    for name, f, args in (("ag", ag, (x, w)), ("rs", rs, (xr, wr)), ("xla_plain", plain, (x, w))):
        for _ in range(5):
            out = f(*args)
        jax.block_until_ready(out)
        for _ in range(3):
            t0 = time.perf_counter()
            outs = [f(*args) for _ in range(20)]
            t1 = time.perf_counter()
            jax.block_until_ready(outs)
            t2 = time.perf_counter()
            print(f"{name}: 20 calls: dispatch {(t1 - t0) / 20 * 1e3:.3f} ms/call, total "
                  f"{(t2 - t0) / 20 * 1e3:.3f} ms/call", flush=True)
        if name == "xla_plain":
            continue
        overlap.trace_enable(True)
        outs = [f(*args) for _ in range(4)]
        jax.block_until_ready(outs)
        overlap.trace_enable(False)
        recs = overlap.trace_collect()
        by = collections.defaultdict(list)
        for r in recs:
            if r["device"] == 0:
                by[r["epoch"]].append(r)
        for e in sorted(by):
            rr = sorted(by[e], key=lambda r: r["start_ms"])
            g = [f"{r['end_ms'] - r['start_ms']:.3f}" for r in rr if r["name"] == "gemm"]
            span = max(r["end_ms"] for r in rr)
            print(f"{name} epoch {e}: span {span:.3f} ms, gemms {' '.join(g)}", flush=True)
    jax_ub.shutdown()


if __name__ == "__main__":
    main()
