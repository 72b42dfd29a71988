"""Fixed costs of small ops: GPU time per op (CHAIN ops per dispatch) against the host time the
FFI handlers spend enqueueing each op (jax_ub.comm.host_stats), and A/B of temporary variants.

    python3 scripts/fixed_cost_probe.py [TP] [VARIANTS] [SHAPES]

VARIANTS: comma-separated values of an environment switch UB_PROBE_EXP that a temporary C++ change
reads per op (none in the committed code: give "0"). Not a JAX_UB_* name: jax_ub reads no such
setting and would warn about one. The twentieth session used it (then named JAX_UB_EXP) for bit 1:
no final check kernel, bit 2: the next op's buffer-free signal at this op's end (NOTES.md). Per
repetition the variants run in a shuffled order; prints the median ms per op per variant, the
ratio to the first, and per device the host us per op (enqueue, and of it waiting for peers).
SHAPES: e.g. "4096,1024,1024;8192,8192,8192" (default: three small ones).
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub import overlap
from jax_ub.bench.harness import chain_fn, shard_jit

CHAIN = 8
SHAPES = [(4096, 1024, 1024), (16384, 1024, 1024), (8192, 4096, 4096)]


def main() -> int:
    tp = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    variants = [int(v) for v in (sys.argv[2] if len(sys.argv) > 2 else "0").split(",")]
    shapes = ([tuple(int(d) for d in sh.split(",")) for sh in sys.argv[3].split(";")]
              if len(sys.argv) > 3 else SHAPES)
    mesh = Mesh(np.array(jax.devices()[:tp]), ("tp",))
    jax_ub.initialize(mesh, "tp")

    def smap(f, ins, outs):
        return shard_jit(mesh, f, ins, outs)

    rng = random.Random(0)
    for M, K, N in shapes:
        key = jax.random.key(0)
        sh = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
        x_ag = sh(jax.random.normal(key, (M, K), jnp.bfloat16), P("tp", None))
        w_ag = sh(jax.random.normal(key, (K, N), jnp.bfloat16) * 0.03, P(None, "tp"))
        x_rs = sh(jax.random.normal(key, (M, K), jnp.bfloat16), P(None, "tp"))
        w_rs = sh(jax.random.normal(key, (K, N), jnp.bfloat16), P("tp", None))
        w_dn = sh(jax.random.normal(key, (N, K), jnp.bfloat16) * 0.03, P("tp", None))
        p = sh(jax.random.normal(key, (M * tp, N), jnp.bfloat16), P("tp", None))

        def mlp(x, w1, w2, method_ag, method_rs):
            h = jax_ub.all_gather_matmul(x, w1, "tp", method=method_ag)
            return jax_ub.matmul_reduce_scatter(jax.nn.gelu(h), w2, "tp", method=method_rs)

        def mlp_xla(x, w1, w2):
            h = lax.all_gather(x, "tp", tiled=True) @ w1
            return lax.psum_scatter(jax.nn.gelu(h) @ w2, "tp", tiled=True)

        impls = {
            "ag_bare": (smap(lambda x: overlap.all_gather(x, "tp"), (P("tp", None),), P()), (x_ag,)),
            "ag_push": (smap(lambda x, w: jax_ub.all_gather_matmul(x, w, "tp", method="push"),
                             (P("tp", None), P(None, "tp")), P(None, "tp")), (x_ag, w_ag)),
            "ag_ring": (smap(lambda x, w: jax_ub.all_gather_matmul(x, w, "tp", method="ring"),
                             (P("tp", None), P(None, "tp")), P(None, "tp")), (x_ag, w_ag)),
            "ag_xla": (smap(lambda x, w: lax.all_gather(x, "tp", tiled=True) @ w,
                            (P("tp", None), P(None, "tp")), P(None, "tp")), (x_ag, w_ag)),
            "rs_bare": (smap(lambda p: overlap.reduce_scatter(p, "tp"), (P("tp", None),), P("tp", None)), (p,)),
            "rs_ring": (smap(lambda x, w: jax_ub.matmul_reduce_scatter(x, w, "tp", method="ring"),
                             (P(None, "tp"), P("tp", None)), P("tp", None)), (x_rs, w_rs)),
            "rs_xla": (smap(lambda x, w: lax.psum_scatter(x @ w, "tp", tiled=True),
                            (P(None, "tp"), P("tp", None)), P("tp", None)), (x_rs, w_rs)),
            "mlp_push_ring": (smap(lambda x, a, b: mlp(x, a, b, "push", "ring"),
                                   (P("tp", None), P(None, "tp"), P("tp", None)), P("tp", None)),
                              (x_ag, w_ag, w_dn)),
            "mlp_xla": (smap(mlp_xla, (P("tp", None), P(None, "tp"), P("tp", None)), P("tp", None)),
                        (x_ag, w_ag, w_dn)),
        }
        for name, (fn, args) in impls.items():
            prog = chain_fn(fn, CHAIN)
            xla_only = name.endswith("xla")
            vs = [0] if xla_only else variants
            ref = None
            for v in vs:  # warm up (and check every variant computes the same)
                os.environ["UB_PROBE_EXP"] = str(v)
                for _ in range(3):
                    out = jax.block_until_ready(prog(*args))
                last = np.asarray(out[-1], np.float32)
                if ref is None:
                    ref = last
                elif not np.array_equal(ref, last):
                    print(f"MISMATCH {M},{K},{N} {name} variant {v}: max abs diff "
                          f"{np.max(np.abs(ref - last)):.3e}", flush=True)
            times: dict[int, list[float]] = {v: [] for v in vs}
            host0 = jax_ub.comm.host_stats()
            for _ in range(9):
                order = list(vs)
                rng.shuffle(order)
                for v in order:
                    os.environ["UB_PROBE_EXP"] = str(v)
                    for _ in range(2):
                        jax.block_until_ready(prog(*args))
                    t0 = time.perf_counter()
                    for _ in range(10):
                        out = prog(*args)
                    jax.block_until_ready(out)
                    times[v].append((time.perf_counter() - t0) * 1e3 / 10 / CHAIN)
            med = {v: statistics.median(t) for v, t in times.items()}
            cols = "  ".join(f"v{v} {med[v]:.4f} ({med[v] / med[vs[0]]:.3f})" for v in vs)
            host = ""
            for key, h in jax_ub.comm.host_stats().items():
                ops = h["ops"] - host0[key]["ops"]
                if ops:
                    enq = (h["host_s"] - host0[key]["host_s"]) / ops * 1e6
                    meet = (h["meet_s"] - host0[key]["meet_s"]) / ops * 1e6
                    host += f"  dev{key[1]} host {enq:.0f} us/op (meet {meet:.0f})"
            print(f"{M},{K},{N} {name:14s} ms/op: {cols}{host}", flush=True)
    os.environ["UB_PROBE_EXP"] = "0"
    jax_ub.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
