"""What ``method="auto"`` runs: the fastest method at the nearest *measured* shape (a CUDA
algorithm, or XLA's own collective and dot where that measured faster than every algorithm).

The measurements are ``python -m jax_ub.bench ag|rs|tune`` records (``jax_ub_<method>`` and
``xla_plain`` impls), either the ones shipped in ``jax_ub/data/measured.json`` (read by
:mod:`jax_ub._measured`, generated from ``benchmarks/records`` by ``python
tools/measured_table.py``) or a bench JSON of your own machine named by ``JAX_UB_TUNING_FILE``
(``config.tuning_file``). For a call of one op at global (M, K, N) over tp ranks in one dtype, the
candidates are, first found:

1. your file's records of that op, tp and dtype;
2. the shipped records of that op, tp and dtype;
3. both tables' records of that op, in that dtype if any has it (else any dtype), at the group
   size nearest to tp (``why`` then says that no tp/dtype measurement exists and what was used).

Among the candidates, the shape nearest in log distance over (M, K, N) wins (then yours, then the
record that compared more methods, then the newest date), and its fastest method runs (within
``TIE`` of the fastest: the first in ``METHODS[op]``). No hand-written thresholds: a new
measurement changes the choice.

One numerics rule restricts the methods: ``chain`` passes partial sums from rank to rank in the
op's dtype, so at tp >= 3 in bfloat16/float16 they are rounded once per hop, where every other
method sums the partials in fp32. ``auto`` chooses it there only with ``config.auto_chain``
(``JAX_UB_AUTO_CHAIN=1``); at tp=2 (one hop, rounded like ``ring``) and in float32 it is a
candidate like the others.

Every process of a launch must choose alike: ``jax_ub.initialize`` (where it creates
communicators) agrees on :func:`propose`'s value, a digest of the parsed tables and the rules, and
``choose`` then reads the tables it agreed on (:func:`adopt`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import re
import sys
import threading
from collections.abc import Iterable, Sequence
from functools import lru_cache
from typing import Any

from jax_ub import methods

_log = logging.getLogger("jax_ub")

AG, RS = methods.AG, methods.RS
BENCH_OP = {AG: "ag_gemm", RS: "gemm_rs"}
# The methods each op's table may name: the CUDA algorithms (bench impl "jax_ub_<method>"), and
# "xla" (bench impl "xla_plain": XLA's collective, then the dot), last so that a tie goes to the
# overlap: auto runs XLA's own path only where it measured faster than every algorithm.
METHODS = methods.AUTO_CANDIDATES
XLA_IMPL = "xla_plain"
# Bench impls of runs older than the method they time: runs up to 2026-11-28 timed push_merge as
# "variant_push_merge" (push traced with JAX_UB_AG_PUSH_MERGE=1, no pieces at the bench shapes:
# the same program).
LEGACY_IMPLS = {"variant_push_merge": methods.PUSH_MERGE}
PUSH_MERGE_MIN_TP = methods.PUSH_MERGE_MIN_TP
FALLBACK = methods.DEFAULT  # no measurement at all for the op
RECORD_KEYS = ("tp", "dtype", "M", "K", "N", "ms")  # what a jax_ub_<method> record must have
DTYPES = ("bfloat16", "float16", "float32")  # the dtypes jax_ub's ops take
# Methods within this factor of the fastest are a tie (run-to-run noise is a few percent), broken
# by the order of METHODS[op]: docs/performance.md#tie
TIE = 1.02
# A measurement whose M, K or N differs from the call's by more than this factor is "far": ``why``
# says so (the choice is still the nearest measurement's).
FAR = 4.0
# Methods that sum partials in the op's dtype, one rounding per hop, at tp >= 3 (see the module
# docstring): auto skips them there for narrower dtypes than float32 unless config.auto_chain.
DTYPE_SUMS = methods.DTYPE_SUMS
sums_in_dtype = methods.sums_in_dtype
SHAPES_FORMAT = "jax_ub_shapes"  # the key of a shapes file (jax_ub.tuning.FORMAT)


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
    machine: str = "?"
    date: str = "?"
    origin: str = ""  # the file it was read from ("" for the shipped table)

    @property
    def source(self) -> str:
        """``"<machine> <date>"``, with `` (<file>)`` for a file's record."""
        return f"{self.machine} {self.date}" + (f" ({self.origin})" if self.origin else "")

    def key(self) -> tuple:
        """What the choice depends on (not the file name: ranks may name one file differently)."""
        return (self.op, self.tp, self.dtype, self.M, self.K, self.N, self.ms, self.machine, self.date)


