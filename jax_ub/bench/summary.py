"""``python -m jax_ub.bench summary FILE.json ... [--tp N] [--dtype D] [--target OP=X] [--ideal-max R]``:
bench records (``ag``, ``rs``, ``bulk`` JSON files) as a markdown table with one line per op and tp.

Per shape: XLA plain and jax_ub (``method="auto"``) in ms, the speedup, and how far jax_ub is from
its floor: T/T_ideal with T_ideal = max(``gemm_alone``, ``comm_jax_ub``) (for bulk, the GEMM and
the collective it overlaps, each alone). Where the run timed ``gemm_chunks`` (the GEMM as the tp
row-chunk GEMMs the overlapped ops run, back to back), the split floor: max(``gemm_chunks``,
``comm_jax_ub``) / T_ideal, the T/T_ideal of a perfect overlap of those chunk GEMMs.

Per op and tp: at how many shapes jax_ub is faster than XLA plain, the geometric mean speedup and
the range of T/T_ideal. Thresholds are the caller's, never built in: ``--target ag_gemm=1.3`` (per
op, repeatable) adds whether the geometric mean speedup meets that value ("meets", or "below" and
by how much), and ``--ideal-max 1.1`` how many shapes are within that T/T_ideal and where the split
floor alone exceeds it. A target is met only where every shape of the selection has a row. Where
jax_ub's records name the method auto ran (``"method"``) and the run timed that method too, the line
gives the run's noise: |jax_ub / jax_ub_<method> - 1| (xla_plain where auto ran XLA's path), the
same program timed apart, as median and max over the shapes (:meth:`Case.twin_spread`); a speedup
difference smaller than that is not resolved by the run.

A case (op, tp, dtype, shape) is taken whole from the last file given that has records of it, so
a row never mixes runs. A case of the selection that lacks one of the records a row needs
(:data:`NEEDED`), or whose records ran different numbers of ops per dispatch (``chain``), has no row:
its op's and tp's line names it with what it lacks, and the geometric mean then says over how many
of the shapes it is. A file without ag/rs/bulk records, or a selection (``--tp``, ``--dtype``)
that leaves no case with every impl a row needs, is an error (stderr, exit 2). It reads JSON only
and needs no GPU. The README's performance table is this command's output over the committed
records (the command is written above the table, and a CPU test checks that the two agree).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections.abc import Sequence
from typing import Any

from jax_ub.bench.harness import geomean, twin_impl

TITLES: dict[str, str] = {  # the ops a summary covers, in table order, and each one's line title
    "ag_gemm": "AG->GEMM (`all_gather_matmul`)",
    "gemm_rs": "GEMM->RS (`matmul_reduce_scatter`)",
    "bulk_ag": "bulk all-gather beside a GEMM",
    "bulk_rs": "bulk reduce-scatter beside a GEMM",
}
NEEDED = ("xla_plain", "jax_ub", "gemm_alone", "comm_jax_ub")  # the records a row is made of

Key = tuple[str, int, str, int, int, int]  # op, tp, dtype, M, K, N


@dataclasses.dataclass
class Case:
    """One case's records of one file: ms and ops per timed dispatch (``chain``) per impl."""

    ms: dict[str, float] = dataclasses.field(default_factory=dict)
    chain: dict[str, int] = dataclasses.field(default_factory=dict)
    auto: str | None = None  # the method jax_ub (auto) ran, where its record says

    def twin_spread(self) -> float | None:
        """|jax_ub / its twin - 1|: the same program timed twice in one run (auto and the method it
        ran, or xla_plain where it ran XLA's path), so that run's noise; None where the records do
        not say the method or lack the twin, or the two ran different chains."""
        twin = None if self.auto is None else twin_impl(self.auto)
        if twin not in self.ms or "jax_ub" not in self.ms or self.chain[twin] != self.chain["jax_ub"]:
            return None
        return abs(self.ms["jax_ub"] / self.ms[twin] - 1.0)

    def lacks(self) -> str | None:
        """Why no row can be made of it (a missing record, runs of different chains), or None."""
        missing = [i for i in NEEDED if i not in self.ms]
        if missing:
            return f"no {', '.join(missing)} record{'s' if len(missing) > 1 else ''}"
        chains = {i: self.chain[i] for i in NEEDED}
        if len(set(chains.values())) > 1:
            return "records of different chains (" + ", ".join(f"{i} {c}" for i, c in chains.items()) + ")"
        return None


