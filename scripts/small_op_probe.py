"""Where a small overlap op's time goes (fixed costs): per-call ms of each op and XLA's at small
shapes, and the traced spans of 8 back-to-back calls (op starts on the GPU, span offsets).

    python3 scripts/small_op_probe.py OUT_DIR [TP]

Writes OUT_DIR/small_op_probe.json (traces) and prints a table.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub import overlap
from jax_ub.bench.harness import shard_jit, time_fn

CHAIN = 8
SHAPES = [(16384, 1024, 1024), (8192, 4096, 4096), (4096, 1024, 1024)]


def main() -> int:
    out = sys.argv[1]
    tp = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    os.makedirs(out, exist_ok=True)
    mesh = Mesh(np.array(jax.devices()[:tp]), ("tp",))
    jax_ub.initialize(mesh, "tp")

    def smap(f, ins, outs):
        return shard_jit(mesh, f, ins, outs)

    dump = []
    for M, K, N in SHAPES:
        key = jax.random.key(0)
        x_ag = jax.device_put(jax.random.normal(key, (M, K), jnp.bfloat16), NamedSharding(mesh, P("tp", None)))
        w_ag = jax.device_put(jax.random.normal(key, (K, N), jnp.bfloat16), NamedSharding(mesh, P(None, "tp")))
        x_rs = jax.device_put(jax.random.normal(key, (M, K), jnp.bfloat16), NamedSharding(mesh, P(None, "tp")))
        w_rs = jax.device_put(jax.random.normal(key, (K, N), jnp.bfloat16), NamedSharding(mesh, P("tp", None)))
        p = jax.device_put(jax.random.normal(key, (M * tp, N), jnp.bfloat16), NamedSharding(mesh, P("tp", None)))
        impls = {
            "ag_xla": (smap(lambda x, w: lax.all_gather(x, "tp", tiled=True) @ w, (P("tp", None), P(None, "tp")), P(None, "tp")), (x_ag, w_ag)),
            "ag_push": (smap(lambda x, w: jax_ub.all_gather_matmul(x, w, "tp", method="push"), (P("tp", None), P(None, "tp")), P(None, "tp")), (x_ag, w_ag)),
            "ag_bare": (smap(lambda x: overlap.all_gather(x, "tp"), (P("tp", None),), P()), (x_ag,)),
            "rs_xla": (smap(lambda x, w: lax.psum_scatter(x @ w, "tp", tiled=True), (P(None, "tp"), P("tp", None)), P("tp", None)), (x_rs, w_rs)),
            "rs_ring": (smap(lambda x, w: jax_ub.matmul_reduce_scatter(x, w, "tp", method="ring"), (P(None, "tp"), P("tp", None)), P("tp", None)), (x_rs, w_rs)),
            "rs_pipeline": (smap(lambda x, w: jax_ub.matmul_reduce_scatter(x, w, "tp", method="pipeline"), (P(None, "tp"), P("tp", None)), P("tp", None)), (x_rs, w_rs)),
            "rs_bare": (smap(lambda p: overlap.reduce_scatter(p, "tp"), (P("tp", None),), P("tp", None)), (p,)),
            "gemm_ag_local": (smap(lambda x, w: jax_ub.matmul(x, w, method="cublaslt"), (P(), P(None, "tp")), P(None, "tp")),
                              (jax.device_put(x_ag, NamedSharding(mesh, P())), w_ag)),
            "gemm_rs_local": (smap(lambda x, w: jax_ub.matmul(x, w, method="cublaslt")[None], (P(None, "tp"), P("tp", None)), P("tp")), (x_rs, w_rs)),
        }
        for name, (fn, args) in impls.items():
            ms = time_fn(fn, args, warmup=3, iters=20, reps=7)
            row = {"M": M, "K": K, "N": N, "impl": name, "ms": ms}
            # The same op CHAIN times in one program, each call after the previous one's output
            # (an optimization barrier ties them): one dispatch per CHAIN ops, as in a model step.
            inner = fn.__wrapped__ if hasattr(fn, "__wrapped__") else None
            if inner is not None:
                def chained(*a, _f=inner):
                    outs = []  # every output is returned: none of the calls is dead code
                    for _ in range(CHAIN):
                        out = _f(*a)
                        a, out = lax.optimization_barrier((a, out))
                        outs.append(out)
                    return tuple(outs)
                row["chain_ms"] = time_fn(jax.jit(chained), args, warmup=3, iters=5, reps=7) / CHAIN
            if not name.endswith("xla") and not name.startswith("gemm"):
                overlap.trace_enable(True)
                overlap.trace_collect()
                jax.block_until_ready([fn(*args) for _ in range(8)])
                recs = overlap.trace_collect()
                overlap.trace_enable(False)
                row["trace"] = recs
                d0 = [r for r in recs if int(r["device"]) == int(mesh.devices.flat[0].id)]
                starts = sorted({r["op_start_ms"] for r in d0})
                gaps = np.diff(starts)
                last = {}
                for r in d0:
                    last[r["op_start_ms"]] = max(last.get(r["op_start_ms"], 0.0), r["end_ms"])
                first = {}
                for r in d0:
                    first[r["op_start_ms"]] = min(first.get(r["op_start_ms"], 1e9), r["start_ms"])
                row["period_ms"] = float(np.median(gaps)) if len(gaps) else None
                row["first_span_ms"] = float(np.median(list(first.values())))
                row["last_end_ms"] = float(np.median(list(last.values())))
            print(f"{M},{K},{N} {name:14s} {ms:7.3f} ms" + (
                f"  chained: {row['chain_ms']:.3f} ms per op" if "chain_ms" in row else "") + (
                f"  traced: period {row['period_ms']:.3f}, first span at {row['first_span_ms']:.3f}, "
                f"last span ends {row['last_end_ms']:.3f}" if "trace" in row else ""), flush=True)
            dump.append(row)
    with open(os.path.join(out, "small_op_probe.json"), "w") as f:
        json.dump(dump, f, default=lambda o: o.item() if hasattr(o, "item") else str(o))
    jax_ub.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
