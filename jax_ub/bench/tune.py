"""``python -m jax_ub.bench tune SHAPES.json ...`` — measure every method at the shapes your program
recorded (:mod:`jax_ub.tuning`) and write a tuning file for ``JAX_UB_TUNING_FILE``.

For each recorded (op, tp, dtype, M, K, N), in one process, as ``bench ag|rs`` times them:
``xla_plain`` (XLA's collective, then the dot), ``jax_ub`` (``method="auto"`` as configured now:
the shipped records, or the tuning file already set) and ``jax_ub_<method>`` for every CUDA
algorithm of the op (``--full``: also the GEMM and collectives alone and XLA's windowed einsum),
each op 8 times in a row per dispatch (``--chain``, default 8: a lone dispatch of a small op is
bound by the host, a model's step is not, and a host-bound time would choose wrongly). A method
whose output is not ``xla_plain``'s (:class:`jax_ub.bench.harness.Check`) gets no time, so ``auto``
never chooses it from this file. Each shape runs in the dtype it was recorded with. Several shapes
files (one per process of a multi-process run) are measured together: a shape in several files is
measured once, at the most calls any one file counted.

Writes ``<out>/<machine>-<yyyymmdd>-tune.json`` in the bench record format, both ops in one file,
with the GPU model and jax_ub version it was measured with; an existing file of that name (an
earlier tune on the same machine and day, perhaps of another model) is kept unless ``--force``:
the run stops before timing anything. It then prints per shape what ``auto`` ran before, the
fastest method, and what ``auto`` chooses with the new file (read back from it). A shape seen
both as a forward op and as another op's backward is measured once.

It needs the CUDA path: off it (CPU, ``JAX_UB_DISABLE=1``) there is no method to compare, so it
exits 2 before timing anything, as it does for an invalid configuration or a ``JAX_UB_TUNING_FILE``
that ``auto`` cannot read (the "auto before" column would fail). A run whose times would not make
a file ``JAX_UB_TUNING_FILE`` accepts (no shape with two or more methods timed, e.g. every method
failed) writes nothing and exits 1, saying why.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
from typing import Any

from jax_ub import choice, tuning

CORE_IMPLS = ("xla_plain", "jax_ub")  # besides every jax_ub_<method>


@dataclasses.dataclass
class Case:
    """One shape to measure: the roles it was recorded in and the calls traced at it."""

    shape: tuning.OpShape
    roles: list[str]
    calls: int


def merge(files: list[list[tuple[tuning.OpShape, str, int]]]) -> list[tuple[tuning.OpShape, str, int]]:
    """The entries of several shapes files as one: each (shape, role) once, first-seen order, with
    the most calls one file counted (every process of an SPMD program traces the same calls)."""
    out: dict[tuple[tuning.OpShape, str], int] = {}
    for entries in files:
        for shape, role, calls in entries:
            out[(shape, role)] = max(out.get((shape, role), 0), calls)
    return [(shape, role, calls) for (shape, role), calls in out.items()]


def cases(entries: list[tuple[tuning.OpShape, str, int]], forward_only: bool) -> list[Case]:
    """The recorded entries merged per shape (first-seen order), forward ones only if asked."""
    out: dict[tuning.OpShape, Case] = {}
    for shape, role, calls in entries:
        if forward_only and role != "forward":
            continue
        c = out.setdefault(shape, Case(shape, [], 0))
        if role not in c.roles:
            c.roles.append(role)
        c.calls += calls
    return list(out.values())


def keep_impl(name: str, full: bool) -> bool:
    return full or name in CORE_IMPLS or name.startswith("jax_ub_")


def best(res: dict[str, float]) -> tuple[str, float] | None:
    """The fastest of the methods ``auto`` may run (``jax_ub_<method>``, ``xla_plain`` as "xla")."""
    cands = {m: v for k, v in res.items() if (m := choice.method_of(k)) is not None}
    return min(cands.items(), key=lambda kv: kv[1]) if cands else None


def _fail(msg: str, rc: int = 2) -> int:
    print(f"error: {msg}", file=sys.stderr, flush=True)
    return rc


def run(a: argparse.Namespace) -> int:
    import jax

    import jax_ub
    from jax_ub import config
    from jax_ub.bench import agrs
    from jax_ub.bench import harness as h

    files = [a.shapes_file] if isinstance(a.shapes_file, str) else list(a.shapes_file)
    try:
        entries = merge([tuning.load(f) for f in files])
    except ValueError as e:
        return _fail(str(e))
    names = ", ".join(map(repr, files))
    todo = cases(entries, a.forward_only)
    if not todo:
        return _fail(
            f"{names} {'has' if len(files) == 1 else 'have'} no shapes to measure"
            + (" (--forward-only dropped the backward ones)" if entries else "")
        )
    # What would stop the run after the first shape's timing, checked before timing anything.
    try:
        cfg = config.get()
    except ValueError as e:
        return _fail(f"invalid jax_ub configuration: {e}")
    if cfg.tuning_file:
        try:
            choice.check_bench_file(cfg.tuning_file)
        except ValueError as e:
            return _fail(
                f'{e}; bench tune times auto as configured (the "auto before" column), so '
                f"fix that file or unset JAX_UB_TUNING_FILE; nothing measured"
            )
    target = os.path.join(a.out, f"{a.machine}-{a.date}-tune.json")
    if os.path.exists(target) and not getattr(a, "force", False):
        return _fail(
            f"{target!r} exists (an earlier tune on this machine today; a job may be using it as "
            f"its JAX_UB_TUNING_FILE): --force replaces it, --out DIR writes elsewhere; nothing "
            f"measured"
        )
    cuda, path = h.path_info()
    print(path)
    # The first reason, checked before the device count: without CUDA no device count would do.
    if not cuda:  # only xla_plain and jax_ub (auto runs the reference) could be timed: no choice
        print(
            f"error: nothing to tune on this machine: a tuning file needs the times of the "
            f"jax_ub_<method> impls, which need the CUDA path ({path}); run bench tune on the GPU "
            f"machine the program runs on (recording the shapes, JAX_UB_RECORD_SHAPES, works "
            f"anywhere); no file written",
            file=sys.stderr,
            flush=True,
        )
        return 2
    ndev = len(jax.devices())
    groups: dict[int, list[Case]] = {}
    for tp in sorted({c.shape.tp for c in todo}):
        group = [c for c in todo if c.shape.tp == tp]
        if tp > ndev:  # (tuning.load refuses tp < 2)
            h.progress(f"skip {len(group)} shape(s) at tp={tp}: only {ndev} devices")
            continue
        groups[tp] = group
    if not groups:
        return _fail(
            f"no shape of {names} can be measured on these {ndev} device(s) (the skip lines "
            f"above say why); run tune where the recorded tp fits"
        )
    stem = h.out_stem(a, "tune")
    records: list[dict[str, Any]] = []
    rows: list[tuple[Case, dict[str, float], str]] = []
    failures: list[tuple[str, str]] = []
    for tp, group in groups.items():
        mesh = h.make_mesh(tp, cuda)
        try:
            for c in group:
                s = c.shape
                impls = {
                    k: v
                    for k, v in agrs.build(s.op, mesh, s.M, s.K, s.N, s.dtype, cuda).items()
                    if keep_impl(k, a.full)
                }
                errs: dict[str, Any] = {}  # a method with a wrong output gets no time: auto never picks it
                res = h.time_impls(
                    f"tune {s.label()} ({'+'.join(c.roles)}, {c.calls} calls)",
                    impls,
                    a,
                    probe=h.Check(s.dtype),
                    probes=errs,
                    failures=failures,
                )
                before = agrs.auto_method(s.op, tp, s.M, s.K, s.N, s.dtype)
                case = h.case_records(
                    {
                        "op": choice.BENCH_OP[s.op],
                        "M": s.M,
                        "K": s.K,
                        "N": s.N,
                        "tp": tp,
                        "dtype": s.dtype,
                        "role": "+".join(c.roles),
                        "calls": c.calls,
                    },
                    res,
                    errs,
                )
                for r in case:
                    if r["impl"] == "jax_ub":
                        r["method"] = before
                records += case
                rows.append((c, res, before))
        finally:
            jax_ub.shutdown()
    if not choice.shapes_from_bench({"records": records}):  # what JAX_UB_TUNING_FILE would refuse
        print(
            "error: nothing usable was measured: a tuning file needs, at some shape, the times of "
            "two or more methods (jax_ub_<method> or xla_plain); got "
            + (f"times of {', '.join(sorted({r['impl'] for r in records}))} only" if records else "no time")
            + (f" ({h.failure_summary(failures)})" if h.failure_summary(failures) else "")
            + "; no file written",
            file=sys.stderr,
            flush=True,
        )
        return 1
    h.write_json(a, stem, records, path=path.split(" ")[1], shapes_files=[os.path.abspath(f) for f in files])
    print(f"\nwrote {stem}.json")
    return report(stem + ".json", rows, path, cuda)


def report(tuning_path: str, rows: list[tuple[Case, dict[str, float], str]], path: str, cuda: bool) -> int:
    """Prints the table and whether the file can serve as ``JAX_UB_TUNING_FILE``; "auto with this
    file" is chosen from the file as written now (not from tables read earlier in the process)."""
    print(
        f"{path}\nop  tp  dtype     M,K,N                 role              calls  auto before (ms)"
        "         fastest (ms)             gain   auto with this file"
    )
    tables = None
    if cuda:
        try:
            tables = choice.Tables(tuple(choice.load_bench_file(tuning_path)), choice.tables().shipped)
        except ValueError as e:  # e.g. every method failed to run
            print(f"(not usable as a tuning file: {e})")
    gains = []
    not_chosen = []  # (shape, fastest method) that auto does not run by the numerics rule
    for c, res, before in rows:
        s = c.shape
        top = best(res)
        now = res.get("jax_ub", float("nan"))
        gain = now / top[1] if top else float("nan")
        if gain == gain:
            gains.append(gain)
        after = "-"
        if tables is not None:
            after = choice.choose(s.op, s.tp, s.dtype, s.M, s.K, s.N, using=tables).method
            if top and top[0] != after and choice.sums_in_dtype(s.op, top[0], s.tp, s.dtype):
                not_chosen.append((s, top[0]))
                after += "*"
        fastest = f"{top[0]} {top[1]:.3f}" if top else "-"
        print(
            f"{s.op}  {s.tp:<3} {s.dtype:<9} {f'{s.M},{s.K},{s.N}':<21} {'+'.join(c.roles):<17} "
            f"{c.calls:<6} {f'{before} {now:.3f}':<24} {fastest:<24} {gain:5.2f}x  {after}"
        )
    if gains and cuda:
        print(
            f"auto before / fastest: median {statistics.median(gains):.2f}x, max {max(gains):.2f}x "
            f"over {len(gains)} shapes (1.00x: auto already ran the fastest)"
        )
    if not_chosen:
        methods = sorted({m for _, m in not_chosen})
        print(
            f"*: {', '.join(methods)} measured fastest there, but sums the partials in the op's dtype "
            f"at tp >= 3 (one rounding per hop; the others sum in fp32), so auto runs the fastest of "
            f"the others; JAX_UB_AUTO_CHAIN=1 lets auto choose it"
        )
    if tables is not None:
        print(f"export JAX_UB_TUNING_FILE={os.path.abspath(tuning_path)}")
    elif not cuda:
        print("no jax_ub_<method> records (they need the CUDA path): nothing for JAX_UB_TUNING_FILE")
    return 0
