"""``jax_ub.overlap_tp(f)``: adopt jax_ub's overlap in existing code without rewriting it.

``f`` is any JAX function whose ``jax.shard_map`` body multiplies a gathered activation or
scatters a product::

    y = lax.all_gather(x, "tp", axis=1, tiled=True) @ w          # -> all_gather_matmul
    z = lax.psum_scatter(h @ w2, "tp", scatter_dimension=1, tiled=True)   # -> matmul_reduce_scatter

(``jnp.einsum``/``lax.dot_general`` forms included: a dot that contracts the activation's last dim
with one dim of a 2-D weight). ``overlap_tp(f)`` returns a function with ``f``'s signature that
computes the same values, with the same gradients, running :func:`jax_ub.all_gather_matmul` and
:func:`jax_ub.matmul_reduce_scatter` at those sites; :meth:`OverlapTP.report` says what it replaced
and what it left alone, and why.

How: ``f`` is traced to a jaxpr (once per argument signature); each jaxpr, recursing into
``shard_map``, ``jit``, ``jax.checkpoint``, ``custom_jvp`` and ``lax.scan`` bodies, is searched for
``all_gather → dot_general`` and ``dot_general → reduce_scatter`` pairs on one mesh axis whose
intermediate value has no other use; the jaxpr is then evaluated equation by equation (under
``jax.jit``), each pair replaced by the jax_ub op and every other equation bound as traced. Other
higher-order primitives (``cond``, ``while``, ``custom_vjp``) are bound unchanged: their sites are
reported as left alone. A ``custom_jvp`` function holding a site is inlined, so its own derivative
rule gives way to the jax_ub op's (the report says so).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.extend import core as jcore

from jax_ub import _validate, ops

AG, RS = "ag", "rs"
_GATHER, _SCATTER, _DOT = "all_gather", "reduce_scatter", "dot_general"
# Containers whose bodies are rewritten (each rebuilt by _eval_eqn); any other primitive with a
# sub-jaxpr is bound as traced.
_INLINED = ("jit", "pjit", "closed_call", "core_call", "custom_jvp_call")
_REBUILT = ("shard_map", "checkpoint", "remat", "remat2", "scan")


@dataclasses.dataclass(frozen=True)
class Site:
    """One all-gather or reduce-scatter of the traced function: ``op`` ``"ag"``/``"rs"``,
    ``where`` the nesting (``"shard_map > scan"``), ``axis_name``, the operand shapes, whether it
    was ``replaced`` and ``why`` (what it became, or why not), and ``source`` (file:line)."""

    op: str
    where: str
    axis_name: Any
    shapes: str
    replaced: bool
    why: str
    source: str = ""

    def __str__(self) -> str:
        name = "all_gather→dot" if self.op == AG else "dot→psum_scatter"
        at = f" at {self.source}" if self.source else ""
        return f"{name} over {self.axis_name!r} in {self.where} ({self.shapes}){at}: {self.why}"


@dataclasses.dataclass(frozen=True)
class Report:
    """What :func:`overlap_tp` did to one trace of the function."""

    sites: tuple[Site, ...]

    @property
    def replaced(self) -> list[Site]:
        return [s for s in self.sites if s.replaced]

    @property
    def left_alone(self) -> list[Site]:
        return [s for s in self.sites if not s.replaced]

    def __str__(self) -> str:
        lines = [f"overlap_tp: {len(self.replaced)} replaced, {len(self.left_alone)} left alone"]
        lines += [f"  replaced: {s}" for s in self.replaced]
        lines += [f"  left alone: {s}" for s in self.left_alone]
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# Finding the sites of one jaxpr


@dataclasses.dataclass(frozen=True)
class _Match:
    op: str
    first: int  # the eqn skipped (AG: the gather; RS: the dot)
    last: int  # the eqn that runs the jax_ub op (AG: the dot; RS: the scatter)
    axis_name: str
    axis: int  # gather_axis / scatter_axis
    transpose_w: bool  # the dot contracts w's dim 1: w.T is the [k, n] weight
    precision: Any


def _source(eqn: Any) -> str:
    try:
        from jax._src import source_info_util

        return str(source_info_util.summarize(eqn.source_info))
    except Exception:  # only a label
        return ""


def _shape(v: Any) -> str:
    aval = v.aval
    return f"{np.dtype(aval.dtype).name}[{','.join(map(str, aval.shape))}]"


def _uses(jaxpr: Any) -> dict[Any, list[int]]:
    """var -> indices of the eqns that read it (-1: an output of the jaxpr)."""
    out: dict[Any, list[int]] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not isinstance(v, jcore.Literal):
                out.setdefault(v, []).append(i)
    for v in jaxpr.outvars:
        if not isinstance(v, jcore.Literal):
            out.setdefault(v, []).append(-1)
    return out


def _dot_refusal(dot: Any, lhs_pos: int) -> tuple[str, bool]:
    """('' or why the dot cannot be jax_ub's x[..., k] @ w[k, n], w transposed?) with the
    activation at position ``lhs_pos`` of the dot."""
    if lhs_pos != 0:
        return "the value is the dot's right-hand operand (e.g. a weight gather, as FSDP's)", False
    (lc, rc), (lb, rb) = dot.params["dimension_numbers"]
    x, w = dot.invars
    xnd, wnd = len(x.aval.shape), len(w.aval.shape)
    if lb or rb:
        return "the dot has batch dimensions", False
    if wnd != 2:
        return f"the weight is not 2-D ({_shape(w)}): jax_ub multiplies by a [k, n] matrix", False
    if tuple(lc) != (xnd - 1,) or len(rc) != 1:
        return (
            f"the dot contracts dims {tuple(lc)} of the activation {_shape(x)}, not its last dim alone",
            False,
        )
    dtypes = {np.dtype(x.aval.dtype), np.dtype(w.aval.dtype), np.dtype(dot.outvars[0].aval.dtype)}
    if len(dtypes) != 1:
        return (
            f"the dot mixes dtypes (activation {_shape(x)}, weight {_shape(w)}, output "
            f"{_shape(dot.outvars[0])}): jax_ub's ops take and give one dtype",
            False,
        )
    if dtypes.pop() not in _validate.SUPPORTED_DTYPES:
        return f"dtype {np.dtype(x.aval.dtype).name} is not one of {_validate.DTYPE_NAMES}", False
    return "", tuple(rc) == (1,)


def _collective_refusal(eqn: Any, kind: str) -> tuple[str, str]:
    """('' or why not, the one axis name)."""
    p = eqn.params
    name = _validate.one_axis(p["axis_name"])
    if p.get("axis_index_groups") is not None:
        return "it has axis_index_groups", ""
    if not p.get("tiled", False):
        return f"the {kind} is not tiled (tiled=False stacks a new axis)", ""
    if name is None:
        return f"the {kind} spans several mesh axes {p['axis_name']!r}; a jax_ub op spans one", ""
    return "", name


@functools.lru_cache(maxsize=256)
def _plan_cached(jaxpr: Any) -> tuple[dict[int, _Match], tuple[tuple[int, str, str, bool, str], ...]]:
    return _plan(jaxpr)


def _plan(jaxpr: Any) -> tuple[dict[int, _Match], tuple[tuple[int, str, str, bool, str], ...]]:
    """The pairs of ``jaxpr`` to replace, keyed by the index of the eqn that runs the jax_ub op
    (the other one of each pair is skipped), and every gather/scatter as (eqn index, op, axis
    name, replaced, why)."""
    uses = _uses(jaxpr)
    eqns = jaxpr.eqns
    matches: dict[int, _Match] = {}
    notes: list[tuple[int, str, str, bool, str]] = []
    for i, eqn in enumerate(eqns):
        prim = eqn.primitive.name
        if prim == _GATHER:
            why, name = _collective_refusal(eqn, "all_gather")
            axis = eqn.params["all_gather_dimension"]
            g = eqn.outvars[0]
            users = uses.get(g, [])
            if not why and axis == len(g.aval.shape) - 1:
                why = "it gathers the last dim, which the dot contracts (jax_ub gathers a row dim)"
            if not why and (len(users) != 1 or users[0] < 0):
                why = (
                    f"the gathered value has {len(users)} uses (outputs included); jax_ub's op needs one dot"
                )
            transpose = False
            if not why:
                dot = eqns[users[0]]
                if dot.primitive.name != _DOT:
                    why = f"the gathered value feeds {dot.primitive.name}, not a dot_general"
                else:
                    pos = [k for k, v in enumerate(dot.invars) if v is g]
                    why, transpose = _dot_refusal(dot, pos[0] if len(pos) == 1 else -1)
            if why:
                notes.append((i, AG, name or repr(eqn.params["axis_name"]), False, why))
                continue
            dot = eqns[users[0]]
            matches[users[0]] = _Match(AG, i, users[0], name, axis, transpose, dot.params.get("precision"))
            notes.append((i, AG, name, True, f"all_gather_matmul(gather_axis={axis})"))
        elif prim == _SCATTER:
            why, name = _collective_refusal(eqn, "psum_scatter")
            axis = eqn.params["scatter_dimension"]
            p = eqn.invars[0]
            producer = next((k for k in range(i) if any(o is p for o in eqns[k].outvars)), None)
            transpose = False
            if not why and (producer is None or eqns[producer].primitive.name != _DOT):
                what = "an input" if producer is None else eqns[producer].primitive.name
                why = f"it scatters {what}, not a dot_general's output"
            if not why and len(uses.get(p, [])) != 1:
                why = f"the product has {len(uses.get(p, []))} uses (outputs included); jax_ub's op needs one"
            if not why:
                assert producer is not None
                why, transpose = _dot_refusal(eqns[producer], 0)
            if not why and axis == len(p.aval.shape) - 1:
                why = "it scatters the weight's output dim (columns); jax_ub scatters a row dim"
            if why:
                notes.append((i, RS, name or repr(eqn.params["axis_name"]), False, why))
                continue
            assert producer is not None
            dot = eqns[producer]
            matches[i] = _Match(RS, producer, i, name, axis, transpose, dot.params.get("precision"))
            notes.append((i, RS, name, True, f"matmul_reduce_scatter(scatter_axis={axis})"))
    return matches, tuple(notes)


def _subjaxprs(eqn: Any) -> list[Any]:
    """The open jaxprs among ``eqn``'s params."""
    out = []
    for v in eqn.params.values():
        for j in v if isinstance(v, (tuple, list)) else (v,):
            if isinstance(j, jcore.ClosedJaxpr):
                out.append(j.jaxpr)
            elif isinstance(j, jcore.Jaxpr):
                out.append(j)
    return out


def _rewritable(eqn: Any) -> bool:
    name = eqn.primitive.name
    if name == "shard_map":
        return not eqn.params["jaxpr"].constvars
    return name in _INLINED or name in _REBUILT


@functools.lru_cache(maxsize=256)
def _has_matches(jaxpr: Any) -> bool:
    if _plan_cached(jaxpr)[0]:
        return True
    return any(_rewritable(e) and any(_has_matches(j) for j in _subjaxprs(e)) for e in jaxpr.eqns)


def _collect(jaxpr: Any, where: str, rewritten: bool, out: list[Site], note: str = "") -> None:
    """Every gather/scatter site of ``jaxpr`` and of its sub-jaxprs, as :class:`Site`s."""
    matches, notes = _plan_cached(jaxpr)
    for i, op, name, ok, why in notes:
        eqn = jaxpr.eqns[i]
        if op == AG:
            m = matches.get(_users_of(jaxpr, i))
            shapes = _pair_shapes(jaxpr, m) if ok and m else f"x {_shape(eqn.invars[0])}"
        else:
            shapes = _pair_shapes(jaxpr, matches[i]) if ok else f"product {_shape(eqn.invars[0])}"
        if ok and not rewritten:
            ok, why = False, note
        elif ok and note:
            why = f"{why}; {note}"
        out.append(Site(op, where or "the function", name, shapes, ok, why, _source(eqn)))
    for eqn in jaxpr.eqns:
        subs = _subjaxprs(eqn)
        if not subs:
            continue
        prim = eqn.primitive.name
        inner = f"{where} > {prim}" if where else prim
        sub_rewritten = rewritten and _rewritable(eqn)
        sub_note = note
        if rewritten and not _rewritable(eqn):
            sub_note = f"inside {prim}, which overlap_tp does not rewrite"
        elif sub_rewritten and prim == "custom_jvp_call" and any(_has_matches(j) for j in subs):
            sub_note = "inlined out of its custom_jvp function: jax_ub's derivative replaces that rule"
        for j in subs:
            _collect(j, inner, sub_rewritten, out, sub_note)


def _users_of(jaxpr: Any, i: int) -> int:
    g = jaxpr.eqns[i].outvars[0]
    return next((k for k, e in enumerate(jaxpr.eqns) if any(v is g for v in e.invars)), -1)


def _pair_shapes(jaxpr: Any, m: _Match) -> str:
    dot = jaxpr.eqns[m.last if m.op == AG else m.first]
    x = jaxpr.eqns[m.first].invars[0] if m.op == AG else dot.invars[0]
    w = dot.invars[1]
    return f"x {_shape(x)} @ w {_shape(w)}{'ᵀ' if m.transpose_w else ''}"


# ------------------------------------------------------------------------------------------------
# Evaluating a jaxpr with the sites replaced


def _eval(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], method: str | None) -> list[Any]:
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for v, a in zip(jaxpr.constvars, consts, strict=True):
        env[v] = a
    for v, a in zip(jaxpr.invars, args, strict=True):
        env[v] = a
    matches, _ = _plan_cached(jaxpr)
    skip = {m.first for m in matches.values()}
    for i, eqn in enumerate(jaxpr.eqns):
        if i in skip:
            continue
        if i in matches:
            outs = [_run_match(jaxpr, matches[i], read, method)]
        else:
            outs = _eval_eqn(eqn, [read(v) for v in eqn.invars], method)
        for v, val in zip(eqn.outvars, outs, strict=True):
            if not isinstance(v, jcore.DropVar):
                env[v] = val
    return [read(v) for v in jaxpr.outvars]


