"""Where does GEMM->RS "columns" spend its time? For each shape (tp = all local GPUs): traces of 4
back-to-back calls of columns (4 blocks) and chain; prints device 0's spans of the last call by
name and stream (GEMM blocks, 2-D pushes per peer, block sums), start+duration in ms.

    python scripts/columns_probe.py [M,K,N ...]
"""

from __future__ import annotations

import collections
import sys

import jax
from ag_gap_probe import rs_inputs, setup  # scripts/ is on sys.path when run as a script
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub import config, overlap


def main():
    tp = len(jax.devices())
    mesh, shapes, smap = setup(tp, sys.argv[1:], [(8192, 8192, 8192), (8192, 8192, 28672)])
    for M, K, N in shapes:
        x, w = rs_inputs(mesh, M, K, N)
        for method in ("columns", "chain"):
            with config.override(rs_column_pieces=4):
                f = smap(lambda a, b, m=method: jax_ub.matmul_reduce_scatter(a, b, "tp", method=m),
                         (P(None, "tp"), P("tp", None)), P("tp", None))
                jax.block_until_ready([f(x, w) for _ in range(3)])
            overlap.trace_enable(True)
            jax.block_until_ready([f(x, w) for _ in range(4)])
            overlap.trace_enable(False)
            recs = [r for r in overlap.trace_collect() if r["device"] == 0]
            last = max(r["epoch"] for r in recs)
            by = collections.defaultdict(list)
            for r in sorted((r for r in recs if r["epoch"] == last), key=lambda r: r["start_ms"]):
                by[(r["name"], r["stream"])].append(f"{r['start_ms']:.3f}+{r['end_ms'] - r['start_ms']:.3f}")
            span = max(r["end_ms"] for r in recs if r["epoch"] == last)
            print(f"COLS {method} {M},{K},{N} dev0 epoch {last} span {span:.3f}", flush=True)
            for (name, stream), spans in by.items():
                print(f"COLS   {name:7s} {stream:10s} {' '.join(spans)}", flush=True)
    jax_ub.shutdown()


if __name__ == "__main__":
    main()