@dataclasses.dataclass(frozen=True)
class Choice:
    method: str
    why: str


@dataclasses.dataclass(frozen=True)
class Tables:
    """What ``choose`` reads: your tuning file's shapes (``own``) and the shipped ones."""

    own: tuple[Shape, ...]
    shipped: tuple[Shape, ...]

    def digest(self, auto_chain: bool) -> str:
        """sha256 (16 hex digits) of everything a choice depends on: both tables, the rules
        (``TIE``, ``METHODS``, ``FALLBACK``, ``DTYPE_SUMS``) and ``auto_chain``."""
        blob = json.dumps(
            [
                TIE,
                METHODS,
                FALLBACK,
                DTYPE_SUMS,
                auto_chain,
                [s.key() for s in self.own],
                [s.key() for s in self.shipped],
            ]
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def method_of(impl: str) -> str | None:
    """The method a bench impl times (``jax_ub_<method>``; ``xla_plain`` is ``"xla"``), or None
    for impls that are not a method ``auto`` may run (``jax_ub`` itself, baselines)."""
    if impl == XLA_IMPL:
        return methods.XLA
    if impl in LEGACY_IMPLS:
        return LEGACY_IMPLS[impl]
    return impl[len("jax_ub_") :] if impl.startswith("jax_ub_") else None


def _positive_int(v: Any) -> int | None:
    """``v`` as an int if it is a positive integer (a JSON integer, or a float with no fraction)."""
    if isinstance(v, bool):
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    return v if isinstance(v, int) and v > 0 else None


def dtype_name(v: Any) -> str | None:
    """The canonical name of dtype ``v`` (``"bf16"`` is not one: numpy's names) if it is one of
    ``DTYPES``, else None."""
    import jax.numpy as jnp

    try:
        name = jnp.dtype(v).name if isinstance(v, str) else None
    except (TypeError, ValueError):
        return None
    return name if name in DTYPES else None


def _json_type(v: Any) -> str:
    """``v``'s type as JSON names it."""
    for kind, name in (
        (bool, "true/false"),
        (dict, "object"),
        (list, "array"),
        (str, "string"),
        ((int, float), "number"),
    ):
        if isinstance(v, kind):
            return name
    return "null" if v is None else type(v).__name__


def _brief(v: Any) -> str:
    """``v``'s JSON for a message, at most 80 characters (its JSON type where it has none)."""
    try:
        text = json.dumps(v)
    except (RecursionError, ValueError, TypeError):
        return f"a JSON {_json_type(v)}"
    return text if len(text) <= 80 else text[:77] + "..."


MAX_DIM = 2**63 - 1  # larger sizes are no shape; their ratios would overflow a float


def _parse(doc: Any, origin: str = "") -> tuple[list[Shape], list[str]]:
    """(measured shapes, methods named by records that this jax_ub does not know) of one bench
    JSON document. A ValueError names the document, the record, the field, what was expected and
    what it holds."""
    where = repr(origin) if origin else "bench document"
    if not isinstance(doc, dict):
        raise ValueError(
            f'{where}: a bench JSON must be an object {{"machine", "date", "records": '
            f"[...]}}; got a JSON {_json_type(doc)}"
        )
    if SHAPES_FORMAT in doc:
        raise ValueError(
            f"{where} is a shapes file (the shapes a program ran, jax_ub.tuning), not "
            f"measurements: measure them with `python -m jax_ub.bench tune {origin or 'FILE'}` "
            f"and use the file that writes"
        )
    records = doc.get("records")
    if not isinstance(records, list):
        raise ValueError(
            f"{where}: 'records' must be a list of bench records; got "
            + ("no 'records'" if "records" not in doc else f"a JSON {_json_type(records)}")
        )
    machine, date = str(doc.get("machine", "?")), str(doc.get("date", "?"))
    ops = {v: k for k, v in BENCH_OP.items()}
    groups: dict[tuple[str, int, str, int, int, int], dict[str, float]] = {}
    unknown: set[str] = set()
    for i, r in enumerate(records):
        if not isinstance(r, dict):
            raise ValueError(f"{where}: record {i} must be an object; got {_brief(r)}")
        op = ops.get(r["op"]) if isinstance(r.get("op"), str) else None
        impl = str(r.get("impl", ""))
        method = method_of(impl)
        if op is None or method is None:
            continue  # another bench op, or a baseline: not a method auto may run
        rec = f"{where}: record {i} ({r['op']} {impl})"
        missing = [k for k in RECORD_KEYS if k not in r]
        if missing:
            raise ValueError(
                f"{rec} has no {', '.join(map(repr, missing))}; a bench record needs {RECORD_KEYS}"
            )
        dims: dict[str, int] = {}
        for k in ("tp", "M", "K", "N"):
            dim = _positive_int(r[k])
            if dim is None:
                raise ValueError(f"{rec}: {k} must be a positive integer; got {r[k]!r}")
            if dim > MAX_DIM:
                raise ValueError(f"{rec}: {k} must be at most 2**63 - 1; got {_brief(r[k])}")
            dims[k] = dim
        dtype = dtype_name(r["dtype"])
        if dtype is None:
            raise ValueError(f"{rec}: dtype must be one of {', '.join(DTYPES)}; got {r['dtype']!r}")
        ms = r["ms"]
        if isinstance(ms, bool) or not isinstance(ms, (int, float)):
            raise ValueError(f"{rec}: ms must be a number (median milliseconds); got {ms!r}")
        try:
            ms = float(ms)
        except OverflowError:
            raise ValueError(
                f"{rec}: ms must be a number of milliseconds a float can hold; got {_brief(r['ms'])}"
            ) from None
        if method not in METHODS[op]:
            unknown.add(f"{op} {method}")
            continue
        if method == methods.PUSH_MERGE and dims["tp"] < PUSH_MERGE_MIN_TP:
            continue  # push's program, timed a second time
        if not (math.isfinite(ms) and ms > 0):
            continue  # not measured
        key = (op, dims["tp"], dtype, dims["M"], dims["K"], dims["N"])
        groups.setdefault(key, {})[method] = ms
    shapes = [
        Shape(*key, tuple(sorted(m.items(), key=lambda kv: kv[1])), machine, date, origin)
        for key, m in sorted(groups.items())
        if len(m) >= 2
    ]
    return shapes, sorted(unknown)


def shapes_from_bench(doc: Any, origin: str = "") -> list[Shape]:
    """The measured shapes of one bench JSON document (``{"machine", "date", "records"}``)."""
    return _parse(doc, origin)[0]


def _local_device_kind() -> str | None:
    """This process's GPU model as the bench names machines (``NVIDIA_H200``), or None off GPUs."""
    try:
        import jax

        d = jax.devices()[0]
        return d.device_kind.replace(" ", "_") if d.platform == "gpu" else None
    except Exception:  # no backend: nothing to compare with
        return None


def _provenance(doc: dict, path: str, unknown: Sequence[str]) -> list[str]:
    """Why a tuning file may not describe this process: another GPU model, another jax_ub version,
    methods this jax_ub does not know."""
    from jax_ub import __version__

    notes = []
    kind = doc.get("device_kind")
    kind = str(kind).replace(" ", "_") if kind else None
    if kind is None:  # older files: "<n>x<device kind>" unless --machine named it otherwise
        m = re.fullmatch(r"\d+x(.+)", str(doc.get("machine", "")))
        kind = m.group(1) if m else None
    local = _local_device_kind()
    if kind and local and kind != local:
        notes.append(
            f"measured on {kind} GPUs, and this process runs on {local}: its times may not "
            f"hold here (run `python -m jax_ub.bench tune` on these GPUs)"
        )
    version = doc.get("jax_ub")
    if version is not None and str(version) != __version__:
        notes.append(
            f"written by jax_ub {version}, and this is jax_ub {__version__}: the methods' "
            f"times may have changed since (run `python -m jax_ub.bench tune` again)"
        )
    if unknown:
        notes.append(f"records of methods this jax_ub does not know are ignored: {', '.join(unknown)}")
    return notes


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"JAX_UB_TUNING_FILE {path!r}: cannot read a bench JSON: {e}") from None


