"""Bulk overlap: a collective running under an *independent* GEMM, in one call (the Python side of
``csrc/ffi/bulk.cc``: the public ops, their autodiff and their CUDA implementation).

The backward pass of a tensor-parallel layer has work of this shape (TransformerEngine's "bulk"
overlap): re-gather the saved input shard while the dgrad GEMM runs, or reduce-scatter the dgrad
while the wgrad GEMM runs. Inside ``shard_map`` over ``axis_name``:

* :func:`bulk_all_gather` ``(x, a, b)`` → ``(all_gather(x, axis, tiled), a @ b)``
* :func:`bulk_reduce_scatter` ``(x, a, b)`` → ``(psum_scatter(x, axis, tiled), a @ b)``

On GPUs (after :func:`jax_ub.initialize`) the collective moves by copy engine while cuBLASLt runs
the GEMM; the reduce-scatter's fp32 sum runs once the GEMM ends, on the whole GPU (or beside it on
``JAX_UB_BULK_REDUCE_SMS`` SMs kept from it). Same-device copies use SMs, so the all-gather's
publish and own-rows copies run as a kernel on ``JAX_UB_BULK_COPY_SMS`` SMs that the GEMM's first
rows leave free (0: the GEMM starts after those copies, tens of microseconds). Elsewhere, or with
``method="xla"``, the same numbers come from ``lax`` collectives and ``jnp.matmul``. Both are
differentiable (the backward is the reference's).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_ub import _ext, _ffi, _launch, _validate, comm, methods, reference, resolve, schedule
from jax_ub import fp8 as fp8_lib

__all__ = ["bulk_all_gather", "bulk_reduce_scatter"]

_WHAT = {methods.AG: "bulk_all_gather", methods.RS: "bulk_reduce_scatter"}
_OP = {methods.AG: methods.BULK_AG, methods.RS: methods.BULK_RS}


def _reference(kind: str, x, a, b, axis_name, axis, precision):
    """(the collective of x, a @ b); ``a`` None: no GEMM (its result None)."""
    if kind == methods.AG:
        out = lax.all_gather(x, axis_name, axis=axis, tiled=True)
    else:
        out = lax.psum_scatter(x, axis_name, scatter_dimension=axis, tiled=True)
    return out, (None if a is None else reference.matmul(a, b, precision=precision))


def _cuda(kind, x, a, b, axis_name, axis, precision, method):
    """(collective(x), a @ b) in one custom call (``jax_ub_bulk`` of ``csrc/ffi/bulk.cc``): the
    collective moves by copy engine under the GEMM. An all-gather's same-device copies run beside
    the GEMM's first rows (``config.bulk_copy_sms``); a reduce-scatter's fp32 sum runs after the
    GEMM, or beside it on ``config.bulk_reduce_sms`` SMs kept from it
    (:func:`jax_ub.schedule.bulk_side`)."""
    what = _WHAT[kind]
    s = _launch.comm_set(axis_name, what)
    _ext.ensure_registered()
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0] or a.dtype != b.dtype:
        raise ValueError(
            f"{what}: the independent GEMM must be a[m, k] @ b[k, n] of one dtype; "
            f"got a {a.shape} {a.dtype}, b {b.shape} {b.dtype}"
        )
    gather = kind == methods.AG
    x2 = _launch.front(x, axis % x.ndim)
    x3 = x2.reshape(x2.shape[0], -1)
    es = jnp.dtype(x.dtype).itemsize
    comm.ensure_capacity(s, (s.world if gather else 1) * math.prod(x2.shape) * es)
    side_sms, side_rows = schedule.bulk_side(
        kind, math.prod(x2.shape) * es, a.shape[0], a.shape[1], b.shape[1], a.dtype
    )
    if gather and s.transport == "nccl":  # no same-device copies: NCCL's kernels go first
        side_sms, side_rows = 0, 0
    if side_rows > 0:  # both GEMMs of the op: its first rows beside the collective, then the rest
        _launch.warm(s, side_rows, b.shape[1], a.shape[1], a.dtype, precision, reserve_sms=side_sms)
    if side_rows < a.shape[0]:
        _launch.warm(s, a.shape[0] - side_rows, b.shape[1], a.shape[1], a.dtype, precision)
    if gather:
        out_t = _ffi.result_type((s.world * x3.shape[0], x3.shape[1]), x.dtype, x3)
    else:
        if x3.shape[0] % s.world:
            raise ValueError(
                f"{what}: dimension {axis} of x ({x3.shape[0]}) is not divisible by the axis size {s.world}"
            )
        out_t = _ffi.result_type((x3.shape[0] // s.world, x3.shape[1]), x.dtype, x3)
    algo = _ffi.schedule_code(kind, methods.runs(_OP[kind], method))
    gy_t = _ffi.result_type((a.shape[0], b.shape[1]), a.dtype, a, b)
    out, gy, _ = _ffi.call("jax_ub_bulk", (out_t, gy_t, _ffi.workspace_type(a, b)))(
        _launch.checked(x3, s, what),
        a,
        b,
        set_id=s.set_id,
        kind=_ffi.bulk_kind_code(kind),
        algo=algo,
        tf32=_ffi.tf32_allowed(precision),
        side_sms=np.int32(side_sms),
        side_rows=np.int64(side_rows),
    )
    rows = s.world * x2.shape[0] if gather else x2.shape[0] // s.world
    return _launch.back(out.reshape(rows, *x2.shape[1:]), axis % x.ndim), gy


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 4, 5, 6, 7))
def _bulk(kind, x, a, b, axis_name, axis, precision, method):
    return _cuda(kind, x, a, b, axis_name, axis, precision, method)


def _bulk_fwd(kind, x, a, b, axis_name, axis, precision, method):
    return _cuda(kind, x, a, b, axis_name, axis, precision, method), (x, a, b)


def _bulk_bwd(kind, axis_name, axis, precision, method, res, cts):
    x, a, b = res
    _, vjp = jax.vjp(lambda x, a, b: _reference(kind, x, a, b, axis_name, axis, precision), x, a, b)
    return vjp(cts)


_bulk.defvjp(_bulk_fwd, _bulk_bwd)


# ----------------------------------------------------------------------------------------------
# FP8 GEMMs (jax_ub.fp8): float8 a and b with scales, or a recipe that quantizes them. The
# collective moves x as it is (an all-gather may move float8 x too).


def _fp8_mode(what: str, kind: str, x, a, b, scales, recipe, preferred_element_type):
    """None for a call without FP8, else ``(kind, scales or recipe, out_dtype)``: the checks of
    :mod:`jax_ub.ops`' FP8 calls (:func:`jax_ub.fp8.call_mode`), for the GEMM ``a @ b``."""
    if fp8_lib.is_fp8(x.dtype) and kind == methods.RS:
        raise TypeError(
            f"{what}: `x` must have dtype {_validate.DTYPE_NAMES} (a reduce-scatter sums it); got "
            f"{np.dtype(x.dtype).name}"
        )
    return fp8_lib.call_mode(what, a, b, scales, recipe, preferred_element_type, ("a", "b"))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _recipe_gemm(recipe, out_dtype, in_dtype, a, b):
    """``a @ b`` of the operands (dtype ``in_dtype``) quantized with current scaling (each its own
    scale), in ``out_dtype``."""
    return _recipe_gemm_fwd(recipe, out_dtype, in_dtype, a, b)[0]


