"""Repeats push AG->GEMM at the shape where two runs hung (6144x5120x13824, bf16, tp 4), with and
without the gathered output, blocking after every call like the tests do. Prints one line per
round and the first error (with the watchdog's note on its flag reads), then exits.

    JAX_UB_TIMEOUT=15 JAX_UB_AG_PUSH_MERGE=1 python scripts/push_hang_repro.py [rounds]
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_ub


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    tp = 4
    mesh = Mesh(np.array(jax.devices()[:tp]), ("tp",))
    jax_ub.initialize(mesh, "tp")
    M, K, N = 6144, 5120, 13824
    ref = None
    for rnd in range(rounds):
        t0 = time.perf_counter()
        x = jax.random.normal(jax.random.key(rnd), (M, K), jnp.float32).astype(jnp.bfloat16)
        w = jax.random.normal(jax.random.key(1000 + rnd), (K, N), jnp.float32).astype(jnp.bfloat16)
        ref = np.asarray(jnp.matmul(x.astype(jnp.float32), w.astype(jnp.float32)))
        for full in (True, False):
            def f(x, w, full=full):
                if full:
                    return jax_ub.all_gather_matmul(x, w, "tp", method="push", return_gathered=True)[0]
                return jax_ub.all_gather_matmul(x, w, "tp", method="push")
            # a fresh program per round: tracing (and warming) between ops, as in the test tier
            g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("tp", None), P(None, "tp")),
                                      out_specs=P(None, "tp"), check_vma=False))
            for i in range(3):
                try:
                    y = np.asarray(g(x, w), np.float32)
                except Exception as e:
                    print(f"REPRO round {rnd} full={full} call {i}: ERROR {str(e)[:600]}", flush=True)
                    sys.exit(3)
                err = float(np.abs(y - ref).max() / np.abs(ref).max())
                assert err < 1e-2, err
        print(f"REPRO round {rnd}: ok ({time.perf_counter() - t0:.1f} s)", flush=True)
    jax_ub.shutdown()
    print("REPRO done", flush=True)


if __name__ == "__main__":
    main()