def _check(path: str, data: bytes) -> tuple[list[Shape], list[str]]:
    try:
        doc = json.loads(data)
    except ValueError as e:
        raise ValueError(f"JAX_UB_TUNING_FILE {path!r}: cannot read a bench JSON: {e}") from None
    except RecursionError:
        raise ValueError(
            f"JAX_UB_TUNING_FILE {path!r}: cannot read a bench JSON: its arrays/objects "
            f"nest deeper than Python's recursion limit ({sys.getrecursionlimit()})"
        ) from None
    try:
        shapes, unknown = _parse(doc, origin=path)
    except ValueError as e:
        raise ValueError(f"JAX_UB_TUNING_FILE {e}") from None
    if not shapes:
        raise ValueError(
            f"JAX_UB_TUNING_FILE {path!r} has no ag_gemm/gemm_rs records with two or "
            f"more methods (jax_ub_<method> or xla_plain impls) per shape (write one with "
            f"`python -m jax_ub.bench tune SHAPES.json`, or `python -m jax_ub.bench ag|rs`)"
        )
    return shapes, _provenance(doc, path, unknown)


def check_bench_file(path: str) -> tuple[list[Shape], list[str]]:
    """(shapes ``auto`` would read from the bench JSON at ``path``, notes on why it may not describe
    this process). A ValueError starting ``JAX_UB_TUNING_FILE '<path>'`` says what is wrong."""
    return _check(path, _read(path))


