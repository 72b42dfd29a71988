"""Merges a fresh ``python -m jax_ub.bench ag|rs`` JSON into the committed one of the same machine:
records of the fresh run replace those of the same (op, tp, M, K, N, dtype, impl), timelines those
of the same (tp, M, K, N, method); everything else of the committed file is kept. Redraws the bar
chart beside it.

    python scripts/merge_results.py FRESH.json COMMITTED.json
"""

from __future__ import annotations

import json
import os
import sys

from jax_ub.bench.agrs import CHART as AG_RS_CHART
from jax_ub.bench.harness import plot


def _rkey(r: dict) -> tuple:
    return (r["op"], r["tp"], r["M"], r["K"], r["N"], r["dtype"], r["impl"])


def _tkey(t: dict) -> tuple:
    return (t["tp"], t["M"], t["K"], t["N"], t.get("method", "auto"))


def main() -> int:
    fresh_path, path = sys.argv[1], sys.argv[2]
    with open(fresh_path) as f:
        fresh = json.load(f)
    with open(path) as f:
        old = json.load(f)
    new_keys = {_rkey(r) for r in fresh["records"]}
    records = [r for r in old["records"] if _rkey(r) not in new_keys] + fresh["records"]
    records.sort(key=lambda r: -r["tp"])  # stable: tp 4 first, each in run order
    new_t = {_tkey(t) for t in fresh.get("timelines", [])}
    timelines = [t for t in old.get("timelines", []) if _tkey(t) not in new_t] + fresh.get("timelines", [])
    out = {**old, **{k: v for k, v in fresh.items() if k not in ("records", "timelines")},
           "records": records}
    if timelines:
        out["timelines"] = timelines
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    stem = os.path.splitext(path)[0]
    op = "ag" if records[0]["op"] == "ag_gemm" else "rs"
    plot(records, stem + ".png", f"jax_ub {op} ({os.path.basename(stem)}, {records[0]['dtype']})",
         AG_RS_CHART, lambda r: f"tp{r['tp']}\n{r['M']}x{r['K']}x{r['N']}")
    print(f"{path}: {len(records)} records ({len(fresh['records'])} fresh), {len(timelines)} timelines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