def _recipe_gemm_fwd(recipe, out_dtype, in_dtype, a, b):
    a8, a_s = fp8_lib.quantize(a, recipe.fwd_dtype)
    b8, b_s = fp8_lib.quantize(b, recipe.fwd_dtype)
    return fp8_lib.scaled_dot(a8, b8, a_s, b_s, out_dtype), (a8, a_s, b8, b_s)


def _recipe_gemm_bwd(recipe, out_dtype, in_dtype, res, dy):
    """Straight-through for the quantization, in the operands' precision: a bulk op is itself a
    piece of a backward pass (the FP8 backward of the hybrid recipe is :mod:`jax_ub.ops`')."""
    a8, a_s, b8, b_s = res
    ad, bd = fp8_lib.dequantize(a8, a_s, in_dtype), fp8_lib.dequantize(b8, b_s, in_dtype)
    dy = dy.astype(in_dtype)
    return reference.matmul(dy, bd.T), reference.matmul(ad.T, dy)


_recipe_gemm.defvjp(_recipe_gemm_fwd, _recipe_gemm_bwd)


def _fp8_gemm(mode, a, b):
    kind, arg, out_dtype = mode
    if kind == "scaled":
        return fp8_lib.scaled_dot(a, b, *arg, out_dtype)
    return _recipe_gemm(arg, np.dtype(out_dtype), np.dtype(a.dtype), a, b)