def read(path: str) -> tuple[dict[Key, Case], list[str]]:
    """One file: ``{(op, tp, dtype, M, K, N): Case}`` of its records of the ops in :data:`TITLES`
    (a record's ``chain``, else the header's, else 1), and the other ops its records are of (e.g.
    an ``mlp`` run's)."""
    with open(path) as f:
        try:
            doc = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("records"), list):
        raise ValueError(
            f"{path}: not a bench result file (expected a JSON object with a "
            f"'records' list, as python -m jax_ub.bench ag|rs|bulk writes)"
        )
    cases: dict[Key, Case] = {}
    others: list[str] = []
    for i, r in enumerate(doc["records"]):
        op = r.get("op") if isinstance(r, dict) else None
        if op not in TITLES:
            if str(op) not in others:
                others.append(str(op))
            continue
        try:
            key = (op, int(r["tp"]), r["dtype"], int(r["M"]), int(r["K"]), int(r["N"]))
            case = cases.setdefault(key, Case())
            case.ms[r["impl"]] = float(r["ms"])
            case.chain[r["impl"]] = int(r.get("chain", doc.get("chain", 1)))
            if r["impl"] == "jax_ub" and isinstance(r.get("method"), str):
                case.auto = r["method"]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(
                f"{path}: record {i} ({op}) is not a bench record (expected op, tp, "
                f"dtype, M, K, N, impl and ms; {type(e).__name__}: {e})"
            ) from None
    return cases, others


def load(paths: Sequence[str]) -> dict[Key, Case]:
    """{(op, tp, dtype, M, K, N): Case} over the files: each case whole from the last file that has it."""
    cases: dict[Key, Case] = {}
    for path in paths:
        cases.update(read(path)[0])
    return cases


def markdown(
    cases: dict[Key, Case],
    *,
    tps: Sequence[int] | None = None,
    dtype: str = "bfloat16",
    targets: dict[str, float] | None = None,
    ideal_max: float | None = None,
) -> str:
    """The table and, per op and tp, a line of what the rows add up to; ``targets`` (op -> geometric
    mean speedup) and ``ideal_max`` (a T/T_ideal) add whether the rows reach those values."""
    targets = targets or {}
    keys = sorted(
        (k for k in cases if k[2] == dtype and (not tps or k[1] in tps)),
        key=lambda k: (list(TITLES).index(k[0]), -k[1], k[3:]),
    )
    lines = [
        "| op | tp | M,K,N | XLA plain ms | jax_ub ms | speedup | T/T_ideal | split floor |",
        "|---|---|---|---|---|---|---|---|",
    ]
    verdicts: list[str] = []
    # (op, tp) -> [(speedup, T/T_ideal, split floor or None, "M,K,N", twin spread or None)], and the
    # shapes without a row
    groups: dict[tuple[str, int], list[tuple[float, float, float | None, str, float | None]]] = {}
    misses: dict[tuple[str, int], list[str]] = {}
    for op, tp, _, M, K, N in keys:
        c = cases[(op, tp, dtype, M, K, N)]
        rows = groups.setdefault((op, tp), [])
        why = c.lacks()
        if why:
            misses.setdefault((op, tp), []).append(f"{M},{K},{N}: {why}")
            continue
        r = c.ms
        speedup = r["xla_plain"] / r["jax_ub"]
        ideal = max(r["gemm_alone"], r["comm_jax_ub"])
        floor = max(r["gemm_chunks"], r["comm_jax_ub"]) / ideal if "gemm_chunks" in r else None
        rows.append((speedup, r["jax_ub"] / ideal, floor, f"{M},{K},{N}", c.twin_spread()))
        lines.append(
            f"| {op} | {tp} | {M},{K},{N} | {r['xla_plain']:.3f} | {r['jax_ub']:.3f} | "
            f"{speedup:.2f}x | {r['jax_ub'] / ideal:.2f} | "
            f"{'-' if floor is None else f'{floor:.2f}'} |"
        )
    if not any(groups.values()):
        return f"no {dtype} case with xla_plain, jax_ub, gemm_alone and comm_jax_ub records\n"
    for (op, tp), rows in groups.items():
        goal = targets.get(op)
        missed = misses.get((op, tp), [])
        n = len(rows) + len(missed)
        gm = geomean([row[0] for row in rows])
        faster = sum(row[0] > 1 for row in rows)
        over = f" over {len(rows)} of {n} shapes" if missed else ""
        verdict = ""
        if goal is not None:  # met only with a row at every shape of the selection
            met = gm is not None and gm >= goal and not missed
            by = f" by {100 * (1 - gm / goal):.1f}%" if gm is not None and gm < goal else ""
            verdict = f" (target {goal:.2f}x: {'meets' if met else 'below' + by})"
        ratios = sorted(row[1] for row in rows)
        parts = [
            f"faster than XLA plain at {faster} of {n} shapes",
            (f"geometric mean speedup {gm:.2f}x{over}" if gm is not None else "no geometric mean speedup")
            + verdict,
        ]
        if ratios:
            low, high = f"{ratios[0]:.2f}", f"{ratios[-1]:.2f}"
            parts.append(f"T/T_ideal {low}" + (f" to {high}" if high != low else ""))
        if ideal_max is not None:
            within = sum(x <= ideal_max for x in ratios)
            parts.append(f"within {ideal_max:.2f}x of T_ideal at {within} of {n}")
        spreads = sorted(row[4] for row in rows if row[4] is not None)
        if spreads:  # what a difference must exceed to be resolved by these runs
            parts.append(
                f"noise (auto and the method it ran, timed apart in one run): median "
                f"{100 * statistics.median(spreads):.1f}%, max {100 * spreads[-1]:.1f}% over "
                f"{len(spreads)} shape{'s' if len(spreads) > 1 else ''}"
            )
        if missed:
            parts.append(f"no row at {'; '.join(missed)}")
        floored = [
            row[3] for row in rows if ideal_max is not None and row[2] is not None and row[2] > ideal_max
        ]
        if floored:
            parts.append(f"the split floor exceeds {ideal_max:.2f} at {', '.join(floored)}")
        verdicts.append(f"- {TITLES[op]}, tp={tp}: " + "; ".join(parts) + ".")
    return "\n".join(lines) + "\n\n" + "\n".join(verdicts) + "\n"


