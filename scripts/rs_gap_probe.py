"""Where does GEMM->RS lose between its traced op span and the bench's per-call time? Over all
local GPUs (tp = device count, or argv[1]), per shape: the bench timing of the GEMM on every GPU,
ring and chain (chain at 1, 2 and 4 pieces), chain as 4 ops in one program (per op), then the
traced spans and gaps of 6 back-to-back calls of ring and chain (device 0 and 1).

    python scripts/rs_gap_probe.py TP [M,K,N ...]
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
from jax_ub import config, overlap
from jax_ub.bench.__main__ import time_fn


def timed(f, args):
    return time_fn(f, args, warmup=3, iters=10, reps=5)  # the benchmark's own timing


def main():
    tp = int(sys.argv[1]) if len(sys.argv) > 1 else len(jax.devices())
    mesh = Mesh(np.array(jax.devices()[:tp]), ("tp",))
    jax_ub.initialize(mesh, "tp")
    shapes = [tuple(int(v) for v in s.split(",")) for s in sys.argv[2:]] or [
        (8192, 8192, 28672), (8192, 8192, 8192)]
    smap = lambda f, i, o: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=i, out_specs=o,  # noqa: E731
                                                 check_vma=False))
    mm = lambda a, b: jax_ub.matmul(a, b, method="cublaslt")  # noqa: E731
    for M, K, N in shapes:
        x = jax.device_put(jax.random.normal(jax.random.key(0), (M, K), jnp.bfloat16),
                           NamedSharding(mesh, P(None, "tp")))
        w = jax.device_put(jax.random.normal(jax.random.key(1), (K, N), jnp.bfloat16),
                           NamedSharding(mesh, P("tp", None)))
        r = {}
        r["gemm all GPUs"] = timed(smap(lambda a, b: mm(a, b)[None], (P(None, "tp"), P("tp", None)),
                                        P("tp", None, None)), (x, w))

        def rs(m):
            return smap(lambda a, b: jax_ub.matmul_reduce_scatter(a, b, "tp", method=m),
                        (P(None, "tp"), P("tp", None)), P("tp", None))

        r["ring"] = timed(rs("ring"), (x, w))
        for pieces in (1, 2, 4):
            with config.override(rs_chain_pieces=pieces):
                r[f"chain{pieces}"] = timed(rs("chain"), (x, w))
        ws = [jax.device_put(jax.random.normal(jax.random.key(10 + i), (K, N), jnp.bfloat16),
                             NamedSharding(mesh, P("tp", None))) for i in range(4)]
        four = smap(lambda x, *ws: tuple(jax_ub.matmul_reduce_scatter(x, wi, "tp", method="chain") for wi in ws),
                    (P(None, "tp"),) + (P("tp", None),) * 4, (P("tp", None),) * 4)
        r["chain2, 4 ops in one program (per op)"] = timed(four, (x, *ws)) / 4
        r["ring (again)"] = timed(rs("ring"), (x, w))
        r["chain2 (again)"] = timed(rs("chain"), (x, w))
        print(f"GAP tp{tp} {M},{K},{N}: " + ", ".join(f"{k} {v:.3f}" for k, v in r.items()), flush=True)
        for m in ("ring", "chain"):
            f = rs(m)
            jax.block_until_ready(f(x, w))
            overlap.trace_enable(True)
            jax.block_until_ready([f(x, w) for _ in range(6)])
            overlap.trace_enable(False)
            by = collections.defaultdict(list)
            for rec in overlap.trace_collect():
                by[(rec["device"], rec["epoch"])].append(rec)
            for (dev, e) in sorted(by):
                if dev > 1:
                    continue
                rr = sorted(by[(dev, e)], key=lambda q: q["start_ms"])
                g = " ".join(f"{q['start_ms']:.3f}+{q['end_ms'] - q['start_ms']:.3f}" for q in rr if q["name"] == "gemm")
                span = max(q["end_ms"] for q in rr)
                nxt = by.get((dev, e + 1))
                gap = f"{nxt[0]['op_start_ms'] - rr[0]['op_start_ms'] - span:.3f}" if nxt else "-"
                print(f"TRACE {m} {M},{K},{N} dev {dev} epoch {e}: start {rr[0]['op_start_ms']:.3f} "
                      f"span {span:.3f} gap to next op {gap} gemm [{g}]", flush=True)
    jax_ub.shutdown()


if __name__ == "__main__":
    main()