def _run(kind: str, x, a, b, axis_name, axis, precision, method, fp8_args=(None, None, None)):
    what = _WHAT[kind]
    axis_name = _validate.one_axis(axis_name) or axis_name  # ("tp",) is "tp"
    precision = _validate.static_precision(precision, what)
    method = None if method is None else resolve.requested(method, what, stacklevel=5)
    for name, v in (("x", x), ("a", a), ("b", b)):
        _validate.check_array(what, name, v)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(
            f"{what}: the GEMM operands must be a `[m, k]` and b `[k, n]`; got a "
            f"{_validate.shape_str(a.shape)}, b {_validate.shape_str(b.shape)}"
        )
    mode = _fp8_mode(what, kind, x, a, b, *fp8_args)
    if mode is None and a.dtype != b.dtype:
        raise TypeError(
            f"{what}: `a` and `b` must have the same dtype; got a "
            f"{np.dtype(a.dtype).name}, b {np.dtype(b.dtype).name}"
        )
    # what the CUDA path moves and multiplies (FP8 GEMM operands: checked above; an all-gather
    # moves float8 x as it is)
    checked = [] if fp8_lib.is_fp8(x.dtype) else [("x", x)]
    for name, v in [*checked, *([("a", a)] if mode is None else [])]:
        if np.dtype(v.dtype) not in _validate.SUPPORTED_DTYPES:
            raise TypeError(
                f"{what}: `{name}` must have dtype {_validate.DTYPE_NAMES}; got {np.dtype(v.dtype).name}"
            )
    axis = _validate.normalize_axis(what, "axis", axis, x.shape, last_ok=True)
    _validate.check_nonempty_axis(
        what, "axis", axis, x.shape, "all-gather" if kind == methods.AG else "reduce-scatter"
    )
    tp = _validate.bound_axis_size(what, axis_name)
    if kind == methods.RS:
        _validate.check_divisible(what, "axis", axis, x.shape, axis_name, tp)
    m = resolve.for_size(method, tp, x, a, b, fn=what)
    if m == methods.AUTO:
        m = resolve.bulk_auto(what, axis_name)
    resolve.record_use(f"bulk_{kind}", m)  # jax_ub.summary(): every traced call, by method
    if mode is not None:
        if m != methods.XLA:
            raise NotImplementedError(
                f"{what}: FP8 GEMMs (scales= or fp8=) run on the reference path only; method {m!r} "
                f"asks for the CUDA bulk path: pass method='xla'"
            )
        return _reference(kind, x, None, None, axis_name, axis, precision)[0], _fp8_gemm(mode, a, b)
    if m == methods.XLA:
        return _reference(kind, x, a, b, axis_name, axis, precision)
    if m == methods.NCCL:
        s = comm.get(axis_name)
        if s is None or s.transport != "nccl":
            raise ValueError(
                f"{what}: method='nccl' needs jax_ub.initialize(mesh, "
                f"axis={axis_name!r}, transport='nccl'); the axis has "
                f"{'no communicator' if s is None else 'transport ' + repr(s.transport)}"
            )
        m = methods.BULK_DEFAULT  # a set with transport nccl runs every algorithm over NCCL
    return _bulk(kind, x, a, b, axis_name, axis, precision, m)


def bulk_all_gather(
    x: jax.Array,
    a: jax.Array,
    b: jax.Array,
    axis_name: Any,
    *,
    axis: int = 0,
    precision: Any = None,
    method: str | None = None,
    scales: tuple[jax.Array, jax.Array] | None = None,
    fp8: fp8_lib.FP8Recipe | None = None,
    preferred_element_type: Any = None,
):
    """``(lax.all_gather(x, axis_name, axis=axis, tiled=True), a @ b)``, overlapped on GPUs.

    x: the local shard; a[m, k], b[k, n]: an independent GEMM (e.g. the dgrad of the layer whose
    input x is re-gathered). axis: the dimension of x gathered. precision: the GEMM's, as for
    ``jnp.matmul`` (float32 operands follow XLA's TF32 rule). method: ``None`` (the configured
    one), ``"auto"``, ``"xla"`` or an all-gather algorithm (``"ring"``, ``"all_peer"``,
    ``"push"``; ``"push_merge"`` runs push's all-gather); the other names that
    :func:`jax_ub.all_gather_matmul` accepts run the all-gather algorithm they run there.
    scales, fp8, preferred_element_type: an FP8 GEMM, as in :func:`jax_ub.all_gather_matmul`
    (``scales=(a_scale, b_scale)`` for float8 a and b; ``fp8=FP8Recipe()`` quantizes them, the
    backward straight-through in their precision); x may be float8 too (it is only moved). The
    reference path only (``method="xla"``).
    """
    return _run(
        methods.AG, x, a, b, axis_name, axis, precision, method, (scales, fp8, preferred_element_type)
    )


def bulk_reduce_scatter(
    x: jax.Array,
    a: jax.Array,
    b: jax.Array,
    axis_name: Any,
    *,
    axis: int = 0,
    precision: Any = None,
    method: str | None = None,
    scales: tuple[jax.Array, jax.Array] | None = None,
    fp8: fp8_lib.FP8Recipe | None = None,
    preferred_element_type: Any = None,
):
    """``(lax.psum_scatter(x, axis_name, scatter_dimension=axis, tiled=True), a @ b)``, overlapped
    on GPUs (fp32 accumulation in the reduction).

    x: the full-extent partial sums (dimension ``axis`` divisible by the axis size); a[m, k],
    b[k, n]: an independent GEMM (e.g. the wgrad while the dgrad is reduce-scattered). precision:
    the GEMM's, as for ``jnp.matmul``. method: ``None`` (the configured one), ``"auto"``,
    ``"xla"`` or a reduce-scatter algorithm (``"ring"``, ``"pipeline"``); the other names that
    :func:`jax_ub.matmul_reduce_scatter` accepts run the reduce-scatter algorithm they run there.
    scales, fp8, preferred_element_type: an FP8 GEMM, as in :func:`bulk_all_gather`.
    """
    return _run(
        methods.RS, x, a, b, axis_name, axis, precision, method, (scales, fp8, preferred_element_type)
    )