def load_bench_file(path: str) -> list[Shape]:
    """The shapes ``auto`` reads from the bench JSON at ``path``; each note of
    :func:`check_bench_file` is logged as a WARNING."""
    shapes, notes = check_bench_file(path)
    for note in notes:
        _log.warning("jax_ub: JAX_UB_TUNING_FILE %r: %s", path, note)
    return shapes


# ------------------------------------------------------------------------------------------------
# The tables, and the ones the processes agreed on


@lru_cache(maxsize=8)
def _own(path: str, data: bytes) -> tuple[Shape, ...]:
    """The shapes of one content of ``path`` (keyed by its bytes: a rewrite is read again, however
    soon after the last read; the notes are logged once per content)."""
    shapes, notes = _check(path, data)
    for note in notes:
        _log.warning("jax_ub: JAX_UB_TUNING_FILE %r: %s", path, note)
    return tuple(shapes)


@lru_cache(maxsize=1)
def _shipped() -> tuple[Shape, ...]:
    from jax_ub import _measured

    return tuple(s for doc in _measured.DOCS for s in shapes_from_bench(doc))


def tables(tuning_file: str = "") -> Tables:
    """The tables as they are now: ``tuning_file``'s content (read again whenever it changed)
    and the shipped records."""
    own = _own(tuning_file, _read(tuning_file)) if tuning_file else ()
    return Tables(own, _shipped())


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


_agreed: dict[str, tuple[str, Tables]] = {}  # tuning file -> (sha256 of its bytes, tables)
_agreed_lock = threading.Lock()
_warned_changed: set[tuple[str, str]] = set()


