"""What ``method="auto"`` runs: the fastest method at the nearest *measured* shape (a CUDA
algorithm, or XLA's own collective and dot where that measured faster than every algorithm).

The measurements are ``python -m jax_ub.bench ag|rs`` records (``jax_ub_<method>`` and ``xla_plain`` impls), either
the ones shipped in :mod:`jax_ub._measured` (generated from ``benchmarks/results`` by
``python scripts/measured_table.py benchmarks/results/*-ag.json benchmarks/results/*-rs.json``) or a bench
JSON of your own machine named by ``JAX_UB_TUNING_FILE`` (``config.tuning_file``), whose records
come first. For a call, the candidates are the records of the same op and dtype at the nearest
group size; among those the shape nearest in log distance over global (M, K, N) wins, and its
fastest method is used. No hand-written thresholds: a new measurement changes the choice.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Sequence
from functools import lru_cache

AG, RS = "ag", "rs"
BENCH_OP = {AG: "ag_gemm", RS: "gemm_rs"}
# The methods each op's table may name: the CUDA algorithms (bench impl "jax_ub_<method>"), and
# "xla" (bench impl "xla_plain": XLA's collective, then the dot), last so that a tie goes to the
# overlap: auto runs XLA's own path only where it measured faster than every algorithm.
METHODS = {AG: ("push", "ring", "all_peer", "xla"), RS: ("ring", "pipeline", "chain", "columns", "xla")}
XLA_IMPL = "xla_plain"
FALLBACK = {AG: "push", RS: "ring"}  # no measurement at all for the op
RECORD_KEYS = ("tp", "dtype", "M", "K", "N", "ms")  # what a jax_ub_<method> record must have
# Methods within this factor of the fastest are a tie (run-to-run noise is a few percent), broken
# by the order of METHODS[op].
TIE = 1.02


@dataclasses.dataclass(frozen=True, order=True)
class OpShape:
    """One op (``AG`` or ``RS``) at one global shape (M, K, N), as the bench names it."""
    op: str
    tp: int
    dtype: str
    M: int
    K: int
    N: int

    def dual(self) -> OpShape:
        """The op and shape this op's backward runs (:func:`dual_shape`)."""
        op, M, K, N = dual_shape(self.op, self.M, self.K, self.N)
        return OpShape(op, self.tp, self.dtype, M, K, N)

    def label(self) -> str:
        return f"{self.op} tp{self.tp} {self.dtype} {self.M}x{self.K}x{self.N}"


@dataclasses.dataclass(frozen=True)
class Shape(OpShape):
    """One measured shape: median ms of each method, and where it was measured."""
    ms: tuple[tuple[str, float], ...]  # (method, ms), fastest first
    source: str  # "<machine> <date>"


@dataclasses.dataclass(frozen=True)
class Choice:
    method: str
    why: str


def method_of(impl: str) -> str | None:
    """The method a bench impl times (``jax_ub_<method>``; ``xla_plain`` is ``"xla"``), or None
    for impls that are not a method ``auto`` may run (``jax_ub`` itself, baselines)."""
    if impl == XLA_IMPL:
        return "xla"
    return impl[len("jax_ub_"):] if impl.startswith("jax_ub_") else None


def shapes_from_bench(doc: dict, origin: str = "") -> list[Shape]:
    """The measured shapes of one bench JSON document (``{"machine", "date", "records"}``)."""
    source = f"{doc.get('machine', '?')} {doc.get('date', '?')}" + (f" ({origin})" if origin else "")
    ops = {v: k for k, v in BENCH_OP.items()}
    where = repr(origin) if origin else f"bench document {source!r}"
    groups: dict[tuple, dict[str, float]] = {}
    for i, r in enumerate(doc.get("records", [])):
        op = ops.get(r.get("op"))
        impl = str(r.get("impl", ""))
        method = method_of(impl)
        if op is None or method is None:
            continue
        missing = [k for k in RECORD_KEYS if k not in r]
        if missing:
            raise ValueError(f"{where}: record {i} ({r['op']} {impl}) has no "
                             f"{', '.join(map(repr, missing))}; a bench record needs {RECORD_KEYS}")
        ms = r["ms"]
        if method not in METHODS[op] or not isinstance(ms, (int, float)) or not ms > 0:
            continue
        try:
            key = (op, int(r["tp"]), str(r["dtype"]), int(r["M"]), int(r["K"]), int(r["N"]))
        except (TypeError, ValueError):
            raise ValueError(f"{where}: record {i} ({r['op']} {impl}): tp, M, K, N must be integers; got "
                             f"{[r[k] for k in ('tp', 'M', 'K', 'N')]}") from None
        groups.setdefault(key, {})[method] = float(ms)
    return [Shape(*key, tuple(sorted(m.items(), key=lambda kv: kv[1])), source)
            for key, m in sorted(groups.items()) if len(m) >= 2]


