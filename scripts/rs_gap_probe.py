"""Where does GEMM->RS lose between its traced op span and the bench's per-call time? Over all
local GPUs (tp = device count, or argv[1]), per shape: the bench timing of the GEMM on every GPU,
ring and chain (chain at 1, 2 and 4 pieces), chain as 4 ops in one program (per op), then the
traced spans and gaps of 6 back-to-back calls of ring and chain (device 0 and 1).

    python scripts/rs_gap_probe.py TP [M,K,N ...]
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
from ag_gap_probe import (  # scripts/ is on sys.path when run as a script
    mm,
    print_traces,
    rs_inputs,
    setup,
    timed,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub import config


def main():
    tp = int(sys.argv[1]) if len(sys.argv) > 1 else len(jax.devices())
    mesh, shapes, smap = setup(tp, sys.argv[2:], [(8192, 8192, 28672), (8192, 8192, 8192)])
    for M, K, N in shapes:
        x, w = rs_inputs(mesh, M, K, N)
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
            print_traces(f"{m} {M},{K},{N}", f, (x, w), max_device=1)
    jax_ub.shutdown()


if __name__ == "__main__":
    main()
