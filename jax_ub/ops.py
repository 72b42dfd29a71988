"""Tensor-parallel primitives: AG→GEMM and GEMM→RS, differentiable, for use inside ``jax.shard_map``.

:func:`all_gather_matmul` and :func:`matmul_reduce_scatter` have the semantics of
:mod:`jax_ub.reference`. Each call

1. validates its arguments at trace time (before any kernel), with errors naming expected and
   received shapes/dtypes/values;
2. picks an implementation: :func:`jax_ub.resolve.for_size` maps ``method`` (or
   ``config.get().method``) to a method of :mod:`jax_ub.methods`; ``"auto"`` is resolved per call
   when the forward is traced (:func:`jax_ub.resolve.auto_method`), and :func:`_impl` gives the
   forward: the reference for ``"xla"``, :mod:`jax_ub.overlap`'s CUDA kernels for the others;
3. differentiates through one ``custom_vjp`` whose backward is the *dual* op (:data:`DUAL`), called
   through the same dispatch, so an overlapped forward gets an overlapped backward. With
   ``recompute_gathered`` an AG keeps only its local shard for the backward, which re-gathers it
   with the bulk ops of :mod:`jax_ub.bulk` (see :func:`_recompute_bwd`). A custom_vjp has reverse
   mode only; the reference path (method ``"xla"`` without ``recompute_gathered``) calls
   :mod:`jax_ub.reference` directly instead (:func:`_dispatch`), so forward mode works there too.

FP8 calls (``scales=`` or ``fp8=``, semantics in :mod:`jax_ub.fp8`) take the same steps through
their own functions (:func:`_fp8_dispatch`): float8 operands with scales run the forward (the
reference's gradients where they are differentiated), and an :class:`jax_ub.fp8.FP8Recipe`
quantizes and runs the hybrid-recipe backward of :func:`_recipe_bwd`.

The method is resolved when the call is traced: a ``jax.jit`` cache keeps the path it traced with.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jax_ub import _ffi, _validate, bulk, config, gemm, methods, overlap, reference, resolve, tuning
from jax_ub import fp8 as fp8_lib

__all__ = [
    "CHECKPOINT_NAMES",
    "all_gather_matmul",
    "checkpoint_policy",
    "local_matmul",
    "matmul_reduce_scatter",
]

AG, RS = methods.AG, methods.RS
# The AG<->RS duality (jax_ub.methods): the backward of each op is its dual op applied to (dy, wᵀ)
# along the same axis; everything else in the VJP is shared (see _overlap_bwd).
DUAL = methods.DUAL
_PUBLIC_NAME = methods.PUBLIC_NAME

# What a call runs (jax_ub.resolve), under the names the tests patch.
_requested = resolve.requested
_resolve_method = resolve.method_name
_resolve_for_size = resolve.for_size
_cuda_status = resolve.cuda_status
_cuda_unavailable_reason = resolve.cuda_unavailable_reason

# An implementation computes ``(y, x_full)`` from local shards, where ``x_full`` is the left operand
# the GEMM actually saw: the gathered x for AG, x itself for RS. Keyword arguments: ``axis_name``,
# ``axis`` (the gather/scatter axis, non-negative), ``precision`` and ``need_full``: True when the
# caller uses ``x_full`` (it is returned, or saved as the residual of a VJP), False when it is
# dropped (a plain call, or a forward with recompute_gathered), so an implementation may skip
# materialising it; its second output is then ignored (it may be None).
Impl = Callable[..., tuple[jax.Array, jax.Array]]


def _ag_xla(x, w, *, axis_name, axis, precision, need_full=True):
    del need_full  # XLA frees the gathered x itself when nothing uses it
    return reference.all_gather_matmul(
        x, w, axis_name, gather_axis=axis, return_gathered=True, precision=precision
    )


def _rs_xla(x, w, *, axis_name, axis, precision, need_full=True):
    del need_full
    return reference.matmul_reduce_scatter(x, w, axis_name, scatter_axis=axis, precision=precision), x


# The forwards by (op, method) beside the CUDA methods' (tests add their own here).
_IMPLS: dict[tuple[str, str], Impl] = {(AG, methods.XLA): _ag_xla, (RS, methods.XLA): _rs_xla}
_CUDA: dict[str, Callable[..., Any]] = {AG: overlap.ag_gemm, RS: overlap.gemm_rs}


def _impl(op: str, method: str) -> Impl:
    """The forward of ``op`` for a resolved ``method`` (not ``"auto"``)."""
    if (op, method) in _IMPLS:
        return _IMPLS[(op, method)]
    if method in methods.CUDA_METHODS or method == methods.NCCL:
        return functools.partial(_CUDA[op], method=method)
    raise ValueError(
        f"{_PUBLIC_NAME[op]}: no implementation of method {method!r}; have "
        f"{sorted({m for o, m in _IMPLS if o == op} | set(methods.CUDA_METHODS))}"
    )


# ----------------------------------------------------------------------------------------------
# Varying mesh axes (shard_map's check_vma): a cotangent must vary over exactly the axes its primal
# varies over. A replicated w used on every device gets the sum of the per-device contributions.


def _vma(a: Any) -> frozenset:
    return _ffi.varying_axes(a)


def _match_vma(ct: jax.Array, target: frozenset) -> jax.Array:
    have = _vma(ct)
    extra = tuple(sorted(have - target, key=str))
    if extra:  # primal replicated over these axes: sum the per-device contributions
        ct = lax.psum(ct, extra)
    # where the primal varies and the cotangent does not (e.g. it came from a replicated dy)
    return _ffi.vary(ct, target)


# ----------------------------------------------------------------------------------------------
# One custom_vjp for both ops.


@dataclasses.dataclass(frozen=True)
class _Call:
    """Static description of one call (the custom_vjp's non-differentiable argument)."""

    op: str  # AG or RS
    method: str  # "auto", "xla" or a CUDA method (jax_ub.methods), resolved for this call
    axis_name: Any
    axis: int  # gather/scatter axis, non-negative
    precision: Any
    x_vma: frozenset  # mesh axes x varies over (empty with check_vma=False)
    w_vma: frozenset
    return_full: bool  # also output x_full (AG: return_gathered; the dual call in a backward)
    # AG only, and never with return_full (then x_full is an output anyway): save the local x, not
    # x_full, for the backward, which re-gathers it (_recompute_bwd). Always False for RS.
    recompute_gathered: bool = False


def _call_for(
    op, method, axis_name, axis, precision, x, w, *, return_full, recompute_gathered=False
) -> _Call:
    recompute = bool(recompute_gathered) and op == AG and not return_full
    return _Call(op, method, axis_name, axis, precision, _vma(x), _vma(w), return_full, recompute)


# ----------------------------------------------------------------------------------------------
# Names for jax.checkpoint policies. On the CUDA path an op is one custom call, which no policy
# that looks for dots (e.g. ``dots_saveable``) keeps: the backward would recompute the whole op,
# GEMM and collective. These names let a policy keep its output and AG's gathered input instead.

OUT_NAMES = {AG: "jax_ub_ag_out", RS: "jax_ub_rs_out"}
GATHERED_NAME = "jax_ub_gathered"
CHECKPOINT_NAMES = (OUT_NAMES[AG], OUT_NAMES[RS], GATHERED_NAME, gemm.OUT_NAME)


def checkpoint_policy(base: Callable[..., bool] | None = None) -> Callable[..., bool]:
    """A ``jax.checkpoint`` policy that saves what ``base`` saves plus the values jax_ub names:
    each op's output (``"jax_ub_ag_out"``, ``"jax_ub_rs_out"``), the gathered input that
    ``all_gather_matmul``'s backward needs (``"jax_ub_gathered"``) and :func:`jax_ub.matmul`'s
    output (``"jax_ub_matmul_out"``); ``base=None``: only those.

    Without it a policy such as ``jax.checkpoint_policies.dots_saveable`` saves XLA's dots but
    not jax_ub's custom calls, so the backward recomputes every overlapped op::

        jax.checkpoint(layer, policy=jax_ub.checkpoint_policy(jax.checkpoint_policies.dots_saveable))
    """
    if base is not None and not callable(base):
        raise TypeError(
            "checkpoint_policy: `base` must be a jax.checkpoint policy (a callable such as "
            f"jax.checkpoint_policies.dots_saveable) or None; got {base!r}"
        )
    names = jax.checkpoint_policies.save_only_these_names(*CHECKPOINT_NAMES)
    if base is None:
        return names
    return jax.checkpoint_policies.save_from_both_policies(base, names)


def _named(op: str, y: jax.Array, x_full: Any) -> tuple[jax.Array, Any]:
    y = checkpoint_name(y, OUT_NAMES[op])
    if op == AG and x_full is not None:
        x_full = checkpoint_name(x_full, GATHERED_NAME)
    return y, x_full


def _forward(call: _Call, x, w, *, need_full: bool):
    method = call.method
    if method == methods.AUTO:  # per call, at its traced shapes: the measured choice
        method = resolve.auto_method(call.op, x, w, call.axis_name)
    y, x_full = _impl(call.op, method)(
        x, w, axis_name=call.axis_name, axis=call.axis, precision=call.precision, need_full=need_full
    )
    return _named(call.op, y, x_full if need_full else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _overlap(call: _Call, x: jax.Array, w: jax.Array) -> Any:
    """``y``, or ``(y, x_full)`` with ``call.return_full``, of ``call.op``; see :data:`Impl`."""
    y, x_full = _forward(call, x, w, need_full=call.return_full)
    return (y, x_full) if call.return_full else y


def _overlap_fwd(call, x, w):
    if call.recompute_gathered:  # keep the local shard: tp× smaller than x_full
        y, _ = _forward(call, x, w, need_full=False)
        return y, (x, w)
    y, x_full = _forward(call, x, w, need_full=True)
    return ((y, x_full) if call.return_full else y), (x_full, w)


def _recompute_bwd(call, x, w, dy):
    """(dx, dw) of ``y = AG(x) @ w`` from the local x (TransformerEngine's bulk-overlap backward).

    1. ``(x_full, dgrad_partial) = bulk_all_gather(x, dy, wᵀ)``: x is re-gathered while the dgrad
       GEMM ``dy @ wᵀ`` (full rows, not yet reduced over the axis) runs;
    2. ``(dx, dw) = bulk_reduce_scatter(dgrad_partial, x_fullᵀ, dy)``: the dgrad partials are
       reduce-scattered while the wgrad GEMM runs.

    The bulk GEMMs are 2-D: dy and x_full are flattened to rows over all their leading dims. Both
    have the shape of x_full up to the last dim, so their rows line up for any gather axis; the
    collectives act on the un-flattened arrays along ``call.axis``.
    """
    k, n = w.shape
    rows = math.prod(dy.shape[:-1])  # explicit: reshape(-1, 0) cannot infer it (an empty w shard)
    dy2 = dy.reshape(rows, n)
    x_full, dgrad = bulk.bulk_all_gather(
        x, dy2, w.T, call.axis_name, axis=call.axis, precision=call.precision, method=call.method
    )
    dgrad = dgrad.reshape(*dy.shape[:-1], k)
    dx, dw = bulk.bulk_reduce_scatter(
        dgrad,
        x_full.reshape(rows, k).T,
        dy2,
        call.axis_name,
        axis=call.axis,
        precision=call.precision,
        method=call.method,
    )
    return dx, dw


def _overlap_bwd(call, residuals, cotangents):
    if call.recompute_gathered:
        x, w = residuals
        dx, dw = _recompute_bwd(call, x, w, cotangents)
        return _match_vma(dx, call.x_vma), _match_vma(dw, call.w_vma)
    x_full, w = residuals
    dy, dx_full = cotangents if call.return_full else (cotangents, None)
    # dgrad is the dual op of (dy, wᵀ) along the same axis. The dual's x_full is dy at full extent
    # (gathered when the dual is AG, dy itself when it is RS), so wgrad is x_fullᵀ @ dy_full
    # contracted over all leading dims: AG(x)ᵀ @ dy, or xᵀ @ AG(dy).
    wt = w.T
    dual = _call_for(
        DUAL[call.op], call.method, call.axis_name, call.axis, call.precision, dy, wt, return_full=True
    )
    dx, dy_full = _overlap(dual, dy, wt)
    lead = tuple(range(x_full.ndim - 1))
    dw = reference.dot_general(x_full, dy_full, ((lead, lead), ((), ())), precision=call.precision)
    if dx_full is not None:
        # x_full was an output too (return_gathered): its cotangent goes back to x through the
        # transpose of the bare collective, a reduce-scatter for AG and the identity for RS.
        if call.op == AG:
            dx_full = lax.psum_scatter(dx_full, call.axis_name, scatter_dimension=call.axis, tiled=True)
        dx = dx + dx_full
    return _match_vma(dx, call.x_vma), _match_vma(dw, call.w_vma)


_overlap.defvjp(_overlap_fwd, _overlap_bwd)


def _under_forward_mode(e: TypeError, x: Any, w: Any) -> bool:
    """Whether ``e``, raised by the custom_vjp, is jax refusing forward mode: its own message, or
    (jvp of an eager ``shard_map``) another TypeError with a jvp tracer among the operands. (Under
    jit, jax applies the jvp to the traced custom_vjp after this code has run: its own message then
    stands, its stack trace pointing at the op.)"""

    from jax.interpreters import ad

    return "forward-mode" in str(e) or any(isinstance(a, ad.JVPTracer) for a in (x, w))


def _no_forward_mode(call: _Call) -> str:
    why = (
        "recompute_gathered=True (given, or JAX_UB_RECOMPUTE_GATHERED=1)"
        if call.recompute_gathered
        else f"method {call.method!r} (a CUDA overlap kernel)"
    )
    return (
        f"{_PUBLIC_NAME[call.op]}: forward-mode autodiff (jax.jvp, jax.jacfwd, jax.hessian) cannot "
        f"go through {why}: jax_ub gives it a custom_vjp, which jax differentiates in reverse mode "
        f"only (jax.grad, jax.vjp). For forward mode use method='xla' (or JAX_UB_DISABLE=1) with "
        f"recompute_gathered=False: the pure-XLA reference, whose derivatives jax derives itself"
    )


def _dispatch(call: _Call, x: jax.Array, w: jax.Array) -> Any:
    """The reference path (method ``"xla"``, no recompute) is :mod:`jax_ub.reference`'s expressions
    (AG's gathered x and each output carry their checkpoint names), with no custom_vjp: JAX derives
    both autodiff modes (``jax.jvp``, ``jax.jacfwd``, ``jax.hessian`` work), and its reverse mode is
    the computation of :func:`_overlap_bwd` with the reference dual op (the same numbers; with
    leading batch dims the wgrad contraction may round differently in the last bit). Everything else
    goes through the custom_vjp (reverse mode only)."""
    if call.method in (methods.XLA, methods.AUTO) and not _validate.bound_by_shard_map(call.axis_name):
        # A jax.vmap (or pmap) axis named like the TP axis: XLA's collectives over it, which JAX
        # differentiates itself. The custom_vjp's backward (auto's, or recompute's re-gather) needs
        # an axis bound by a shard_map, and the memory that recompute saves does not apply here.
        call = dataclasses.replace(call, method=methods.XLA, recompute_gathered=False)
    if call.method != methods.XLA or call.recompute_gathered:
        try:
            return _overlap(call, x, w)
        except TypeError as e:
            if _under_forward_mode(e, x, w):
                raise TypeError(_no_forward_mode(call)) from e
            raise
    if call.op == AG:
        # reference.all_gather_matmul's two steps, with the gathered x named before its dot uses it:
        # a policy that keeps "jax_ub_gathered" then keeps the dot's input, and the backward's wgrad
        # does not gather x again.
        x_full = checkpoint_name(lax.all_gather(x, call.axis_name, axis=call.axis, tiled=True), GATHERED_NAME)
        y = checkpoint_name(reference.matmul(x_full, w, precision=call.precision), OUT_NAMES[AG])
        return (y, x_full) if call.return_full else y
    y = reference.matmul_reduce_scatter(
        x, w, call.axis_name, scatter_axis=call.axis, precision=call.precision
    )
    return _named(RS, y, None)[0]


# ----------------------------------------------------------------------------------------------
# FP8 (jax_ub.fp8 says what the results are). Two kinds of call: float8 operands with their
# scales (``scales=``), and higher-precision operands with an FP8Recipe (``fp8=``), quantized here
# with current scaling before the op communicates, so an all-gather moves FP8 bytes.


@dataclasses.dataclass(frozen=True)
class _FP8Call:
    """Static description of one FP8 call (the custom_vjps' non-differentiable argument)."""

    op: str
    method: str  # as _Call.method
    axis_name: Any
    axis: int
    precision: Any  # the GEMMs of a backward in the operands' precision (bwd_dtype=None)
    out_dtype: Any  # the output's dtype (np.dtype)
    return_full: bool
    recipe: fp8_lib.FP8Recipe | None = None  # None: float8 operands with scales
    x_dtype: Any = None  # recipe only: the operands' own dtypes (the gradients')
    w_dtype: Any = None
    x_vma: frozenset = frozenset()
    w_vma: frozenset = frozenset()
    recompute_gathered: bool = False  # recipe AG only: save the local x8, re-gather it in the backward


# Through XLA the GEMMs are XLA's own FP8 dot (jax_ub.fp8.scaled_dot, which XLA hands to cuBLASLt's
# FP8 GEMM on GPUs), not the float32 dot of the dequantized reference: the same result up to float32
# rounding order (tests/cpu/test_fp8.py holds them to each other).


def _ag_fp8_xla(x8, w8, xs, ws, *, axis_name, axis, out_dtype, need_full=True):
    del need_full
    return fp8_lib.all_gather_matmul(
        x8, w8, xs, ws, axis_name, gather_axis=axis, out_dtype=out_dtype, dot=fp8_lib.scaled_dot
    )


def _rs_fp8_xla(x8, w8, xs, ws, *, axis_name, axis, out_dtype, need_full=True):
    del need_full
    y = fp8_lib.matmul_reduce_scatter(
        x8, w8, xs, ws, axis_name, scatter_axis=axis, out_dtype=out_dtype, dot=fp8_lib.scaled_dot
    )
    return y, x8


# The FP8 forwards by (op, method) beside the CUDA methods' (``_CUDA`` with the scale keywords).
_FP8_IMPLS: dict[tuple[str, str], Impl] = {(AG, methods.XLA): _ag_fp8_xla, (RS, methods.XLA): _rs_fp8_xla}


def _fp8_forward(op, method, x8, w8, xs, ws, *, axis_name, axis, out_dtype, need_full, fast_accum=False):
    """``(y, x8_full, method run)`` of the FP8 op: y in ``out_dtype`` (the GEMM writes bfloat16 or
    float32, :func:`jax_ub.fp8_lib.kernel_out`, then a cast). ``fast_accum``: the CUDA GEMMs'
    fast accumulation (the reference has none)."""
    if method == methods.AUTO:
        method = resolve.auto_method(op, x8, w8, axis_name)
    kout = fp8_lib.kernel_out(out_dtype)
    if (op, method) in _FP8_IMPLS:
        y, x_full = _FP8_IMPLS[(op, method)](
            x8, w8, xs, ws, axis_name=axis_name, axis=axis, out_dtype=kout, need_full=need_full
        )
    elif method in methods.CUDA_METHODS or method == methods.NCCL:
        y, x_full = _CUDA[op](
            x8,
            w8,
            axis_name=axis_name,
            axis=axis,
            precision=None,
            method=method,
            need_full=need_full,
            x_scale=xs,
            w_scale=ws,
            out_dtype=kout,
            fast_accum=fast_accum,
        )
    else:
        raise ValueError(f"{_PUBLIC_NAME[op]}: no FP8 implementation of method {method!r}")
    return y.astype(out_dtype), x_full, method


def _fp8_matmul(a8, b8, a_scale, b_scale, out_dtype, method):
    """The FP8 GEMM of a backward (wgrad), ``a8[m, k] @ b8[k, n]`` dequantized: cuBLASLt's
    (:func:`jax_ub.gemm.fp8_matmul`) where the op ran a CUDA method, else XLA's FP8 dot."""
    kout = fp8_lib.kernel_out(out_dtype)
    if method == methods.XLA:
        return fp8_lib.scaled_dot(a8, b8, a_scale, b_scale, kout).astype(out_dtype)
    return gemm.fp8_matmul(a8, b8, a_scale, b_scale, out_dtype=kout).astype(out_dtype)


# float8 operands with scales: the forward, differentiated (where asked) as the reference is.


def _scaled_forward(call: _FP8Call, method: str, x8, w8, xs, ws):
    """``(y, x_full)`` of a call with float8 operands, run with ``method``."""
    y, x_full, _ = _fp8_forward(
        call.op,
        method,
        x8,
        w8,
        xs,
        ws,
        axis_name=call.axis_name,
        axis=call.axis,
        out_dtype=call.out_dtype,
        need_full=call.return_full,
    )
    return y, x_full


def _scaled_reference(call: _FP8Call, x8, w8, xs, ws):
    y, x_full = _scaled_forward(call, methods.XLA, x8, w8, xs, ws)
    return (y, x_full) if call.return_full else y


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _scaled(call: _FP8Call, x8, w8, xs, ws):
    return _scaled_fwd(call, x8, w8, xs, ws)[0]


def _scaled_fwd(call, x8, w8, xs, ws):
    y, x_full = _scaled_forward(call, call.method, x8, w8, xs, ws)
    y, x_full = _named(call.op, y, x_full if call.return_full else None)
    return ((y, x_full) if call.return_full else y), (x8, w8, xs, ws)


def _scaled_bwd(call, residuals, cotangents):
    _, vjp = jax.vjp(functools.partial(_scaled_reference, call), *residuals)
    return vjp(cotangents)


_scaled.defvjp(_scaled_fwd, _scaled_bwd)


# An FP8Recipe: quantize (current scaling), the FP8 op, and the hybrid-recipe backward.


def _recipe_quantize(call: _FP8Call, x, w):
    """``(x8, x_scale, w8, w_scale)``. AG's x scale is the pmax over the axis (one scale for the
    gathered rows); RS's scales, and every w scale, are the rank's own."""
    assert call.recipe is not None
    f = call.recipe.fwd_dtype
    x8, xs = fp8_lib.quantize(x, f, call.axis_name if call.op == AG else None)
    w8, ws = fp8_lib.quantize(w, f)
    return x8, xs, w8, ws


def _recipe_forward(call: _FP8Call, x, w):
    assert call.recipe is not None
    x8, xs, w8, ws = _recipe_quantize(call, x, w)
    need = call.op == RS or call.return_full or not call.recompute_gathered
    y, x8_full, _ = _fp8_forward(
        call.op,
        call.method,
        x8,
        w8,
        xs,
        ws,
        axis_name=call.axis_name,
        axis=call.axis,
        out_dtype=call.out_dtype,
        need_full=need,
        fast_accum=call.recipe.fwd_fast_accum,
    )
    y, x8_full = _named(call.op, y, x8_full if need else None)
    out = (y, fp8_lib.dequantize(x8_full, xs, call.x_dtype)) if call.return_full else y
    return out, ((x8 if not need else x8_full), xs, w8, ws)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _recipe(call: _FP8Call, x, w):
    return _recipe_forward(call, x, w)[0]


def _recipe_bwd(call: _FP8Call, residuals, cotangents):
    """Straight-through for the quantization (the gradients of the master x and w are those of
    the quantized forward ``y = op(Q(x), Q(w))``). With ``bwd_dtype`` (the hybrid recipe): dy is
    quantized with current scaling (pmax-ed over the axis where the dual op all-gathers it),
    dgrad is the dual op in FP8 on ``(dy8, w8ᵀ)`` and wgrad ``x8_fullᵀ @ dy8_full`` an FP8 GEMM.
    With ``bwd_dtype=None``: both in the operands' dtype on the dequantized x8 and w8, dgrad
    through the dual op of :func:`_overlap`."""
    x8_full, xs, w8, ws = residuals
    dy, dx_full = cotangents if call.return_full else (cotangents, None)
    if call.op == AG and call.recompute_gathered and not call.return_full:
        x8_full = lax.all_gather(x8_full, call.axis_name, axis=call.axis, tiled=True)
    dual = DUAL[call.op]
    lead = tuple(range(x8_full.ndim - 1))
    xdt, wdt = call.x_dtype, call.w_dtype
    assert call.recipe is not None
    if call.recipe.bwd_dtype is None:
        wq_t = fp8_lib.dequantize(w8, ws, xdt).T
        dyc = dy.astype(xdt)
        d = _call_for(
            dual, call.method, call.axis_name, call.axis, call.precision, dyc, wq_t, return_full=True
        )
        dx, dy_full = _overlap(d, dyc, wq_t)
        x_full = fp8_lib.dequantize(x8_full, xs, xdt)
        dw = reference.dot_general(x_full, dy_full, ((lead, lead), ((), ())), precision=call.precision)
        dw = dw.astype(wdt)
    else:
        dy8, dys = fp8_lib.quantize(dy, call.recipe.bwd_dtype, call.axis_name if dual == AG else None)
        dx, dy8_full, ran = _fp8_forward(
            dual,
            call.method,
            dy8,
            w8.T,
            dys,
            ws,
            axis_name=call.axis_name,
            axis=call.axis,
            out_dtype=xdt,
            need_full=True,
        )
        k, n = x8_full.shape[-1], dy8_full.shape[-1]
        rows = math.prod(x8_full.shape[:-1])
        dw = _fp8_matmul(x8_full.reshape(rows, k).T, dy8_full.reshape(rows, n), xs, dys, wdt, ran)
    if dx_full is not None:  # the gathered x was an output: its cotangent goes back through the AG
        if call.op == AG:
            dx_full = lax.psum_scatter(dx_full, call.axis_name, scatter_dimension=call.axis, tiled=True)
        dx = dx + dx_full.astype(xdt)
    return _match_vma(dx.astype(xdt), call.x_vma), _match_vma(dw, call.w_vma)


_recipe.defvjp(_recipe_forward, _recipe_bwd)


# A GEMM on one device with a recipe: what the no-communication stand-ins of a benchmark's floor
# (jax_ub.layers.core.comm_stand_ins) run for an FP8 layer, so that the floor's GEMMs are FP8 too.


def local_matmul(x: jax.Array, w: jax.Array, *, fp8: fp8_lib.FP8Recipe | None = None) -> jax.Array:
    """``x[..., m, k] @ w[k, n]`` on this device, no communication, through jax_ub's GEMMs:
    :func:`jax_ub.gemm.matmul`, or with ``fp8`` the recipe's GEMMs as the ops run them (x and w
    quantized with current scaling, each its own scale; :func:`jax_ub.gemm.fp8_matmul`: cuBLASLt on
    GPUs, XLA's FP8 dot elsewhere), output in the recipe's ``out_dtype`` (else x's dtype), and the
    recipe's backward (e5m2 dy, FP8 dgrad and wgrad; ``bwd_dtype=None``: in x's dtype)."""
    if fp8 is None:
        return gemm.matmul(x, w)
    if not isinstance(fp8, fp8_lib.FP8Recipe):
        raise TypeError(f"local_matmul: `fp8` must be a jax_ub.FP8Recipe or None; got {type(fp8).__name__}")
    out = np.dtype(fp8.out_dtype if fp8.out_dtype is not None else x.dtype)
    return _local_fp8(fp8, out, np.dtype(x.dtype), np.dtype(w.dtype), x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _local_fp8(recipe, out_dtype, x_dtype, w_dtype, x, w):
    return _local_fp8_fwd(recipe, out_dtype, x_dtype, w_dtype, x, w)[0]


def _local_fp8_fwd(recipe, out_dtype, x_dtype, w_dtype, x, w):
    x8, xs = fp8_lib.quantize(x, recipe.fwd_dtype)
    w8, ws = fp8_lib.quantize(w, recipe.fwd_dtype)
    kout = fp8_lib.kernel_out(out_dtype)
    y = gemm.fp8_matmul(x8, w8, xs, ws, out_dtype=kout, fast_accum=recipe.fwd_fast_accum)
    return y.astype(out_dtype), (x8, xs, w8, ws)


def _local_fp8_bwd(recipe, out_dtype, x_dtype, w_dtype, residuals, dy):
    x8, xs, w8, ws = residuals
    k, n = w8.shape
    rows = math.prod(x8.shape[:-1])
    if recipe.bwd_dtype is None:
        xd, wd, dyc = (
            fp8_lib.dequantize(x8, xs, x_dtype),
            fp8_lib.dequantize(w8, ws, x_dtype),
            dy.astype(x_dtype),
        )
        dw = gemm.matmul(xd.reshape(rows, k).T, dyc.reshape(rows, n))
        return gemm.matmul(dyc, wd.T), dw.astype(w_dtype)
    dy8, dys = fp8_lib.quantize(dy, recipe.bwd_dtype)
    dx = gemm.fp8_matmul(dy8, w8.T, dys, ws, out_dtype=fp8_lib.kernel_out(x_dtype))
    dw = gemm.fp8_matmul(
        x8.reshape(rows, k).T, dy8.reshape(rows, n), xs, dys, out_dtype=fp8_lib.kernel_out(w_dtype)
    )
    return dx.astype(x_dtype), dw.astype(w_dtype)


_local_fp8.defvjp(_local_fp8_fwd, _local_fp8_bwd)


def _fp8_mode(
    fn: str, x: Any, w: Any, scales: Any, recipe: Any, preferred_element_type: Any
) -> tuple[str, Any, Any] | None:
    """Checks the FP8 arguments of a call: None for a higher-precision call (no FP8 argument), else
    ``("scaled", (x_scale, w_scale), out_dtype)`` or ``("recipe", recipe, out_dtype)``
    (:func:`jax_ub.fp8.call_mode`)."""
    _validate.check_array(fn, "x", x)
    _validate.check_array(fn, "w", w)
    return fp8_lib.call_mode(fn, x, w, scales, recipe, preferred_element_type)


def _check_fp8_shapes(fn: str, x: Any, w: Any, x_layout: str, w_layout: str) -> None:
    """:func:`jax_ub._validate.check_operands`' shape checks for float8 operands."""
    x32, w32 = (jax.ShapeDtypeStruct(a.shape, jnp.float32) for a in (x, w))
    _validate.check_operands(fn, x32, w32, x_layout, w_layout, abstract_ok=True)


def _fp8_dispatch(mode, op, method, axis_name, axis, precision, x, w, *, return_full, recompute) -> Any:
    resolve.record_use(op, method)  # jax_ub.summary(): every traced call, by method
    kind, arg, out_dtype = mode
    if kind == "scaled":
        call = _FP8Call(op, method, axis_name, axis, precision, out_dtype, return_full)
        if method == methods.XLA:  # the reference: jax differentiates it (either mode)
            return _scaled_reference(call, x, w, *arg)
        return _scaled(call, x, w, *arg)
    call = _FP8Call(
        op,
        method,
        axis_name,
        axis,
        precision,
        out_dtype,
        return_full,
        recipe=arg,
        x_dtype=np.dtype(x.dtype),
        w_dtype=np.dtype(w.dtype),
        x_vma=_vma(x),
        w_vma=_vma(w),
        recompute_gathered=bool(recompute) and op == AG and not return_full,
    )
    return _recipe(call, x, w)


# ----------------------------------------------------------------------------------------------
# Public API.


def all_gather_matmul(
    x: jax.Array,
    w: jax.Array,
    axis_name: str | tuple[str, ...],
    *,
    gather_axis: int = 0,
    return_gathered: bool = False,
    precision: Any = None,
    method: str | None = None,
    recompute_gathered: bool | None = None,
    scales: tuple[jax.Array, jax.Array] | None = None,
    fp8: fp8_lib.FP8Recipe | None = None,
    preferred_element_type: Any = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """``all_gather(x, axis_name, gather_axis) @ w`` with the gather overlapped with the GEMM.

    Call inside ``jax.shard_map`` (under ``jax.jit`` or not) over a mesh with axis ``axis_name``
    of size ``tp``; the arguments are local shards. This is the column-parallel input of a
    sequence-parallel layer: SP-sharded activations in, TP-sharded features out.

    Args:
      x: `[..., m, k]` with `bfloat16`, `float16` or `float32`, this device's shard of the
        activations, gathered (tiled) along ``gather_axis`` over ``axis_name``.
      w: `[k, n_local]` with the dtype of ``x``, this device's weight columns (or a replicated w).
      axis_name: the mesh axis (or tuple of axes) to gather over.
      gather_axis: any axis of ``x`` but the last (contracting) one; negative counts from the end.
        For `[b, s, h]` activations, ``1`` (or ``-2``) gathers the sequence.
      return_gathered: also return the gathered ``x`` (e.g. to reuse in another GEMM).
      precision: ``jax.lax.Precision`` for the GEMMs (forward and backward).
      method: ``None`` (``jax_ub.config.get().method``), ``"auto"``, ``"xla"`` or a CUDA
        algorithm: ``"push"``, ``"push_merge"``, ``"ring"``, ``"all_peer"`` for the all-gather,
        ``"ring"``, ``"pipeline"``, ``"chain"``, ``"columns"`` for the reduce-scatter. The
        backward runs the dual op with the same name; a name of the other op runs one of this
        op's (:data:`jax_ub.methods.RUNS`). ``"nccl"`` is deprecated (a ``DeprecationWarning``):
        initialize the axis with ``transport="nccl"``, on which every method runs NCCL.
      recompute_gathered: save only the local shard ``x`` for the backward instead of the
        gathered x (``tp``× smaller), and re-gather it there (see Gradients). ``None``:
        ``jax_ub.config.get().recompute_gathered`` (env ``JAX_UB_RECOMPUTE_GATHERED``, default
        off). Ignored with ``return_gathered=True``: the caller holds the gathered x then anyway,
        so it is saved as usual.
      scales: ``(x_scale, w_scale)``, float32 dequantization scales of shape ``()``, for
        ``float8_e4m3fn`` / ``float8_e5m2`` x and w (not both e5m2): the result is the reference of
        :mod:`jax_ub.fp8` (dequantized product, float32 accumulation). ``x_scale`` must be the same
        on every rank of the axis (the op uses its local value).
      fp8: a :class:`jax_ub.FP8Recipe`: x and w (bfloat16, float16 or float32) are quantized with
        current scaling (x's amax ``pmax``-ed over the axis) before the all-gather, which then moves
        FP8 bytes; the backward is the recipe's (``docs/fp8.md``). Not with ``scales``.
      preferred_element_type: the output dtype of an FP8 call, ``bfloat16`` or ``float32``
        (``None``: bfloat16 with ``scales``, the recipe's ``out_dtype`` or x's dtype with ``fp8``).

    Returns:
      y: `[..., m*tp, n_local]` (``gather_axis`` grows by ``tp``) with the dtype of ``x``; with
      ``return_gathered`` the tuple ``(y, x_gathered)``, ``x_gathered`` `[..., m*tp, k]`.

    Gradients: ``dx = matmul_reduce_scatter(dy, wᵀ, scatter_axis=gather_axis)`` and
    ``dw = x_gatheredᵀ @ dy`` (the gathered x kept from the forward), summed over ``axis_name``
    when ``w`` is replicated. With ``recompute_gathered`` the backward is two bulk overlaps
    (:mod:`jax_ub.bulk`): the all-gather of the saved shard under the dgrad GEMM ``dy @ wᵀ``, then
    the reduce-scatter of that dgrad under the wgrad GEMM ``x_gatheredᵀ @ dy``.

    Differentiation is reverse mode (``jax.grad``, ``jax.vjp``) on every path; forward mode
    (``jax.jvp``, ``jax.jacfwd``, ``jax.hessian``) only on the reference path, i.e. when the method
    resolves to ``"xla"`` (``method="xla"``, ``JAX_UB_DISABLE=1``, or ``"auto"`` where the CUDA
    path is unavailable) and ``recompute_gathered`` is off. The CUDA path (and
    ``recompute_gathered``) is a ``jax.custom_vjp``: reverse mode only. A jvp of an eager
    ``shard_map`` through it gets jax_ub's message naming the option; under ``jax.jit`` jax
    applies the jvp after jax_ub's code has run, so its own ("can't apply forward-mode autodiff
    (jvp) to a custom_vjp function") stands.

    Example (4 host devices or more: ``XLA_FLAGS=--xla_force_host_platform_device_count=4``)::

        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import Mesh, PartitionSpec as P
        import jax_ub

        mesh = Mesh(np.array(jax.devices()[:4]), ("tp",))
        x = jnp.ones((2, 8, 16), jnp.bfloat16)     # [b, s, h], s sharded over "tp"
        w = jnp.ones((16, 32), jnp.bfloat16)       # [h, f], f sharded over "tp"
        f = jax.jit(jax.shard_map(
            lambda x, w: jax_ub.all_gather_matmul(x, w, "tp", gather_axis=1), mesh=mesh,
            in_specs=(P(None, "tp"), P(None, "tp")), out_specs=P(None, None, "tp")))
        y = f(x, w)                                # [2, 8, 32] == x @ w
    """
    fn = "all_gather_matmul"
    axis_name = _validate.one_axis(axis_name) or axis_name  # ("tp",) is "tp"
    mode = _check_operands(fn, x, w, "[..., m, k]", "[k, n_local]", scales, fp8, preferred_element_type)
    axis = _validate.normalize_axis(fn, "gather_axis", gather_axis, x.shape)
    _validate.check_nonempty_axis(fn, "gather_axis", axis, x.shape, "all-gather")
    method = None if method is None else _requested(method, fn)
    tp = _validate.bound_axis_size(fn, axis_name)
    _validate.check_bool(fn, "return_gathered", return_gathered)
    if recompute_gathered is None:
        recompute_gathered = config.get().recompute_gathered
    _validate.check_bool(fn, "recompute_gathered", recompute_gathered)
    return _run(
        AG,
        fn,
        mode,
        _resolve_for_size(method, tp, x, w, fn=fn),  # here: its warnings' stacklevel
        tp,
        axis_name,
        axis,
        precision,
        x,
        w,
        return_full=bool(return_gathered),
        recompute=bool(recompute_gathered),
    )


def matmul_reduce_scatter(
    x: jax.Array,
    w: jax.Array,
    axis_name: str | tuple[str, ...],
    *,
    scatter_axis: int = 0,
    precision: Any = None,
    method: str | None = None,
    scales: tuple[jax.Array, jax.Array] | None = None,
    fp8: fp8_lib.FP8Recipe | None = None,
    preferred_element_type: Any = None,
) -> jax.Array:
    """``reduce_scatter(x @ w, axis_name, scatter_axis)`` with the reduce-scatter overlapped.

    Call inside ``jax.shard_map`` over a mesh with axis ``axis_name`` of size ``tp``; the arguments
    are local shards. This is the row-parallel output of a sequence-parallel layer: TP-sharded
    features in, partial sums reduced and SP-sharded out.

    Args:
      x: `[..., M, k_local]` with `bfloat16`, `float16` or `float32`, this device's slice of the
        contracting features; ``x.shape[scatter_axis]`` must be divisible by ``tp``.
      w: `[k_local, n]` with the dtype of ``x``, this device's weight rows.
      axis_name: the mesh axis (or tuple of axes) to sum and scatter over.
      scatter_axis: any axis of ``x`` but the last (contracting) one; negative counts from the end.
      precision: ``jax.lax.Precision`` for the GEMMs (forward and backward).
      method: as in :func:`all_gather_matmul`.
      scales, fp8, preferred_element_type: FP8, as in :func:`all_gather_matmul`, except that each
        rank's scales are its own (its partial product is dequantized before the float32
        reduction), and the recipe's backward gathers dy in FP8 with a ``pmax``-ed scale.

    Returns:
      `[..., M/tp, n]` (``scatter_axis`` shrinks by ``tp``) with the dtype of ``x``: this device's
      slice of the sum over ``axis_name`` of ``x @ w``.

    Gradients: ``(dx, dy_gathered) = all_gather_matmul(dy, wᵀ, gather_axis=scatter_axis,
    return_gathered=True)`` and ``dw = xᵀ @ dy_gathered``. Forward mode only on the reference
    path, as in :func:`all_gather_matmul`: on the CUDA path (a ``jax.custom_vjp``) reverse mode
    only.

    Example (4 host devices or more: ``XLA_FLAGS=--xla_force_host_platform_device_count=4``)::

        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import Mesh, PartitionSpec as P
        import jax_ub

        mesh = Mesh(np.array(jax.devices()[:4]), ("tp",))
        x = jnp.ones((2, 8, 32), jnp.float32)      # [b, s, f], f sharded over "tp"
        w = jnp.ones((32, 16), jnp.float32)        # [f, h], f sharded over "tp"
        f = jax.jit(jax.shard_map(
            lambda x, w: jax_ub.matmul_reduce_scatter(x, w, "tp", scatter_axis=1), mesh=mesh,
            in_specs=(P(None, None, "tp"), P("tp")), out_specs=P(None, "tp")))
        y = f(x, w)                                # [2, 8, 16] == x @ w, s sharded over "tp"
    """
    fn = "matmul_reduce_scatter"
    axis_name = _validate.one_axis(axis_name) or axis_name  # ("tp",) is "tp"
    mode = _check_operands(fn, x, w, "[..., M, k_local]", "[k_local, n]", scales, fp8, preferred_element_type)
    axis = _validate.normalize_axis(fn, "scatter_axis", scatter_axis, x.shape)
    _validate.check_nonempty_axis(fn, "scatter_axis", axis, x.shape, "reduce-scatter")
    method = None if method is None else _requested(method, fn)
    tp = _validate.bound_axis_size(fn, axis_name)
    _validate.check_divisible(fn, "scatter_axis", axis, x.shape, axis_name, tp)
    method = _resolve_for_size(method, tp, x, w, fn=fn)  # here: its warnings' stacklevel
    return _run(
        RS, fn, mode, method, tp, axis_name, axis, precision, x, w, return_full=False, recompute=False
    )


def _check_operands(
    fn: str, x: Any, w: Any, x_layout: str, w_layout: str, scales: Any, recipe: Any, preferred: Any
) -> tuple[str, Any, Any] | None:
    """The operands' checks of a public op; returns its FP8 mode (:func:`_fp8_mode`)."""
    mode = _fp8_mode(fn, x, w, scales, recipe, preferred)
    if mode is not None and mode[0] == "scaled":
        _check_fp8_shapes(fn, x, w, x_layout, w_layout)
    else:
        _validate.check_operands(fn, x, w, x_layout, w_layout)
    return mode


def _run(op, fn, mode, method, tp, axis_name, axis, precision, x, w, *, return_full, recompute) -> Any:
    """A checked call of a public op with its resolved ``method``: the FP8 dispatch (``mode``) or
    the plain one."""
    precision = _static(precision, fn)
    if mode is not None:
        return _fp8_dispatch(
            mode, op, method, axis_name, axis, precision, x, w, return_full=return_full, recompute=recompute
        )
    call = _call_for(
        op, method, axis_name, axis, precision, x, w, return_full=return_full, recompute_gathered=recompute
    )
    _note(call, tp, x, w)
    return _dispatch(call, x, w)


def _note(call: _Call, tp: int, x: jax.Array, w: jax.Array) -> None:
    """Records the call's shape for ``python -m jax_ub.bench tune`` when recording is on
    (:mod:`jax_ub.tuning`), with the dual op its backward runs unless that backward re-gathers
    (bulk ops). An axis of size 1 communicates nothing, and an empty operand runs the reference:
    there is nothing to tune (and ``bench tune`` refuses zero sizes). Nor is there over several
    mesh axes, or over an axis that a ``jax.vmap``/``pmap`` binds: those calls never run the CUDA
    path."""
    resolve.record_use(call.op, call.method)  # jax_ub.summary(): every traced call, by method
    if (
        tp > 1
        and 0 not in (*x.shape, *w.shape)
        and isinstance(call.axis_name, str)
        and _validate.bound_by_shard_map(call.axis_name)
    ):
        tuning.note_call(call.op, tp, x.dtype, x.shape, w.shape, backward=not call.recompute_gathered)


_static = _validate.static_precision