def load_bench_file(path: str) -> list[Shape]:
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"JAX_UB_TUNING_FILE {path!r}: cannot read a bench JSON: {e}") from None
    try:
        shapes = shapes_from_bench(doc, origin=path)
    except ValueError as e:
        raise ValueError(f"JAX_UB_TUNING_FILE {e}") from None
    if not shapes:
        raise ValueError(f"JAX_UB_TUNING_FILE {path!r} has no ag_gemm/gemm_rs records with two or "
                         f"more methods (jax_ub_<method> or xla_plain impls) per shape (write one with "
                         f"`python -m jax_ub.bench ag|rs --out DIR`)")
    return shapes


@lru_cache(maxsize=8)
def _tables(tuning_file: str) -> tuple[tuple[Shape, ...], tuple[Shape, ...]]:
    from jax_ub import _measured

    own = tuple(load_bench_file(tuning_file)) if tuning_file else ()
    shipped = tuple(s for doc in _measured.DOCS for s in shapes_from_bench(doc))
    return own, shipped


def global_shape(op: str, tp: int, x_shape: Sequence[int], w_shape: Sequence[int]) -> tuple[int, int, int]:
    """Global (M, K, N) of one call from its local shards, as the bench names them: AG
    x[M/tp, K] @ w[K, N/tp]; RS x[M, K/tp] @ w[K/tp, N] (M counts the rows over all leading dims)."""
    rows = math.prod(x_shape[:-1])
    if op == AG:
        return rows * tp, int(x_shape[-1]), int(w_shape[-1]) * tp
    return rows, int(x_shape[-1]) * tp, int(w_shape[-1])


def dual_shape(op: str, M: int, K: int, N: int) -> tuple[str, int, int, int]:
    """The op and global shape the backward of one call of ``op`` at (M, K, N) runs: the dual op
    on (dy, wᵀ), i.e. at (M, N, K) (AG's dgrad is a GEMM->RS of dy[M, N/tp] @ wᵀ[N/tp, K]; RS's
    is an AG->GEMM of dy[M/tp, N] @ wᵀ[N, K/tp])."""
    return (RS if op == AG else AG), M, N, K


def _distance(s: Shape, M: int, K: int, N: int) -> float:
    return sum(abs(math.log(a / b)) for a, b in ((s.M, M), (s.K, K), (s.N, N)))


def pick(shapes: Iterable[Shape], op: str, tp: int, dtype: str, M: int, K: int, N: int,
         ) -> Shape | None:
    """The measured shape a call of global (M, K, N) is judged by: same op and dtype (else any
    dtype), the nearest group size, then the nearest shape, then the most methods compared."""
    cands = [s for s in shapes if s.op == op]
    same_dtype = [s for s in cands if s.dtype == dtype]
    cands = same_dtype or cands
    if not cands:
        return None
    near_tp = min(abs(math.log(s.tp / tp)) for s in cands)
    cands = [s for s in cands if abs(math.log(s.tp / tp)) == near_tp]
    # Equally near (the same shape measured on two machines): the one that compared more methods.
    return min(cands, key=lambda s: (_distance(s, M, K, N), -len(s.ms), s.source))


def choose(op: str, tp: int, dtype: str, M: int, K: int, N: int, tuning_file: str = "") -> Choice:
    """The method for one call of global shape (M, K, N) over ``tp`` ranks, and why."""
    own, shipped = _tables(tuning_file)
    for table, label in ((own, "your tuning file"), (shipped, "jax_ub's measurements")):
        s = pick(table, op, tp, dtype, M, K, N)
        if s is None:
            continue
        times = ", ".join(f"{m} {ms:.3f}" for m, ms in s.ms)
        tied = [m for m, ms in s.ms if ms <= s.ms[0][1] * TIE]
        method = min(tied, key=METHODS[op].index)
        return Choice(method, f"nearest measured shape tp{s.tp} {s.dtype} {s.M}x{s.K}x{s.N}: "
                              f"{times} ms ({s.source}, {label}; within {TIE - 1:.0%} is a tie, "
                              f"broken in the order {', '.join(METHODS[op])})")
    return Choice(FALLBACK[op], f"no measurement of {op} in the tables: default")


def render(docs: Sequence[dict]) -> str:
    """The source of jax_ub/_measured.py for these bench documents (only what choose() reads)."""
    lines = ['"""Bench records method="auto" chooses from. Generated by `python scripts/measured_table.py '
             'benchmarks/results/*-ag.json benchmarks/results/*-rs.json`; do not edit."""', "",
             "DOCS = ["]
    for d in docs:
        recs = [r for r in d.get("records", []) if r.get("op") in BENCH_OP.values()
                and (str(r.get("impl", "")).startswith("jax_ub_") or r.get("impl") == XLA_IMPL)]
        if not recs:
            continue
        lines.append(f"    {{'machine': {d.get('machine')!r}, 'date': {d.get('date')!r}, 'records': [")
        for r in recs:
            kv = ", ".join(f"{k!r}: {r[k]!r}" for k in ("op", "tp", "dtype", "M", "K", "N", "impl", "ms"))
            lines.append(f"        {{{kv}}},")
        lines.append("    ]},")
    lines.append("]")
    return "\n".join(lines) + "\n"