@dataclasses.dataclass(frozen=True)
class Agreement:
    """One process's side of the tables agreement (:func:`propose`).

    ``value`` is what the processes compare: the digest of the tables (:meth:`Tables.digest`),
    ``"unreadable file"`` or ``"unusable file, sha256 ..."`` (processes with the same broken file
    agree; the first op ``auto`` runs raises the error). ``note`` says what this process read
    (the file's path, why it cannot be used): for the message when the values differ, never
    compared (processes may name one file by different paths)."""

    value: str
    note: str
    tuning_file: str
    sha: str = ""
    tables: Tables | None = None  # None: the file cannot be used


def propose(tuning_file: str, auto_chain: bool) -> Agreement:
    """What this process brings to the agreement on the tables ``auto`` chooses from; nothing
    changes until :func:`adopt` (called once every process agreed)."""
    shipped = _shipped()
    digest = Tables((), shipped).digest(auto_chain)
    ship = f"jax_ub/data/measured.json ({len(shipped)} shapes, digest {digest})"
    if not tuning_file:
        t = Tables((), shipped)
        return Agreement(t.digest(auto_chain), f"no JAX_UB_TUNING_FILE; {ship}", "", "", t)
    try:
        data = _read(tuning_file)
    except ValueError as e:
        return Agreement("unreadable file", str(e), tuning_file)
    try:
        t = Tables(_own(tuning_file, data), shipped)
    except ValueError as e:
        first = str(e).splitlines()[0]
        return Agreement(
            f"unusable file, sha256 {_sha(data)}",
            f"{first} (file sha256 {_sha(data)})",
            tuning_file,
            _sha(data),
        )
    note = (
        f"JAX_UB_TUNING_FILE {tuning_file!r} ({len(t.own)} measured shapes, file sha256 {_sha(data)}); {ship}"
    )
    return Agreement(t.digest(auto_chain), note, tuning_file, _sha(data), t)


def adopt(a: Agreement) -> None:
    """From now on :func:`choose` reads ``a``'s tables for its file, even if the file changes (it
    logs a WARNING once if it does). Where the file could not be used, tables agreed earlier are
    dropped: ``choose`` reads the file again and raises its error."""
    with _agreed_lock:
        if a.tables is None:
            _agreed.pop(a.tuning_file, None)
        else:
            _agreed[a.tuning_file] = (a.sha, a.tables)


def agreement(tuning_file: str, auto_chain: bool) -> str:
    """:func:`propose` then :func:`adopt` (one process: nothing to agree with); the value."""
    a = propose(tuning_file, auto_chain)
    adopt(a)
    return a.value


def _current(tuning_file: str) -> Tables:
    """The tables ``choose`` reads for ``tuning_file``: the ones agreed at initialize if any."""
    with _agreed_lock:
        agreed = _agreed.get(tuning_file)
    if agreed is None:
        return tables(tuning_file)
    sha, t = agreed
    if tuning_file:
        try:
            now = _sha(_read(tuning_file))
        except ValueError:
            now = "unreadable"
        if now != sha and (tuning_file, now) not in _warned_changed:
            _warned_changed.add((tuning_file, now))
            _log.warning(
                "jax_ub: JAX_UB_TUNING_FILE %r changed since jax_ub.initialize: auto keeps "
                "choosing from the content every process agreed on then (initialize again "
                "to read the new one)",
                tuning_file,
            )
    return t


def _forget_agreed() -> None:
    """Drops the agreed tables (tests)."""
    with _agreed_lock:
        _agreed.clear()
    _warned_changed.clear()


# ------------------------------------------------------------------------------------------------
# The choice


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


def _nearest(cands: Sequence[Shape], M: int, K: int, N: int) -> Shape:
    """The nearest shape; of equally near ones (one shape measured twice), one of your file (the
    shipped records have no ``origin``), then the one that compared more methods, then the newest
    date, then the first machine by name (not the order of the files, which says nothing)."""
    ordered = sorted(cands, key=lambda s: s.machine)
    ordered.sort(key=lambda s: s.date, reverse=True)
    return min(ordered, key=lambda s: (_distance(s, M, K, N), not s.origin, -len(s.ms)))