def _run_match(jaxpr: Any, m: _Match, read: Callable[[Any], Any], method: str | None) -> Any:
    dot = jaxpr.eqns[m.last if m.op == AG else m.first]
    x = read(jaxpr.eqns[m.first].invars[0]) if m.op == AG else read(dot.invars[0])
    w = read(dot.invars[1])
    if m.transpose_w:
        w = w.T
    if m.op == AG:
        return ops.all_gather_matmul(
            x, w, m.axis_name, gather_axis=m.axis, precision=m.precision, method=method
        )
    return ops.matmul_reduce_scatter(
        x, w, m.axis_name, scatter_axis=m.axis, precision=m.precision, method=method
    )


def _bind(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    """``eqn`` bound to ``invals`` as traced (as ``jax.core.eval_jaxpr`` does it)."""
    got = eqn.primitive.get_bind_params(eqn.params)
    # jax < 0.7 returns (subfuns, params); later ones the params alone
    subfuns, params = got if isinstance(got, tuple) else ([], got)
    with contextlib.ExitStack() as stack:
        with contextlib.suppress(Exception):  # source info only improves jax's messages
            from jax._src import source_info_util

            stack.enter_context(
                source_info_util.user_context(
                    eqn.source_info.traceback,
                    name_stack=source_info_util.current_name_stack() + eqn.source_info.name_stack,
                )
            )
        ctx = getattr(getattr(eqn, "ctx", None), "manager", None)
        if ctx is not None:
            stack.enter_context(ctx)
        ans = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(ans) if eqn.primitive.multiple_results else [ans]


def _eval_eqn(eqn: Any, invals: list[Any], method: str | None) -> list[Any]:
    """One eqn: bound as traced, or, where its body holds a site, rebuilt around :func:`_eval`."""
    if not _rewritable(eqn) or not any(_has_matches(j) for j in _subjaxprs(eqn)):
        return _bind(eqn, invals)
    p = eqn.params
    name = eqn.primitive.name
    if name in ("jit", "pjit"):
        return _eval(p["jaxpr"].jaxpr, p["jaxpr"].consts, invals, method)
    if name in ("closed_call", "core_call"):
        cj = p["call_jaxpr"]
        if isinstance(cj, jcore.ClosedJaxpr):
            return _eval(cj.jaxpr, cj.consts, invals, method)
        return _eval(cj, (), invals, method)
    if name == "custom_jvp_call":
        cj = p["call_jaxpr"]
        return _eval(cj.jaxpr, cj.consts, invals, method)
    if name == "shard_map":
        body = p["jaxpr"]
        kw: dict[str, Any] = {
            "mesh": p["mesh"],
            "in_specs": tuple(p["in_specs"]),
            "out_specs": tuple(p["out_specs"]),
        }
        if "check_vma" in p:
            kw["check_vma"] = p["check_vma"]
        manual = p.get("newly_manual_axes", p.get("manual_axes"))
        if manual is not None and set(manual) != set(p["mesh"].axis_names):
            kw["axis_names"] = set(manual)
        fn = jax.shard_map(lambda *a: tuple(_eval(body, (), a, method)), **kw)
        return list(fn(*invals))
    if name in ("checkpoint", "remat", "remat2"):
        body = p["jaxpr"]
        fn = jax.checkpoint(
            lambda *a: _eval(body, (), a, method),
            prevent_cse=p.get("prevent_cse", True),
            policy=p.get("policy"),
        )
        return list(fn(*invals))
    if name == "scan":
        return _scan(p, invals, method)
    return _bind(eqn, invals)  # unreachable: _rewritable lists the names above


def _scan(p: dict[str, Any], invals: list[Any], method: str | None) -> list[Any]:
    cj = p["jaxpr"]
    nc, ncarry = p["num_consts"], p["num_carry"]
    consts, init, xs = invals[:nc], invals[nc : nc + ncarry], invals[nc + ncarry :]

    def body(carry: Any, x: Any) -> tuple[Any, Any]:
        outs = _eval(cj.jaxpr, cj.consts, [*consts, *carry, *x], method)
        return list(outs[:ncarry]), list(outs[ncarry:])

    carry, ys = lax.scan(
        body, list(init), list(xs), length=p["length"], reverse=p["reverse"], unroll=p.get("unroll", 1)
    )
    return [*carry, *ys]


# ------------------------------------------------------------------------------------------------
# The transformation


@dataclasses.dataclass
class _Traced:
    closed: Any
    out_tree: Any
    report: Report
    run: Callable[..., Any]


class OverlapTP:
    """``f`` with its all-gather→dot and dot→reduce-scatter pairs run by jax_ub (see
    :func:`overlap_tp`). Call it as ``f``; :meth:`report` says what was replaced."""

    def __init__(self, f: Callable[..., Any], method: str | None = None):
        if not callable(f):
            raise TypeError(f"overlap_tp: f must be a function; got {f!r}")
        self.f = f
        self.method = method
        self._cache: dict[Any, _Traced] = {}
        self.last_report: Report | None = None
        self.__wrapped__ = f

    def _traced(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Traced:
        flat, tree = jax.tree.flatten((args, kwargs))
        key = (tree, tuple(jax.typeof(a) for a in flat))
        t = self._cache.get(key)
        if t is None:

            def flat_f(*leaves: Any) -> Any:
                a, k = jax.tree.unflatten(tree, leaves)
                return self.f(*a, **k)

            closed, shape = jax.make_jaxpr(flat_f, return_shape=True)(*flat)
            sites: list[Site] = []
            _collect(closed.jaxpr, "", True, sites)
            method = self.method
            run = jax.jit(lambda *leaves: _eval(closed.jaxpr, closed.consts, leaves, method))
            t = _Traced(closed, jax.tree.structure(shape), Report(tuple(sites)), run)
            self._cache[key] = t
        self.last_report = t.report
        return t

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t = self._traced(args, kwargs)
        outs = t.run(*jax.tree.leaves((args, kwargs)))
        return jax.tree.unflatten(t.out_tree, outs)

    def report(self, *args: Any, **kwargs: Any) -> Report:
        """What the call with these arguments (arrays or ``jax.ShapeDtypeStruct``) replaces and
        leaves alone, and why; traces ``f`` without running it."""
        return self._traced(args, kwargs).report


def overlap_tp(f: Callable[..., Any], *, method: str | None = None) -> OverlapTP:
    """``f`` with each ``lax.all_gather(x, axis, tiled=True) @ w`` and ``lax.psum_scatter(x @ w,
    axis, tiled=True)`` of its ``shard_map`` bodies run by :func:`jax_ub.all_gather_matmul` /
    :func:`jax_ub.matmul_reduce_scatter`: same values, same gradients.

    ``method`` is passed to those ops (``None``: ``JAX_UB_METHOD``). The result is called as ``f``
    (under ``jax.jit``, ``jax.grad``, ... or not); ``g.report(*args)`` returns the :class:`Report`
    for those arguments (``str()`` formats it; ``g.last_report`` is the last call's), listing each
    site replaced and each left alone with the reason: a gather that is not tiled or spans several
    mesh axes, a gathered value used elsewhere too, a contraction over the gathered dim, a weight
    that is not 2-D, a dot with batch dims or mixed dtypes, a site inside ``cond``/``while``/
    ``custom_vjp``. See docs/adoption.md.
    """
    return OverlapTP(f, method=method)
