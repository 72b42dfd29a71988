"""Where does AG->GEMM lose against T_ideal? For the tp-4 bench shapes, per call (10 back-to-back
calls, median of 5): the GEMM alone on one GPU and on every GPU at once, the tp chunk GEMMs back to
back on every GPU at once (the chunked schedule's floor without any copy), the larger pieces the
"local chunk, then the rest" schedule would run, and each jax_ub algorithm; then the traced spans
of 4 back-to-back calls (device 0: op span, first copy start, GEMM durations).

    python scripts/ag_gap_probe.py [M,K,N ...]
"""

from __future__ import annotations

import collections
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub import overlap
from jax_ub.bench.harness import time_fn


def timed(f, args):
    return time_fn(f, args, warmup=3, iters=10, reps=5)  # the benchmark's own timing


def print_traces(tag, f, args, calls=6, max_device=None):
    """Traces ``calls`` back-to-back calls of ``f(*args)`` and prints one TRACE line per device
    and op: its start, span, gap to the next op, and its GEMM and copy spans (start+duration)."""
    overlap.trace_enable(True)
    jax.block_until_ready([f(*args) for _ in range(calls)])
    overlap.trace_enable(False)
    by = collections.defaultdict(list)
    for rec in overlap.trace_collect():
        by[(rec["device"], rec["epoch"])].append(rec)
    for (dev, e) in sorted(by):
        if max_device is not None and dev > max_device:
            continue
        rr = sorted(by[(dev, e)], key=lambda q: q["start_ms"])
        spans = {n: " ".join(f"{q['start_ms']:.3f}+{q['end_ms'] - q['start_ms']:.3f}"
                             for q in rr if q["name"] == n) for n in ("gemm", "copy")}
        span = max(q["end_ms"] for q in rr)
        nxt = by.get((dev, e + 1))
        gap = f"{nxt[0]['op_start_ms'] - rr[0]['op_start_ms'] - span:.3f}" if nxt else "-"
        print(f"TRACE {tag} dev {dev} epoch {e}: start {rr[0]['op_start_ms']:.3f} span {span:.3f} "
              f"gap to next op {gap} gemm [{spans['gemm']}] copy [{spans['copy']}]", flush=True)


def mm(a, b):
    """The GEMM alone: jax_ub's cuBLASLt matmul."""
    return jax_ub.matmul(a, b, method="cublaslt")


def rs_inputs(mesh, M, K, N, seed=0):
    """Random bf16 GEMM->RS operands of global shape (M, K, N): x[M, K] sharded over columns,
    w[K, N] over rows (mesh axis "tp")."""
    x = jax.device_put(jax.random.normal(jax.random.key(seed), (M, K), jnp.bfloat16),
                       NamedSharding(mesh, P(None, "tp")))
    w = jax.device_put(jax.random.normal(jax.random.key(seed + 1), (K, N), jnp.bfloat16),
                       NamedSharding(mesh, P("tp", None)))
    return x, w


def setup(tp, shape_args, default_shapes):
    """The first ``tp`` devices as mesh axis "tp" with jax_ub initialized, the shapes ("M,K,N"
    arguments, else ``default_shapes``) and a jit(shard_map) builder ``smap(f, in_specs, out_specs)``."""
    mesh = Mesh(np.array(jax.devices()[:tp]), ("tp",))
    jax_ub.initialize(mesh, "tp")
    shapes = [tuple(int(v) for v in a.split(",")) for a in shape_args] or list(default_shapes)

    def smap(f, in_specs, out_specs):
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                     check_vma=False))

    return mesh, shapes, smap


def main():
    tp = 4
    mesh, shapes, smap = setup(tp, sys.argv[1:], [(8192, 8192, 28672), (2048, 8192, 28672)])
    for M, K, N in shapes:
        x = jax.device_put(jax.random.normal(jax.random.key(0), (M, K), jnp.bfloat16),
                           NamedSharding(mesh, P("tp", None)))
        w = jax.device_put(jax.random.normal(jax.random.key(1), (K, N), jnp.bfloat16),
                           NamedSharding(mesh, P(None, "tp")))
        xf = jax.device_put(jax.random.normal(jax.random.key(2), (M * tp, K), jnp.bfloat16),
                            NamedSharding(mesh, P("tp", None)))  # a full [M, K] on every GPU
        d0 = jax.devices()[0]
        r = {}
        r["gemm 1 GPU"] = timed(jax.jit(mm), (jax.device_put(xf[:M], d0), jax.device_put(w[:, :N // tp], d0)))
        r["gemm all GPUs"] = timed(smap(mm, (P("tp", None), P(None, "tp")), P("tp", None)), (xf, w))

        ws = [jax.device_put(jax.random.normal(jax.random.key(10 + i), (K, N), jnp.bfloat16),
                             NamedSharding(mesh, P(None, "tp"))) for i in range(4)]
        four = smap(lambda x, *ws: tuple(jax_ub.all_gather_matmul(x, wi, "tp") for wi in ws),
                    (P("tp", None),) + (P(None, "tp"),) * 4, (P(None, "tp"),) * 4)
        r["jax_ub auto, 4 ops in one program (per op)"] = timed(four, (x, *ws)) / 4
        gfour = smap(lambda x, *ws: tuple(mm(x, wi) for wi in ws), (P("tp", None),) + (P(None, "tp"),) * 4,
                     (P("tp", None),) * 4)
        r["gemm all GPUs, 4 in one program (per GEMM)"] = timed(gfour, (xf, *ws)) / 4
        r["our all_gather"] = timed(smap(lambda x: overlap.all_gather(x, "tp"), (P("tp", None),), P()), (x,))
        f = smap(lambda x, w: jax_ub.all_gather_matmul(x, w, "tp", method="push"),
                 (P("tp", None), P(None, "tp")), P(None, "tp"))
        r["jax_ub push"] = timed(f, (x, w))
        r["jax_ub push (again)"] = timed(f, (x, w))
        r["gemm all GPUs (again)"] = timed(smap(mm, (P("tp", None), P(None, "tp")), P("tp", None)), (xf, w))
        print(f"GAP {M},{K},{N}: " + ", ".join(f"{k} {v:.3f}" for k, v in r.items()), flush=True)
        f = smap(lambda x, w: jax_ub.all_gather_matmul(x, w, "tp"), (P("tp", None), P(None, "tp")),
                 P(None, "tp"))
        print_traces(f"{M},{K},{N}", f, (x, w))
    jax_ub.shutdown()


if __name__ == "__main__":
    main()