def pick(
    shapes: Iterable[Shape],
    op: str,
    tp: int,
    dtype: str,
    M: int,
    K: int,
    N: int,
) -> Shape | None:
    """The measured shape of one table a call of global (M, K, N) is judged by: same op and dtype
    (else any dtype), the nearest group size, then :func:`_nearest`."""
    cands = [s for s in shapes if s.op == op]
    cands = [s for s in cands if s.dtype == dtype] or cands
    if not cands:
        return None
    near_tp = min(abs(math.log(s.tp / tp)) for s in cands)
    return _nearest([s for s in cands if abs(math.log(s.tp / tp)) == near_tp], M, K, N)


def choose(
    op: str,
    tp: int,
    dtype: str,
    M: int,
    K: int,
    N: int,
    tuning_file: str = "",
    *,
    using: Tables | None = None,
    auto_chain: bool | None = None,
) -> Choice:
    """The method for one call of global shape (M, K, N) over ``tp`` ranks, and why.

    ``using``: these tables instead of those of ``tuning_file`` (the ones agreed at initialize,
    else read now); ``auto_chain``: ``config.get().auto_chain`` unless given."""
    if auto_chain is None:
        from jax_ub import config

        auto_chain = config.get().auto_chain
    t = using if using is not None else _current(tuning_file)
    s, notes = None, []
    for table in (t.own, t.shipped):
        hits = [x for x in table if (x.op, x.tp, x.dtype) == (op, tp, dtype)]
        if hits:
            s = _nearest(hits, M, K, N)
            break
        if table is t.own and any(x.op == op for x in t.own):
            notes.append(f"your tuning file has no {op} tp{tp} {dtype} measurement")
    if s is None:
        s = pick(t.own + t.shipped, op, tp, dtype, M, K, N)
        if s is None:
            return Choice(FALLBACK[op], f"no measurement of {op} in the tables: default")
        used = " ".join(
            w for w, differs in ((f"tp{s.tp}", s.tp != tp), (s.dtype, s.dtype != dtype)) if differs
        )
        notes = [f"no {op} tp{tp} {dtype} measurement in the tables: the nearest {used}"]
    far, dim = max((max(a / b, b / a), d) for d, a, b in (("M", s.M, M), ("K", s.K, K), ("N", s.N, N)))
    if far > FAR:
        notes.append(f"the nearest measurement is far from this call ({dim} {far:.0f}x)")

    def fastest(ms: Sequence[tuple[str, float]]) -> str:
        return min((m for m, t_ in ms if t_ <= ms[0][1] * TIE), key=METHODS[op].index)

    allowed = [(m, ms) for m, ms in s.ms if auto_chain or not sums_in_dtype(op, m, tp, dtype)]
    method, unrestricted = fastest(allowed), fastest(s.ms)
    if method != unrestricted:
        notes.append(
            f"not {unrestricted}: it sums the partials in {dtype} at tp={tp}, one rounding "
            f"per hop, where the others sum in fp32 (JAX_UB_AUTO_CHAIN=1 allows it)"
        )
    elif sums_in_dtype(op, method, tp, dtype):
        notes.append(
            f"{method} sums the partials in {dtype} at tp={tp}, one rounding per hop "
            f"(allowed by JAX_UB_AUTO_CHAIN=1)"
        )
    times = ", ".join(f"{m} {ms:.3f}" for m, ms in s.ms)
    label = "your tuning file" if s.origin else "jax_ub's measurements"
    return Choice(
        method,
        f"nearest measured shape tp{s.tp} {s.dtype} {s.M}x{s.K}x{s.N}: "
        f"{times} ms ({s.source}, {label}; within {TIE - 1:.0%} is a tie, "
        f"broken in the order {', '.join(METHODS[op])})" + "".join(f"; {n}" for n in notes),
    )
