"""Where does a bare jax_ub collective's time go beyond its bytes? Over the first TP local GPUs,
per local input shape [rows, cols] (bf16), the benchmark's timing (10 back-to-back calls, median
of 5) of:

* our all-gather (push and ring) and reduce-scatter, and XLA's (NCCL) ones;
* the same ops four to a program (per op): what one jit dispatch per op costs on top;
* the copy-engine floor, bytes each GPU receives / 383 GB/s (shared/GPU.md);

then the traced spans of 6 back-to-back calls of each of ours (device 0: op start, span, gap to
the next op, and every copy, local copy and sum as start+duration).

    python scripts/bare_probe.py [TP] [ROWS,COLS ...]
"""

from __future__ import annotations

import collections
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub import overlap
from jax_ub.bench.harness import time_fn

SHAPES = [(2048, 8192), (4096, 8192), (8192, 12288), (512, 8192)]
NAMES = ("copy", "local_copy", "publish", "reduce")


def timed(f, args):
    return time_fn(f, args, warmup=3, iters=10, reps=5)


def traces(tag, f, args, calls=6):
    overlap.trace_enable(True)
    jax.block_until_ready([f(*args) for _ in range(calls)])
    overlap.trace_enable(False)
    by = collections.defaultdict(list)
    for rec in overlap.trace_collect():
        if rec["device"] == 0:
            by[rec["epoch"]].append(rec)
    for e in sorted(by):
        rr = sorted(by[e], key=lambda q: q["start_ms"])
        span = max(q["end_ms"] for q in rr)
        nxt = by.get(e + 1)
        gap = f"{nxt[0]['op_start_ms'] - rr[0]['op_start_ms'] - span:.3f}" if nxt else "-"
        parts = " ".join(f"{q['name']}{q['chunk']}@{q['stream']} {q['start_ms']:.3f}+{q['end_ms'] - q['start_ms']:.3f}"
                         for q in rr if q["name"] in NAMES)
        print(f"TRACE {tag} epoch {e}: start {rr[0]['op_start_ms']:.3f} span {span:.3f} gap {gap} "
              f"[{parts}]", flush=True)


def main():
    tp = int(sys.argv[1]) if len(sys.argv) > 1 else len(jax.devices())
    shapes = [tuple(int(v) for v in s.split(",")) for s in sys.argv[2:]] or SHAPES
    mesh = Mesh(np.array(jax.devices()[:tp]), ("tp",))
    jax_ub.initialize(mesh, "tp")

    def smap(f, in_specs, out_specs):
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                     check_vma=False))

    row = P("tp", None)
    for rows, cols in shapes:
        xs = [jax.device_put(jax.random.normal(jax.random.key(i), (rows * tp, cols), jnp.bfloat16),
                             NamedSharding(mesh, row)) for i in range(4)]
        # reduce-scatter input: [rows * tp, cols] on every rank (global [tp * rows * tp, cols])
        ps = [jax.device_put(jax.random.normal(jax.random.key(10 + i), (rows * tp * tp, cols),
                                               jnp.bfloat16), NamedSharding(mesh, row)) for i in range(4)]
        ag = {"push": lambda x: overlap.all_gather(x, "tp", method="push"),
              "ring": lambda x: overlap.all_gather(x, "tp", method="ring"),
              "nccl": lambda x: lax.all_gather(x, "tp", tiled=True)}
        rs = {"ours": lambda p: overlap.reduce_scatter(p, "tp"),
              "nccl": lambda p: lax.psum_scatter(p, "tp", scatter_dimension=0, tiled=True)}
        r = {}
        for name, g in ag.items():
            r[f"ag {name}"] = timed(smap(g, (row,), P()), xs[:1])
            r[f"ag {name} x4/op"] = timed(smap(lambda *x, g=g: tuple(g(v) for v in x), (row,) * 4,
                                               (P(),) * 4), xs) / 4
        for name, g in rs.items():
            r[f"rs {name}"] = timed(smap(g, (row,), row), ps[:1])
            r[f"rs {name} x4/op"] = timed(smap(lambda *p, g=g: tuple(g(v) for v in p), (row,) * 4,
                                               (row,) * 4), ps) / 4
        chunk = rows * cols * 2
        floor = (tp - 1) * chunk / 383e9 * 1e3
        print(f"BARE tp {tp} [{rows},{cols}] ({chunk / 1e6:.1f} MB per rank and peer, floor "
              f"{floor:.3f} ms): " + ", ".join(f"{k} {v:.3f}" for k, v in r.items()), flush=True)
        traces(f"ag push [{rows},{cols}]", smap(ag["push"], (row,), P()), xs[:1])
        traces(f"rs [{rows},{cols}]", smap(rs["ours"], (row,), row), ps[:1])
    jax_ub.shutdown()


if __name__ == "__main__":
    main()
