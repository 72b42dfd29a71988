"""Timelines of traced jax_ub ops: Gantt pictures of one op (``python -m jax_ub.bench ag|rs
--timeline``) and a Chrome/Perfetto trace of a whole step's ops (``python -m jax_ub.bench layer``).

A trace is a list of records, one per timed step of one op on one device, as returned by
``jax_ub.trace.trace_collect()``::

    {"device": 0, "rank": 0, "op": "all_gather_matmul", "epoch": 3, "name": "gemm",
     "chunk": 2, "stream": "compute0", "start_ms": 0.41, "end_ms": 0.77}

``name`` is one of :data:`NAMES` (``publish``, ``copy``, ``gemm``, ``reduce``, ``wait``,
``local_copy``); ``chunk`` is the peer rank whose chunk the step handles (-1: none); times are
milliseconds from the start of that op on that device. :func:`draw` makes one horizontal lane per
(device, stream), lanes grouped by device, bars colored by ``name``; :func:`summary` says, per
device, how long the op took and how much of the copy time ran under a GEMM; :func:`chrome_trace`
turns the records of many ops (a whole step) into the Chrome trace-event JSON that Perfetto
(ui.perfetto.dev) and chrome://tracing open.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

NAMES = ("publish", "local_copy", "copy", "wait", "gemm", "reduce")
_COLORS = {
    "publish": "#9467bd",
    "local_copy": "#8c564b",
    "copy": "#1f77b4",
    "wait": "#bbbbbb",
    "gemm": "#ff7f0e",
    "reduce": "#2ca02c",
}
_OTHER_COLOR = "#7f7f7f"


def lanes(records: Iterable[dict]) -> list[tuple[int, str]]:
    """The (device, stream) lanes of ``records``, by device, then comm streams before compute."""
    keys = {(int(r["device"]), str(r["stream"])) for r in records}
    return sorted(keys, key=lambda k: (k[0], not k[1].startswith("comm"), k[1]))


def _merged(intervals: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _overlap(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]) -> float:
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in b)


def summary(records: Sequence[dict]) -> str:
    """One line per device: span of the op, busy time of copies and GEMMs, copy time under a GEMM."""
    lines = []
    for dev in sorted({int(r["device"]) for r in records}):
        mine = [r for r in records if int(r["device"]) == dev]
        span = max(r["end_ms"] for r in mine) - min(r["start_ms"] for r in mine)
        copy = _merged([(r["start_ms"], r["end_ms"]) for r in mine if r["name"] == "copy"])
        gemm = _merged([(r["start_ms"], r["end_ms"]) for r in mine if r["name"] == "gemm"])
        copy_ms = sum(e - s for s, e in copy)
        gemm_ms = sum(e - s for s, e in gemm)
        hidden = _overlap(copy, gemm)
        frac = f"{100 * hidden / copy_ms:.0f}%" if copy_ms > 0 else "n/a"
        lines.append(
            f"device {dev}: span {span:.3f} ms, gemm {gemm_ms:.3f} ms, copy {copy_ms:.3f} ms "
            f"({frac} of it under a GEMM)"
        )
    return "\n".join(lines)


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def draw(records: Sequence[dict], path: str, title: str) -> str | None:
    """Writes a Gantt PNG of ``records`` to ``path``; returns ``path``, or ``None`` (and draws
    nothing) when matplotlib is missing or there are no records."""
    plt = _pyplot()
    if plt is None or not records:
        return None
    from matplotlib.patches import Patch

    order = lanes(records)
    row = {k: i for i, k in enumerate(order)}
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.42 * len(order)))
    seen: list[str] = []
    for r in records:
        name = str(r["name"])
        y = row[(int(r["device"]), str(r["stream"]))]
        width = max(float(r["end_ms"]) - float(r["start_ms"]), 0.0)
        ax.barh(
            y,
            width,
            left=float(r["start_ms"]),
            height=0.8,
            color=_COLORS.get(name, _OTHER_COLOR),
            edgecolor="black",
            linewidth=0.3,
        )
        if int(r.get("chunk", -1)) >= 0:
            ax.text(
                float(r["start_ms"]) + width / 2,
                y,
                str(r["chunk"]),
                ha="center",
                va="center",
                fontsize=6,
                clip_on=True,
            )
        if name not in seen:
            seen.append(name)
    for i in range(1, len(order)):  # a line between the row groups of two devices
        if order[i][0] != order[i - 1][0]:
            ax.axhline(i - 0.5, color="black", linewidth=0.8)
    ax.set_yticks(range(len(order)))
    ax.set_yticklabels([f"dev{d} {s}" for d, s in order], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms from the start of the op on each device (bar label: chunk = source rank)")
    ax.set_title(title, fontsize=9)
    ordered = [n for n in NAMES if n in seen] + [n for n in seen if n not in NAMES]
    ax.legend(
        handles=[Patch(color=_COLORS.get(n, _OTHER_COLOR), label=n) for n in ordered],
        fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
    )
    ax.grid(axis="x", linewidth=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------------
# Chrome / Perfetto trace-event JSON

# The trace's process ids: 1000 + the CUDA ordinal, clear of the small pids of a jax.profiler trace
# of the same run when both are loaded together.
PID_BASE = 1000
OPS_LANE = "jax_ub ops"  # the thread of each device's whole-op spans, above its streams


def chrome_trace(records: Sequence[dict], *, title: str, note: str = "") -> dict:
    """The Chrome trace-event JSON (``{"traceEvents": [...], "displayTimeUnit": "ms",
    "otherData": {...}}``) of ``records`` (:func:`jax_ub.trace.trace_collect`'s, of any number of
    ops): per device a process ``jax_ub GPU <device>``, in it one thread ``jax_ub ops`` with one
    span per op (its name, epoch and rank; from its first step's start to its last step's end) and
    one thread per stream with a span per step (``"<name> <chunk>"``, args op, epoch, chunk, rank).

    Times (``ts``, ``dur``) are microseconds from the first op traced on that device (CUDA events:
    ``op_start_ms + start_ms``), not the clock of a ``jax.profiler`` trace: the two open side by
    side (``otherData.clock`` says so), not aligned. With no records the file holds only its
    metadata and ``note`` (why there is no timeline)."""
    events: list[dict] = []
    ops: dict[tuple[int, Any], dict] = {}
    tids: dict[tuple[int, str], int] = {}  # (device, stream) -> thread id (0: the ops lane)
    for dev, stream in lanes(records):
        tids[(dev, stream)] = sum(1 for d, _ in tids if d == dev) + 1
    for dev in sorted({d for d, _ in tids}):
        pid = PID_BASE + dev
        events.append(_meta("process_name", pid, 0, f"jax_ub GPU {dev}"))
        events.append(_meta("process_sort_index", pid, 0, dev, key="sort_index"))
        events.append(_meta("thread_name", pid, 0, OPS_LANE))
    for (dev, stream), tid in tids.items():
        events.append(_meta("thread_name", PID_BASE + dev, tid, stream))
        events.append(_meta("thread_sort_index", PID_BASE + dev, tid, tid, key="sort_index"))
    for r in records:
        dev = int(r["device"])
        t0 = float(r.get("op_start_ms", 0.0))
        start, end = t0 + float(r["start_ms"]), t0 + float(r["end_ms"])
        chunk = int(r.get("chunk", -1))
        args = {"op": r.get("op"), "epoch": r.get("epoch"), "chunk": chunk, "rank": r.get("rank")}
        events.append(
            {
                "name": f"{r['name']} {chunk}" if chunk >= 0 else str(r["name"]),
                "cat": str(r.get("op", "jax_ub")),
                "ph": "X",
                "pid": PID_BASE + dev,
                "tid": tids[(dev, str(r["stream"]))],
                "ts": round(start * 1e3, 3),
                "dur": round(max(end - start, 0.0) * 1e3, 3),
                "args": args,
            }
        )
        span = ops.setdefault(
            (dev, r.get("epoch")), {"op": r.get("op"), "rank": r.get("rank"), "s": start, "e": end}
        )
        span["s"], span["e"] = min(span["s"], start), max(span["e"], end)
    for (dev, epoch), span in sorted(ops.items(), key=lambda kv: (kv[0][0], kv[1]["s"])):
        events.append(
            {
                "name": str(span["op"]),
                "cat": "op",
                "ph": "X",
                "pid": PID_BASE + dev,
                "tid": 0,
                "ts": round(span["s"] * 1e3, 3),
                "dur": round((span["e"] - span["s"]) * 1e3, 3),
                "args": {"epoch": epoch, "rank": span["rank"]},
            }
        )
    other = {
        "title": title,
        "clock": "us from the first jax_ub op traced on each device (CUDA events); not a "
        "jax.profiler trace's clock: open the two side by side",
        "ops": len(ops),
        "records": len(records),
    }
    if note:
        other["note"] = note
    if not records:
        events.append(_meta("process_name", PID_BASE, 0, f"jax_ub: no timeline ({note or 'no records'})"))
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def _meta(what: str, pid: int, tid: int, value: Any, key: str = "name") -> dict:
    return {"name": what, "ph": "M", "pid": pid, "tid": tid, "args": {key: value}}
