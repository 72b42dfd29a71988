"""The CUDA implementation of the TP primitives (``csrc/ffi/overlap.cc``): :func:`ag_gemm` and
:func:`gemm_rs`, the forwards :mod:`jax_ub.ops` runs for every CUDA method (:mod:`jax_ub.methods`
says which schedule a method runs; :mod:`jax_ub.schedule` models how it is cut into pieces).

These run only when the extension is loaded, a CUDA GPU is present and :func:`jax_ub.initialize`
was called for the mesh axis; :mod:`jax_ub.ops` falls back to the reference otherwise (``auto``) or
raises (an explicit CUDA method).

Also here, for code that imports them from this module: the bare collectives
(:func:`all_gather`, :func:`reduce_scatter`: :mod:`jax_ub.collectives`), the timeline hooks
(:func:`trace_enable`, :func:`trace_collect`: :mod:`jax_ub.trace`) and :func:`explain` /
:func:`choose` (:mod:`jax_ub.resolve`).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jax_ub import _ext, _ffi, _launch, comm, methods, schedule
from jax_ub import fp8 as fp8_lib
from jax_ub.collectives import all_gather, reduce_scatter  # noqa: F401  (re-exported)
from jax_ub.resolve import choose, explain  # noqa: F401  (re-exported)
from jax_ub.trace import trace_collect, trace_enable  # noqa: F401  (re-exported)

_set_for = _launch.comm_set  # the name older callers use
# The method names whose all-gather may skip the gathered x: their peers' chunks land in the
# registered buffer, which the GEMMs read.
_SKIP_GATHERED = (methods.PUSH, methods.PUSH_MERGE)


def _fp8_operands(what, x, w, x_scale, w_scale, out_dtype, fast_accum=False):
    """``(w as the kernel takes it, (x_scale, w_scale), y's dtype)``: for float8 operands w stored
    ``[n, k]`` (cuBLASLt's FP8 layout), both scales (float32, shape ``()``), y bfloat16 (default) or
    float32; for the other dtypes w itself, no scales, x's dtype. Errors name expected and got."""
    fp8 = fp8_lib.is_fp8(x.dtype) or fp8_lib.is_fp8(w.dtype)
    if not isinstance(fast_accum, bool):
        raise TypeError(f"{what}: fast_accum must be a bool; got {fast_accum!r}")
    if not fp8:
        if fast_accum:
            raise TypeError(
                f"{what}: fast_accum is for float8 operands (cuBLASLt's FP8 GEMMs); got x "
                f"{jnp.dtype(x.dtype).name}, w {jnp.dtype(w.dtype).name} with fast_accum=True"
            )
        if x_scale is not None or w_scale is not None or out_dtype is not None:
            raise TypeError(
                f"{what}: x_scale, w_scale and out_dtype are for float8 operands; got x "
                f"{jnp.dtype(x.dtype).name}, w {jnp.dtype(w.dtype).name} with "
                f"x_scale={'given' if x_scale is not None else None}, "
                f"w_scale={'given' if w_scale is not None else None}, out_dtype={out_dtype!r}"
            )
        return w, (), jnp.dtype(x.dtype)
    fp8_lib.check_pair(what, x.dtype, w.dtype)
    if x_scale is None or w_scale is None:
        raise TypeError(f"{what}: float8 operands need x_scale and w_scale (float32, shape ()); got None")
    xs, ws = fp8_lib.check_scales(what, (x_scale, w_scale))
    out = fp8_lib.out_dtype(what, out_dtype, jnp.bfloat16)
    k, n = w.shape
    if k % 16 or n % 16:
        raise ValueError(
            f"{what}: the FP8 CUDA path needs w's k and n to be multiples of 16 (rows of 16-byte "
            f"multiples, cuBLASLt's FP8 layout); got w of shape {tuple(w.shape)}"
        )
    return w.T, (xs, ws), out


def ag_gemm(
    x,
    w,
    *,
    axis_name,
    axis,
    precision,
    method="ring",
    need_full: bool = True,
    x_scale=None,
    w_scale=None,
    out_dtype=None,
    fast_accum: bool = False,
):
    """(y, x_gathered) of ``all_gather(x, axis) @ w`` through the CUDA overlap kernel running
    ``method``'s all-gather schedule (on transport nccl: the NCCL schedule). ``need_full``: the
    caller uses x_gathered; else it may be None.

    FP8: x and w float8 (:mod:`jax_ub.fp8`'s pairs), ``x_scale`` / ``w_scale`` their float32
    dequantization scales (x's the same on every rank), ``out_dtype`` y's (bfloat16 default, or
    float32): the all-gather moves the float8 bytes, every chunk GEMM is cuBLASLt's FP8 GEMM
    (fp32 accumulation; ``fast_accum``: cuBLASLt's fast accumulation, see
    :func:`jax_ub.gemm.fp8_matmul`), x_gathered is float8. w is given ``[k, n]`` (k, n multiples of
    16)."""
    what = "all_gather_matmul"
    w_k, scales, y_dtype = _fp8_operands(what, x, w, x_scale, w_scale, out_dtype, fast_accum)
    fp8 = bool(scales)
    s = _launch.comm_set(axis_name, what, method)
    _ext.ensure_registered()
    ipc = s.transport != "nccl"
    sched = methods.runs(methods.AG, method)
    x2 = _launch.front(x, axis)
    es = jnp.dtype(x.dtype).itemsize
    comm.ensure_capacity(s, s.world * math.prod(x2.shape) * es)  # push lands every shard
    rows_local = math.prod(x2.shape[:-1])
    n, k = w.shape[1], x2.shape[-1]
    types = dict(w_dtype=w.dtype, out_dtype=y_dtype, fast_accum=fast_accum) if fp8 else {}
    _launch.warm(s, rows_local, n, k, x.dtype, precision, **types)
    rows = (s.world * x2.shape[0], *x2.shape[1:-1])
    y_t = _ffi.result_type((*rows, n), y_dtype, x2, w)
    # The gathered x is an output only when someone uses it: push and nccl land peers' chunks in
    # the registered buffer, and a zero-row result tells the kernel to skip the copies into it.
    keep = need_full or (method not in _SKIP_GATHERED and ipc)
    xg_t = _ffi.result_type((*rows, k) if keep else (0, k), x.dtype, x2, w)
    pieces = schedule.ag_push_pieces(method, rows_local, n, k, es, s.world) if ipc else 1
    if pieces > 1:  # the last chunk's pieces are shorter GEMMs: prepare that shape too
        _launch.warm(s, rows_local // pieces, n, k, x.dtype, precision, **types)
    merge = ipc and schedule.ag_push_merge(method, s.world, pieces)
    if merge:  # the peers' rows of every rank: 1 to world-1 chunks in one GEMM
        for c in range(2, s.world):
            _launch.warm(s, c * rows_local, n, k, x.dtype, precision, **types)
    y, xg, _ = _ffi.call("jax_ub_ag_gemm", (y_t, xg_t, _ffi.workspace_type(x2, w)))(
        _launch.checked(x2, s, what),
        w_k,
        *scales,
        set_id=s.set_id,
        algo=_ffi.schedule_code(methods.AG, sched),
        tf32=_ffi.tf32_allowed(precision),
        pieces=np.int32(pieces),
        merge=merge,
        fast_accum=fast_accum,
    )
    return _launch.back(y, axis), (_launch.back(xg, axis) if keep else None)


def gemm_rs(
    x,
    w,
    *,
    axis_name,
    axis,
    precision,
    method="ring",
    need_full: bool = True,
    x_scale=None,
    w_scale=None,
    out_dtype=None,
    fast_accum: bool = False,
):
    """(y, x) of ``reduce_scatter(x @ w, axis)`` through the CUDA overlap kernel running
    ``method``'s reduce-scatter schedule (on transport nccl: the NCCL schedule).

    FP8: x and w float8, ``x_scale`` / ``w_scale`` this rank's float32 dequantization scales,
    ``out_dtype`` y's (bfloat16 default, or float32): each partial is an FP8 GEMM dequantized in its
    epilogue (``fast_accum``: with cuBLASLt's fast accumulation), written (and pushed) in
    ``out_dtype`` and summed in fp32. w is given ``[k, n]``."""
    del need_full  # x is the caller's
    what = "matmul_reduce_scatter"
    w_k, scales, y_dtype = _fp8_operands(what, x, w, x_scale, w_scale, out_dtype, fast_accum)
    types = dict(w_dtype=w.dtype, out_dtype=y_dtype, fast_accum=fast_accum) if scales else {}
    s = _launch.comm_set(axis_name, what, method)
    _ext.ensure_registered()
    if s.transport == "nccl":  # the NCCL schedule runs whatever is named: no staging or pieces of ipc's
        method = methods.NCCL
    sched = methods.runs(methods.RS, method)
    x2 = _launch.front(x, axis)
    es = jnp.dtype(y_dtype).itemsize  # the partials' (the GEMM output's) element
    M, n = x2.shape[0], w.shape[1]
    inner = math.prod(x2.shape[1:-1])
    comm.ensure_capacity(s, M * inner * n * es)
    _launch.warm(s, (M // s.world) * inner, n, x2.shape[-1], x.dtype, precision, **types)
    out_shape = (M // s.world, *x2.shape[1:-1], n)
    y_t = _ffi.result_type(out_shape, y_dtype, x2, w)
    columns = method != methods.NCCL and sched == methods.COLUMNS
    chain = method != methods.NCCL and sched == methods.CHAIN
    staged = s.world if columns else s.world - 1  # columns stages all M rows
    staging = max(staged * (M // s.world) * inner * n * es, 256)
    st_t = _ffi.result_type((staging,), jnp.uint8, x2, w)
    rows = (M // s.world) * inner
    # Column blocks of an FP8 GEMM need a multiple of 16 columns (cuBLASLt's FP8 kernels), i.e.
    # 16-byte blocks of a one-byte type: the schedule is asked as for one.
    col_es = 1 if scales else es
    splits = schedule.rs_splits(method, rows, n, col_es, x2.shape[-1])
    cols = chain and schedule.rs_chain_cols(splits, n, col_es)
    # The pieces' GEMMs are other shapes: prepare (tune) them too.
    pm, pn, ld = (rows, n // splits, n) if cols else (rows // splits, n, 0)
    if columns:  # one GEMM per column block over all M rows
        pm, pn, ld = M * inner, n // splits, n
    if splits > 1 or columns:  # columns: a GEMM over all M rows, even in one block
        _launch.warm(s, pm, pn, x2.shape[-1], x.dtype, precision, ld=ld, **types)
    if chain:  # every step after the first adds an addend
        _launch.warm(s, pm, pn, x2.shape[-1], x.dtype, precision, accumulate=True, ld=ld, **types)
    y, _, _ = _ffi.call("jax_ub_gemm_rs", (y_t, st_t, _ffi.workspace_type(x2, w)))(
        _launch.checked(x2, s, what),
        w_k,
        *scales,
        set_id=s.set_id,
        algo=_ffi.schedule_code(methods.RS, sched),
        tf32=_ffi.tf32_allowed(precision),
        reduce_blocks=np.int32(schedule.REDUCE_BLOCKS),
        splits=np.int32(splits),
        split_cols=cols,
        fast_accum=fast_accum,
    )
    return _launch.back(y, axis), x
