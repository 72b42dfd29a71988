"""``python -m jax_ub.bench breakdown TRACE.json [--records LAYER.json]``: where a traced step's
time inside jax_ub's ops goes, per device, from a Chrome/Perfetto trace that ``bench layer`` (or
:func:`jax_ub.bench.timeline.chrome_trace`) wrote. Reads JSON only: no devices, no timing.

Per op (one ``op`` span and its step spans, matched by epoch):

* ``op_us``: the op's span, from its first step's start to its last step's end;
* ``gemm_us``: the time some GEMM step of the op runs (the union of its ``gemm`` spans);
* ``wait_us`` = ``op_us - gemm_us``: the time inside the op when no GEMM of it runs: the GEMM
  stream waits for a chunk (communication the schedule did not hide, or a peer that started late),
  for a local copy, or for the final reduction;
* ``copy_us``: the union of its copy spans (peer copies, local copies, reductions), which overlap
  its GEMMs where the schedule hides them.

With ``--records`` (a ``bench layer`` JSON of the same run) it also splits the gap between
jax_ub's step and the floor ``no_comm`` (the same layer's GEMMs with no communication) into the
waits inside the ops and the rest (``rest_us``: outside the ops' waits; the chunked GEMMs' lower
efficiency and anything else the trace does not show), per remat case. The trace covers one step
of the case the bench traced (its first, ``--remat``'s first value).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from jax_ub.bench.timeline import PID_BASE


class TraceError(ValueError):
    """The file is not a trace this reads; the message says what was expected and what was found."""


def _union(spans: Iterable[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, end = 0.0, None
    for s, e in sorted(spans):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def _read(path: str, what: str) -> Any:
    """The JSON document in ``path``, or :class:`TraceError` naming ``what`` was expected there."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise TraceError(f"{path}: cannot read a {what}: {e}") from None


def load(path: str) -> list[dict]:
    """The complete (``"ph": "X"``) events of a Chrome trace file, or :class:`TraceError`."""
    doc = _read(path, "trace JSON")
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise TraceError(
            f"{path}: expected a Chrome trace ({{'traceEvents': [...]}}); got {type(doc).__name__}"
        )
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X"]


def _spans(steps: Sequence[dict], gemm: bool) -> list[tuple[float, float]]:
    """``(start, end)`` of the GEMM steps (``gemm``) or of the others (copies, reductions)."""
    return [
        (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        for e in steps
        if str(e["name"]).startswith("gemm") == gemm
    ]


def ops(events: Sequence[dict]) -> dict[int, list[dict]]:
    """``{pid: [per-op row, ...]}`` in time order (see the module doc for the row's fields)."""
    by_pid: dict[int, list[dict]] = {}
    for pid in sorted({int(e["pid"]) for e in events}):
        mine = [e for e in events if int(e["pid"]) == pid]
        rows = []
        for op in sorted((e for e in mine if e.get("cat") == "op"), key=lambda e: e["ts"]):
            epoch = (op.get("args") or {}).get("epoch")
            steps = [
                e
                for e in mine
                if e.get("cat") != "op"
                and (e.get("args") or {}).get("epoch") == epoch
                and (e.get("args") or {}).get("op", op["name"]) == op["name"]
            ]
            gemm = _union(_spans(steps, True))
            copy = _union(_spans(steps, False))
            dur = float(op["dur"])
            rows.append(
                {
                    "op": op["name"],
                    "epoch": epoch,
                    "start_us": float(op["ts"]),
                    "op_us": dur,
                    "gemm_us": gemm,
                    "wait_us": max(dur - gemm, 0.0),
                    "copy_us": copy,
                    "steps": len(steps),
                }
            )
        if rows:
            by_pid[pid] = rows
    return by_pid


def totals(rows: Sequence[dict]) -> dict[str, float]:
    """Sums of one device's rows."""
    return {k: sum(r[k] for r in rows) for k in ("op_us", "gemm_us", "wait_us", "copy_us")}


def layer_gaps(path: str) -> list[dict]:
    """Per remat case of a ``bench layer`` JSON: ``{"remat", "xla_ms", "jax_ub_ms", "no_comm_ms",
    "E"}`` where all three were timed."""
    doc = _read(path, "bench layer JSON")
    recs = doc.get("records") if isinstance(doc, dict) else None
    if not isinstance(recs, list) or not any(r.get("op") == "layer" for r in recs):
        raise TraceError(f"{path}: expected a bench layer JSON (records of op 'layer'); found none")
    out = []
    for remat in dict.fromkeys(r["remat"] for r in recs if r.get("op") == "layer"):
        ms = {r["impl"]: r["ms"] for r in recs if r.get("op") == "layer" and r["remat"] == remat}
        if all(k in ms for k in ("xla", "jax_ub", "no_comm")):
            hidden = next((r.get("E") for r in recs if r["remat"] == remat and r["impl"] == "jax_ub"), None)
            out.append(
                {
                    "remat": remat,
                    "xla_ms": ms["xla"],
                    "jax_ub_ms": ms["jax_ub"],
                    "no_comm_ms": ms["no_comm"],
                    "E": hidden,
                }
            )
    return out


def report(events: Sequence[dict], gaps: Sequence[dict] = ()) -> str:
    """The text ``breakdown`` prints."""
    by_pid = ops(events)
    if not by_pid:
        return "no jax_ub op spans in this trace (at tp=1, or off the CUDA path, no jax_ub op runs)"
    lines = []
    for pid, rows in by_pid.items():
        lines.append(f"device {pid - PID_BASE}: {len(rows)} ops")
        lines.append("  op                       start_us    op_us  gemm_us  wait_us  copy_us")
        for r in rows:
            lines.append(
                f"  {r['op']:<24} {r['start_us']:8.0f} {r['op_us']:8.0f} {r['gemm_us']:8.0f} "
                f"{r['wait_us']:8.0f} {r['copy_us']:8.0f}"
            )
        t = totals(rows)
        lines.append(
            f"  total{'':<28} {t['op_us']:8.0f} {t['gemm_us']:8.0f} {t['wait_us']:8.0f} {t['copy_us']:8.0f}"
        )
    waits = [totals(rows)["wait_us"] for rows in by_pid.values()]
    wait = sum(waits) / len(waits)
    for g in gaps:
        gap = (g["jax_ub_ms"] - g["no_comm_ms"]) * 1e3
        exposed = (g["xla_ms"] - g["no_comm_ms"]) * 1e3
        lines.append(
            f"remat={g['remat']}: jax_ub - no_comm = {gap:.0f} us (XLA's step exposes {exposed:.0f} us; "
            f"E {g['E']}): waits inside the ops {wait:.0f} us (mean over devices), "
            f"the rest {gap - wait:.0f} us"
        )
    return "\n".join(lines)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "breakdown",
        help="where a bench layer trace's time inside jax_ub's ops goes (GEMM, waits, copies), per device",
    )
    p.add_argument("trace", help="a <stem>-trace.json of bench layer (a Chrome trace of jax_ub's ops)")
    p.add_argument(
        "--records",
        default=None,
        help="the bench layer JSON of the same run: also split jax_ub's gap to no_comm",
    )


def run(a: argparse.Namespace) -> int:
    try:
        events = load(a.trace)
        gaps = layer_gaps(a.records) if a.records else []
    except TraceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report(events, gaps))
    return 0
