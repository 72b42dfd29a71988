"""The bare collectives over jax_ub's transport (``jax_ub_all_gather``, ``jax_ub_reduce_scatter``
of ``csrc/ffi/overlap.cc``): XLA's ``all_gather`` / ``psum_scatter`` with jax_ub's copy engines
and registered buffers, for the bench and for code that wants the transport without a GEMM."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_ub import _ext, _ffi, _launch, _validate, comm, methods, schedule


def _schedule(what: str, op: str, method: Any) -> str:
    """The schedule ``method`` (a CUDA method name, or the deprecated ``"nccl"``) runs for ``op``."""
    accept = (*methods.CUDA_METHODS, methods.NCCL)
    if not isinstance(method, str) or method not in accept:
        raise ValueError(f"{what}: `method` must be one of {accept}; got {method!r}")
    methods.canonical(method, f"{what}: ", stacklevel=4)  # warns of a deprecated name
    return methods.runs(op, method)


def all_gather(
    x: jax.Array, axis_name: Any, *, axis: int = 0, method: str = methods.DEFAULT[methods.AG]
) -> jax.Array:
    """``lax.all_gather(x, axis_name, axis=axis, tiled=True)`` over jax_ub's copy-engine transport.

    x: `[..., m, ...]` local shard (any dtype of bfloat16/float16/float32); inside ``shard_map``
    over ``axis_name`` after :func:`jax_ub.initialize`. On an axis of size 1 it returns ``x``
    (one shard is the whole; :func:`jax_ub.initialize` makes no communicator there).
    """
    _validate.check_array("all_gather", "x", x)
    axis = _validate.normalize_axis("all_gather", "axis", axis, x.shape, last_ok=True)
    sched = _schedule("all_gather", methods.ALL_GATHER, method)
    if _validate.bound_axis_size("all_gather", axis_name) == 1:  # nothing to gather
        return x
    s = _launch.comm_set(axis_name, "all_gather")
    _ext.ensure_registered()
    x2 = _launch.front(x, axis)
    x3 = x2.reshape(x2.shape[0], -1)
    comm.ensure_capacity(s, s.world * math.prod(x2.shape) * jnp.dtype(x.dtype).itemsize)
    xg_t = _ffi.result_type((s.world * x3.shape[0], x3.shape[1]), x.dtype, x3)
    xg = _ffi.call("jax_ub_all_gather", xg_t)(
        _launch.checked(x3, s, "all_gather"), set_id=s.set_id, algo=_ffi.schedule_code(methods.AG, sched)
    )
    return _launch.back(xg.reshape(s.world * x2.shape[0], *x2.shape[1:]), axis)


def reduce_scatter(
    x: jax.Array, axis_name: Any, *, axis: int = 0, method: str = methods.DEFAULT[methods.RS]
) -> jax.Array:
    """``lax.psum_scatter(x, axis_name, scatter_dimension=axis, tiled=True)`` over jax_ub's
    transport, accumulating in float32, in row pieces (:func:`jax_ub.schedule.rs_pieces`). On an
    axis of size 1 it returns ``x``, as :func:`all_gather`."""
    _validate.check_array("reduce_scatter", "x", x)
    axis = _validate.normalize_axis("reduce_scatter", "axis", axis, x.shape, last_ok=True)
    sched = _schedule("reduce_scatter", methods.REDUCE_SCATTER, method)
    tp = _validate.bound_axis_size("reduce_scatter", axis_name)
    if tp == 1:  # nothing to sum
        return x
    _validate.check_divisible("reduce_scatter", "axis", axis, x.shape, axis_name, tp)
    s = _launch.comm_set(axis_name, "reduce_scatter")
    _ext.ensure_registered()
    x2 = _launch.front(x, axis)
    x3 = x2.reshape(x2.shape[0], -1)
    es = jnp.dtype(x.dtype).itemsize
    comm.ensure_capacity(s, math.prod(x2.shape) * es)
    y_t = _ffi.result_type((x3.shape[0] // s.world, x3.shape[1]), x.dtype, x3)
    y = _ffi.call("jax_ub_reduce_scatter", y_t)(
        _launch.checked(x3, s, "reduce_scatter"),
        set_id=s.set_id,
        algo=_ffi.schedule_code(methods.RS, sched),
        reduce_blocks=np.int32(schedule.REDUCE_BLOCKS),
        splits=np.int32(schedule.rs_pieces(x3.shape[0] // s.world, x3.shape[1] * es)),
    )
    return _launch.back(y.reshape(x2.shape[0] // s.world, *x2.shape[1:]), axis)
