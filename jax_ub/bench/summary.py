"""``python -m jax_ub.bench summary FILE.json ... [--tp N] [--dtype D]``: bench records
(``ag``, ``rs``, ``bulk`` JSON files) checked against jax_ub's performance targets (those of
issues 4 and 5), as markdown.

Per shape: XLA plain and jax_ub (``method="auto"``) in ms, the speedup, and how far jax_ub is from
its floor: T/T_ideal with T_ideal = max(``gemm_alone``, ``comm_jax_ub``) (for bulk, the GEMM and
the collective it overlaps, each alone). Where the run timed ``gemm_chunks`` (the GEMM as the tp
row-chunk GEMMs the overlapped ops run, back to back), the split floor: max(``gemm_chunks``,
``comm_jax_ub``) / T_ideal, the T/T_ideal of a perfect overlap of those chunk GEMMs; above 1.10 the
T_ideal target is out of reach for a schedule of row chunks. Per op and tp: the geometric mean
speedup, and by how much it misses its target. The targets
(``TARGETS``): faster than XLA plain at every shape, a geometric mean speedup of at least 1.30x
(AG->GEMM) and 1.45x (GEMM->RS), and T/T_ideal <= 1.10 at every shape (bulk too). Where jax_ub's
records name the method auto ran (``"method"``) and the run timed that method too, the line gives
the run's noise: |jax_ub / jax_ub_<method> - 1| (xla_plain where auto ran XLA's path), the same
program timed apart, as median and max over the shapes (:meth:`Case.twin_spread`); a speedup
difference smaller than that is not resolved by the run.

A case (op, tp, dtype, shape) is taken whole from the last file given that has records of it, so
a row never mixes runs. A case of the selection that lacks one of the records a row needs
(:data:`NEEDED`), or whose records ran different numbers of ops per dispatch (``chain``), has no row:
it counts as a miss in its op's and tp's line, named with what it lacks, and the geometric mean then
says over how many of the shapes it is. At tp=4 in bfloat16 (what the targets are for), the line
also names the shapes of the issues (``harness.DEFAULT_SHAPES``, bulk: ``harness.BULK_SHAPES``) that
the files do not have. A file without ag/rs/bulk records, or a selection (``--tp``, ``--dtype``)
that leaves no case with every impl a row needs, is an error (stderr, exit 2). It reads JSON only
and needs no GPU. README's performance table is this command's output over the committed tp=4 files
(the command is written above the table, and a CPU test checks that the two agree).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections.abc import Sequence
from typing import Any

from jax_ub.bench.harness import BULK_SHAPES, DEFAULT_SHAPES, geomean, twin_impl

# op -> (title, minimum geometric-mean speedup over xla_plain or None); T/T_ideal <= T_IDEAL_MAX.
TARGETS: dict[str, tuple[str, float | None]] = {
    "ag_gemm": ("AG->GEMM (`all_gather_matmul`)", 1.30),
    "gemm_rs": ("GEMM->RS (`matmul_reduce_scatter`)", 1.45),
    "bulk_ag": ("bulk all-gather beside a GEMM", None),
    "bulk_rs": ("bulk reduce-scatter beside a GEMM", None),
}
T_IDEAL_MAX = 1.10
NEEDED = ("xla_plain", "jax_ub", "gemm_alone", "comm_jax_ub")  # the records a row is made of
# Where the targets are judged, and at which shapes (the issues' benchmark shapes).
TARGET_TP, TARGET_DTYPE = 4, "bfloat16"
REQUIRED = {"ag_gemm": DEFAULT_SHAPES, "gemm_rs": DEFAULT_SHAPES,
            "bulk_ag": BULK_SHAPES, "bulk_rs": BULK_SHAPES}

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
    """One file: ``{(op, tp, dtype, M, K, N): Case}`` of its records of the ops in :data:`TARGETS`
    (a record's ``chain``, else the header's, else 1), and the other ops its records are of (e.g.
    an ``mlp`` run's)."""
    with open(path) as f:
        try:
            doc = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("records"), list):
        raise ValueError(f"{path}: not a bench result file (expected a JSON object with a "
                         f"'records' list, as python -m jax_ub.bench ag|rs|bulk writes)")
    cases: dict[Key, Case] = {}
    others: list[str] = []
    for i, r in enumerate(doc["records"]):
        op = r.get("op") if isinstance(r, dict) else None
        if op not in TARGETS:
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
            raise ValueError(f"{path}: record {i} ({op}) is not a bench record (expected op, tp, "
                             f"dtype, M, K, N, impl and ms; {type(e).__name__}: {e})") from None
    return cases, others


def load(paths: Sequence[str]) -> dict[Key, Case]:
    """{(op, tp, dtype, M, K, N): Case} over the files: each case whole from the last file that has it."""
    cases: dict[Key, Case] = {}
    for path in paths:
        cases.update(read(path)[0])
    return cases