def problem(
    files: Sequence[str],
    per_file: Sequence[tuple[dict[Key, Case], list[str]]],
    tps: Sequence[int] | None,
    dtype: str,
) -> str | None:
    """Why the files (``per_file``: :func:`read` of each) give no table with this selection, or None."""
    for path, (cases, others) in zip(files, per_file, strict=True):
        if not cases:
            return (
                f"{path}: no {', '.join(list(TITLES)[:-1])} or {list(TITLES)[-1]} records (expected a "
                f"file of python -m jax_ub.bench "
                f"ag|rs|bulk; got " + (f"records of {', '.join(others)})" if others else "no records)")
            )
    cases = {k: v for c, _ in per_file for k, v in c.items()}
    names = ", ".join(files)
    have = "the file has" if len(files) == 1 else "the files have"
    at_tp = [k for k in cases if not tps or k[1] in tps]
    tp_text = f"tp={' or '.join(map(str, tps))}" if tps else ""

    def listed(values: Any) -> str:
        return ", ".join(map(str, sorted(set(values))))

    if not at_tp:
        return f"no records with {tp_text} in {names}; {have} tp {listed(k[1] for k in cases)}"
    chosen = [k for k in at_tp if k[2] == dtype]
    if not chosen:
        return (
            f"no {dtype} records{' with ' + tp_text if tps else ''} in {names}; {have} dtype "
            f"{listed(k[2] for k in at_tp)}{' there' if tps else ''} (--dtype chooses)"
        )
    if not any(set(NEEDED) <= cases[k].ms.keys() for k in chosen):
        k = chosen[0]
        missing = [i for i in NEEDED if i not in cases[k].ms]
        return (
            f"no {dtype} case{' with ' + tp_text if tps else ''} in {names} has the {', '.join(NEEDED)} "
            f"records a row needs (e.g. {k[0]} tp={k[1]} {k[3]},{k[4]},{k[5]} has no "
            f"{', '.join(missing)}; a run off the CUDA path times no comm_jax_ub)"
        )
    return None


def run(a: argparse.Namespace) -> int:
    try:
        per_file = [read(path) for path in a.files]
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    why = problem(a.files, per_file, a.tp, a.dtype)
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    print(
        markdown(load(a.files), tps=a.tp, dtype=a.dtype, targets=dict(a.target or []), ideal_max=a.ideal_max),
        end="",
    )
    return 0


def _target(text: str) -> tuple[str, float]:
    """``OP=SPEEDUP`` of ``--target``: an op of :data:`TITLES` and a positive number."""
    op, sep, value = text.partition("=")
    if not sep or op not in TITLES:
        raise argparse.ArgumentTypeError(
            f"expected OP=SPEEDUP with OP one of {', '.join(TITLES)}; got {text!r}"
        )
    return op, _positive(value)


def _positive(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        x = float("nan")
    if not x > 0 or x == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number; got {text!r}")
    return x


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "summary",
        help="bench JSON files as a markdown table: speedup over XLA, T/T_ideal, and optional targets",
    )
    p.add_argument(
        "files",
        nargs="+",
        help="ag / rs / bulk JSON files (a later one's case replaces an earlier one's whole)",
    )
    p.add_argument(
        "--tp",
        type=int,
        action="append",
        default=None,
        help="only this tp (repeat for several; default: all)",
    )
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument(
        "--target",
        type=_target,
        action="append",
        default=None,
        metavar="OP=SPEEDUP",
        help="say whether OP's geometric mean speedup over XLA plain meets SPEEDUP "
        "(e.g. ag_gemm=1.3; repeat for other ops)",
    )
    p.add_argument(
        "--ideal-max",
        type=_positive,
        default=None,
        metavar="R",
        help="count the shapes within R of T_ideal and name those whose split floor exceeds R",
    )
