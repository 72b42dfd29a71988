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
from jax_ub.collectives import all_gather, reduce_scatter  # noqa: F401  (re-exported)
from jax_ub.resolve import choose, explain  # noqa: F401  (re-exported)
from jax_ub.trace import trace_collect, trace_enable  # noqa: F401  (re-exported)

_set_for = _launch.comm_set  # the name older callers use
# The method names whose all-gather may skip the gathered x: their peers' chunks land in the
# registered buffer, which the GEMMs read.
_SKIP_GATHERED = (methods.PUSH, methods.PUSH_MERGE)


def ag_gemm(x, w, *, axis_name, axis, precision, method="ring", need_full: bool = True):
    """(y, x_gathered) of ``all_gather(x, axis) @ w`` through the CUDA overlap kernel running
    ``method``'s all-gather schedule (on transport nccl: the NCCL schedule). ``need_full``: the
    caller uses x_gathered; else it may be None."""
    s = _launch.comm_set(axis_name, "all_gather_matmul", method)
    _ext.ensure_registered()
    ipc = s.transport != "nccl"
    sched = methods.runs(methods.AG, method)
    x2 = _launch.front(x, axis)
    es = jnp.dtype(x.dtype).itemsize
    comm.ensure_capacity(s, s.world * math.prod(x2.shape) * es)  # push lands every shard
    rows_local = math.prod(x2.shape[:-1])
    n, k = w.shape[1], x2.shape[-1]
    _launch.warm(s, rows_local, n, k, x.dtype, precision)
    rows = (s.world * x2.shape[0], *x2.shape[1:-1])
    y_t = _ffi.result_type((*rows, n), x.dtype, x2, w)
    # The gathered x is an output only when someone uses it: push and nccl land peers' chunks in
    # the registered buffer, and a zero-row result tells the kernel to skip the copies into it.
    keep = need_full or (method not in _SKIP_GATHERED and ipc)
    xg_t = _ffi.result_type((*rows, k) if keep else (0, k), x.dtype, x2, w)
    pieces = schedule.ag_push_pieces(method, rows_local, n, k, es, s.world) if ipc else 1
    if pieces > 1:  # the last chunk's pieces are shorter GEMMs: prepare that shape too
        _launch.warm(s, rows_local // pieces, n, k, x.dtype, precision)
    merge = ipc and schedule.ag_push_merge(method, s.world, pieces)
    if merge:  # the peers' rows of every rank: 1 to world-1 chunks in one GEMM
        for c in range(2, s.world):
            _launch.warm(s, c * rows_local, n, k, x.dtype, precision)
    y, xg, _ = _ffi.call("jax_ub_ag_gemm", (y_t, xg_t, _ffi.workspace_type(x2, w)))(
        _launch.checked(x2, s, "all_gather_matmul"),
        w,
        set_id=s.set_id,
        algo=_ffi.schedule_code(methods.AG, sched),
        tf32=_ffi.tf32_allowed(precision),
        pieces=np.int32(pieces),
        merge=merge,
    )
    return _launch.back(y, axis), (_launch.back(xg, axis) if keep else None)


def gemm_rs(x, w, *, axis_name, axis, precision, method="ring", need_full: bool = True):
    """(y, x) of ``reduce_scatter(x @ w, axis)`` through the CUDA overlap kernel running
    ``method``'s reduce-scatter schedule (on transport nccl: the NCCL schedule)."""
    del need_full  # x is the caller's
    s = _launch.comm_set(axis_name, "matmul_reduce_scatter", method)
    _ext.ensure_registered()
    if s.transport == "nccl":  # the NCCL schedule runs whatever is named: no staging or pieces of ipc's
        method = methods.NCCL
    sched = methods.runs(methods.RS, method)
    x2 = _launch.front(x, axis)
    es = jnp.dtype(x.dtype).itemsize
    M, n = x2.shape[0], w.shape[1]
    inner = math.prod(x2.shape[1:-1])
    comm.ensure_capacity(s, M * inner * n * es)
    _launch.warm(s, (M // s.world) * inner, n, x2.shape[-1], x.dtype, precision)
    out_shape = (M // s.world, *x2.shape[1:-1], n)
    y_t = _ffi.result_type(out_shape, x.dtype, x2, w)
    columns = method != methods.NCCL and sched == methods.COLUMNS
    chain = method != methods.NCCL and sched == methods.CHAIN
    staged = s.world if columns else s.world - 1  # columns stages all M rows
    staging = max(staged * (M // s.world) * inner * n * es, 256)
    st_t = _ffi.result_type((staging,), jnp.uint8, x2, w)
    rows = (M // s.world) * inner
    splits = schedule.rs_splits(method, rows, n, es, x2.shape[-1])
    cols = chain and schedule.rs_chain_cols(splits, n, es)
    # The pieces' GEMMs are other shapes: prepare (tune) them too.
    pm, pn, ld = (rows, n // splits, n) if cols else (rows // splits, n, 0)
    if columns:  # one GEMM per column block over all M rows
        pm, pn, ld = M * inner, n // splits, n
    if splits > 1 or columns:  # columns: a GEMM over all M rows, even in one block
        _launch.warm(s, pm, pn, x2.shape[-1], x.dtype, precision, ld=ld)
    if chain:  # every step after the first adds an addend
        _launch.warm(s, pm, pn, x2.shape[-1], x.dtype, precision, accumulate=True, ld=ld)
    y, _, _ = _ffi.call("jax_ub_gemm_rs", (y_t, st_t, _ffi.workspace_type(x2, w)))(
        _launch.checked(x2, s, "matmul_reduce_scatter"),
        w,
        set_id=s.set_id,
        algo=_ffi.schedule_code(methods.RS, sched),
        tf32=_ffi.tf32_allowed(precision),
        reduce_blocks=np.int32(schedule.REDUCE_BLOCKS),
        splits=np.int32(splits),
        split_cols=cols,
    )
    return _launch.back(y, axis), x