def markdown(cases: dict[Key, Case], *, tps: Sequence[int] | None = None, dtype: str = "bfloat16") -> str:
    """The table and, per op and tp, a line saying which targets hold."""
    keys = sorted((k for k in cases if k[2] == dtype and (not tps or k[1] in tps)),
                  key=lambda k: (list(TARGETS).index(k[0]), -k[1], k[3:]))
    lines = ["| op | tp | M,K,N | XLA plain ms | jax_ub ms | speedup | T/T_ideal | split floor |",
             "|---|---|---|---|---|---|---|---|"]
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
        lines.append(f"| {op} | {tp} | {M},{K},{N} | {r['xla_plain']:.3f} | {r['jax_ub']:.3f} | "
                     f"{speedup:.2f}x | {r['jax_ub'] / ideal:.2f} | "
                     f"{'-' if floor is None else f'{floor:.2f}'} |")
    if not any(groups.values()):
        return f"no {dtype} case with xla_plain, jax_ub, gemm_alone and comm_jax_ub records\n"
    for (op, tp), rows in groups.items():
        title, goal = TARGETS[op]
        missed = misses.get((op, tp), [])
        n = len(rows) + len(missed)
        gm = geomean([row[0] for row in rows])
        faster = sum(row[0] > 1 for row in rows)
        within = sum(row[1] <= T_IDEAL_MAX for row in rows)
        over = f" over {len(rows)} of {n} shapes" if missed else ""
        absent = ([s for s in REQUIRED[op] if (op, tp, dtype, *s) not in cases]
                  if (tp, dtype) == (TARGET_TP, TARGET_DTYPE) else [])
        # the targets hold for the issues' shapes: with one absent, the target is missed
        met = gm is not None and gm >= (goal or 0) and not missed and not absent
        short = (f" by {100 * (1 - gm / goal):.1f}%" if goal and gm is not None and not met and gm < goal
                 else "")
        parts = [f"faster than XLA plain at {faster} of {n} shapes",
                 (f"geometric mean speedup {gm:.2f}x{over}" if gm is not None
                  else "no geometric mean speedup")
                 + (f" (target {goal:.2f}x: {'met' if met else 'missed'}{short})" if goal else ""),
                 f"within {T_IDEAL_MAX:.2f}x of T_ideal at {within} of {n}"]
        spreads = sorted(row[4] for row in rows if row[4] is not None)
        if spreads:  # what a difference must exceed to be resolved by these runs
            parts.append(f"noise (auto and the method it ran, timed apart in one run): median "
                         f"{100 * statistics.median(spreads):.1f}%, max {100 * spreads[-1]:.1f}% over "
                         f"{len(spreads)} shape{'s' if len(spreads) > 1 else ''}")
        if missed:
            parts.append(f"no row (a miss) at {'; '.join(missed)}")
        floored = [row[3] for row in rows if row[2] is not None and row[2] > T_IDEAL_MAX]
        if floored:
            parts.append(f"the split floor exceeds {T_IDEAL_MAX:.2f} at {', '.join(floored)}")
        verdicts.append(f"- {title}, tp={tp}: " + "; ".join(parts) + ".")
        if absent:
            verdicts.append(f"  Not in the files: {', '.join(','.join(map(str, s)) for s in absent)} (the "
                            f"targets are for {len(REQUIRED[op])} shapes: not met without them).")
    return "\n".join(lines) + "\n\n" + "\n".join(verdicts) + "\n"


def problem(files: Sequence[str], per_file: Sequence[tuple[dict[Key, Case], list[str]]],
            tps: Sequence[int] | None, dtype: str) -> str | None:
    """Why the files (``per_file``: :func:`read` of each) give no table with this selection, or None."""
    for path, (cases, others) in zip(files, per_file, strict=True):
        if not cases:
            return (f"{path}: no {', '.join(list(TARGETS)[:-1])} or {list(TARGETS)[-1]} records (expected a "
                    f"file of python -m jax_ub.bench "
                    f"ag|rs|bulk; got " + (f"records of {', '.join(others)})" if others else "no records)"))
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
        return (f"no {dtype} records{' with ' + tp_text if tps else ''} in {names}; {have} dtype "
                f"{listed(k[2] for k in at_tp)}{' there' if tps else ''} (--dtype chooses)")
    if not any(set(NEEDED) <= cases[k].ms.keys() for k in chosen):
        k = chosen[0]
        missing = [i for i in NEEDED if i not in cases[k].ms]
        return (f"no {dtype} case{' with ' + tp_text if tps else ''} in {names} has the {', '.join(NEEDED)} "
                f"records a row needs (e.g. {k[0]} tp={k[1]} {k[3]},{k[4]},{k[5]} has no "
                f"{', '.join(missing)}; a run off the CUDA path times no comm_jax_ub)")
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
    print(markdown(load(a.files), tps=a.tp, dtype=a.dtype), end="")
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("summary", help="bench JSON files against jax_ub's performance targets "
                       "(speedup over XLA, T/T_ideal), as markdown")
    p.add_argument("files", nargs="+", help="ag / rs / bulk JSON files (a later one's case replaces an "
                   "earlier one's whole)")
    p.add_argument("--tp", type=int, action="append", default=None,
                   help="only this tp (repeat for several; default: all)")
    p.add_argument("--dtype", default="bfloat16")
