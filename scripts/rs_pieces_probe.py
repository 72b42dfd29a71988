"""How many row pieces should the bare reduce-scatter use, by size? Over all local GPUs (tp =
device count, or argv[1]), per local input shape [rows, cols] (bf16), the median over 7
interleaved rounds (10 back-to-back calls each) of ``jax_ub.overlap.reduce_scatter`` with
``rs_pieces`` 1 / 2 / 3 / 4 / 8, each with ``method="ring"`` (every push on one stream: ``p<n>``)
and ``"pipeline"`` (a stream per peer: ``pipe<n>``, tp > 2 only), and of XLA's ``psum_scatter``
(NCCL). At tp=4 the bare reduce-scatter took 1.4-1.55 ms at 117 MB per peer against NCCL's 1.24,
although the same pushes inside GEMM->RS ran at 378 GB/s (0.31 ms per 117 MB): is it the order
of the pushes, the one stream, or the pieces?

    python scripts/rs_pieces_probe.py TP [ROWS,COLS ...]   (the bench rs shapes: M,N)
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from piece_probe import interleaved  # scripts/ is on sys.path when run as a script

import jax_ub
from jax_ub import config, overlap
from jax_ub.bench.harness import time_fn

SHAPES = [(2048, 4096), (4096, 4096), (8192, 4096), (8192, 8192), (16384, 8192)]


def main():
    tp = int(sys.argv[1]) if len(sys.argv) > 1 else len(jax.devices())
    shapes = [tuple(int(v) for v in s.split(",")) for s in sys.argv[2:]] or SHAPES
    mesh = jax.make_mesh((tp,), ("tp",), devices=jax.devices()[:tp])
    jax_ub.initialize(mesh, "tp")

    def smap(f):
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("tp", None), out_specs=P("tp", None),
                                     check_vma=False))

    for rows, cols in shapes:
        x = jax.device_put(jax.random.normal(jax.random.key(rows + cols), (tp * rows, cols), jnp.bfloat16),
                           NamedSharding(mesh, P("tp", None)))
        v = {"nccl": (smap(lambda x: lax.psum_scatter(x, "tp", scatter_dimension=0, tiled=True)), (x,))}
        for method, name in (("ring", "p"), ("pipeline", "pipe")):
            if method == "pipeline" and tp <= 2:
                continue  # one peer: the same schedule as ring
            for p in (1, 2, 3, 4, 8):
                with config.override(rs_pieces=p):  # read at trace time: trace it here
                    f = smap(lambda x, m=method: overlap.reduce_scatter(x, "tp", method=m))
                    time_fn(f, (x,), warmup=1, iters=1, reps=1)
                    assert f"splits = {p} : i32" in f.lower(x).as_text()
                v[f"{name}{p}"] = (f, (x,))
        r = interleaved(v)
        mb = rows * cols * 2 / tp / 1e6
        print(f"RSPIECES tp{tp} [{rows},{cols}] ({mb:.1f} MB per peer): "
              + ", ".join(f"{k} {t:.3f}" for k, t in r.items()), flush=True)
    jax_ub.shutdown()


if __name__ == "__main__":
    main()
