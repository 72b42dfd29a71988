"""Push AG->GEMM at the bench shapes over all local GPUs: the benchmark's timing of method="push"
and the traced spans of 6 back-to-back calls on device 0 (when each copy starts relative to the
own chunk's GEMM).

    python scripts/push_order_probe.py [M,K,N ...]
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
from ag_gap_probe import print_traces, setup, timed  # scripts/ is on sys.path when run as a script
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ub


def main():
    tp = len(jax.devices())
    mesh, shapes, smap = setup(tp, sys.argv[1:], [(8192, 8192, 28672), (8192, 8192, 8192),
                                                 (2048, 8192, 28672), (16384, 8192, 2048)])
    for M, K, N in shapes:
        x = jax.device_put(jax.random.normal(jax.random.key(0), (M, K), jnp.bfloat16),
                           NamedSharding(mesh, P("tp", None)))
        w = jax.device_put(jax.random.normal(jax.random.key(1), (K, N), jnp.bfloat16),
                           NamedSharding(mesh, P(None, "tp")))
        f = smap(lambda x, w: jax_ub.all_gather_matmul(x, w, "tp", method="push"),
                 (P("tp", None), P(None, "tp")), P(None, "tp"))
        print(f"PUSH tp {tp} {M},{K},{N}: {timed(f, (x, w)):.3f} ms", flush=True)
        print_traces(f"{M},{K},{N}", f, (x, w), max_device=0)
    jax_ub.shutdown()


if __name__ == "__main__":
    main()
