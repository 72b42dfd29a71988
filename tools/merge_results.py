"""Merges a fresh ``python -m jax_ub.bench ag|rs|bulk`` JSON into the committed one of the same
machine and op, and redraws the bar chart beside it (``<file>.png``, for a look: charts are not
committed).

    python tools/merge_results.py FRESH.json COMMITTED.json

Cases are replaced whole: every committed record of a case (op, tp, M, K, N, dtype) that the fresh
run has records of is dropped, so no case mixes runs (impls are compared as measured side by side
in one run); the committed file's other cases stay, and so do their failures (``"failures"``: those
of replaced cases go). Each record keeps its run's provenance: before merging, the keys of
:data:`PROVENANCE` that its file's header has (``chain``: 1 where a header of an older file has
none) are written into each of its records, timelines and failures that lacks them; the merged
header then states such a key only where every record agrees on it, except ``date`` and ``jax``,
which the record format requires: where the records disagree, those are the fresh run's (the
file's latest). Timelines are replaced per (op, tp, M, K, N, dtype, method). Files of different ops
(ag, rs, bulk), machines or GPU models are refused (exit 2, nothing written), as are wrong
arguments. The file is replaced atomically. After merging AG or RS records, regenerate the table
``method="auto"`` chooses from: ``python tools/measured_table.py``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from jax_ub.bench import agrs, bulk
from jax_ub.bench.harness import agreed, write_doc

USAGE = "usage: python tools/merge_results.py FRESH.json COMMITTED.json"
# Header keys that describe one run; a merged file's records come from several.
PROVENANCE = ("date", "chain", "jax", "jax_ub", "device_kind", "path", "config")
# Header keys the record format requires ({"machine", "date", "jax", "records"}): where the records
# disagree, the header has the fresh (latest) run's, and each record its own.
LATEST = ("date", "jax")
FILE_OPS = {"ag": {"ag_gemm"}, "rs": {"gemm_rs"}, "bulk": {"bulk_ag", "bulk_rs"}}  # bench subcommand: ops


class Refused(Exception):
    pass


def case_key(r: dict) -> tuple:
    return (r["op"], r["tp"], r["M"], r["K"], r["N"], r["dtype"])


def timeline_key(t: dict) -> tuple:
    return (t.get("op"), t["tp"], t["M"], t["K"], t["N"], t.get("dtype"), t.get("method", "auto"))


def read(path: str) -> tuple[dict, str]:
    """The document and which bench subcommand wrote it (a key of :data:`FILE_OPS`)."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise Refused(f"{path}: cannot read a bench JSON: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("records"), list) or not doc["records"]:
        raise Refused(f"{path}: no records (expected a file of python -m jax_ub.bench ag|rs|bulk)")
    ops = {r.get("op") for r in doc["records"]}
    kind = next((k for k, want in FILE_OPS.items() if ops <= want), None)
    if kind is None:
        raise Refused(
            f"{path}: records of {', '.join(sorted(map(str, ops)))}: not one bench ag, rs or "
            f"bulk run (this merges those only)"
        )
    return doc, kind


def stamped(items: list[dict], header: dict) -> list[dict]:
    """``items`` with the header's :data:`PROVENANCE` values where they have none of their own."""
    run = {k: header[k] for k in PROVENANCE if k in header}
    run.setdefault("chain", 1)  # older files: a header chain only above 1, none in the records
    return [{**run, **item} for item in items]


def merge(fresh: dict, old: dict) -> dict:
    """The merged document (see the module doc)."""
    replaced = {case_key(r) for r in fresh["records"]}
    records = [r for r in stamped(old["records"], old) if case_key(r) not in replaced] + stamped(
        fresh["records"], fresh
    )
    records.sort(key=lambda r: -r["tp"])  # stable: tp 4 first, each in run order
    new_t = {timeline_key(t) for t in fresh.get("timelines", [])}
    timelines = [t for t in stamped(old.get("timelines", []), old) if timeline_key(t) not in new_t] + stamped(
        fresh.get("timelines", []), fresh
    )
    failures = [f for f in stamped(old.get("failures", []), old) if case_key(f) not in replaced] + stamped(
        fresh.get("failures", []), fresh
    )
    body = ("records", "timelines", "failures")
    out: dict[str, Any] = {k: v for doc in (old, fresh) for k, v in doc.items() if k not in body + PROVENANCE}
    for key in PROVENANCE:
        value = agreed(records, key)
        if value is not None:
            out[key] = value
        elif key in LATEST and key in fresh:
            out[key] = fresh[key]  # the record format's header keys: the latest run's
    out["complete"] = bool(old.get("complete", True) and fresh.get("complete", True))
    if failures or "failures" in fresh or "failures" in old:
        out["failures"] = failures
    if timelines:
        out["timelines"] = timelines
    out["records"] = records
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2 or any(a.startswith("-") for a in argv):
        print(f"error: expected FRESH.json COMMITTED.json; got {argv!r}\n{USAGE}", file=sys.stderr)
        return 2
    fresh_path, path = argv
    try:
        (fresh, kind), (old, old_kind) = read(fresh_path), read(path)
        if kind != old_kind:
            raise Refused(f"{fresh_path} is a bench {kind} file and {path} a bench {old_kind} file")
        for key in ("machine", "device_kind"):
            if key in fresh and key in old and fresh[key] != old[key]:
                raise Refused(
                    f"{fresh_path} was measured on {key} {fresh[key]!r} and {path} on "
                    f"{old[key]!r}: merge only runs of one machine"
                )
    except Refused as e:
        print(f"error: {e}; nothing written\n{USAGE}", file=sys.stderr)
        return 2
    out = merge(fresh, old)
    write_doc(path, out)
    stem, dtype = os.path.splitext(path)[0], out["records"][0]["dtype"]
    if kind == "bulk":
        bulk.draw(out["records"], stem, dtype)
    else:
        agrs.draw(out["records"], stem, kind, dtype)
    print(
        f"{path}: {len(out['records'])} records ({len(fresh['records'])} fresh), "
        f"{len(out.get('timelines', []))} timelines"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
