"""Bulk overlap: a collective running under an *independent* GEMM, in one call.

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
import logging
from typing import Any

import jax
import numpy as np
from jax import lax

from jax_ub import _validate, comm, ops, reference

log = logging.getLogger("jax_ub")

__all__ = ["bulk_all_gather", "bulk_reduce_scatter"]


def _reference(kind: str, x, a, b, axis_name, axis, precision):
    if kind == "ag":
        out = lax.all_gather(x, axis_name, axis=axis, tiled=True)
    else:
        out = lax.psum_scatter(x, axis_name, scatter_dimension=axis, tiled=True)
    return out, reference.matmul(a, b, precision=precision)


def _cuda(kind, x, a, b, axis_name, axis, precision, method):
    from jax_ub import overlap

    fn = overlap.bulk_all_gather_cuda if kind == "ag" else overlap.bulk_reduce_scatter_cuda
    return fn(x, a, b, axis_name, axis=axis, precision=precision, method=method)


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


def _run(kind: str, x, a, b, axis_name, axis, precision, method, what):
    axis_name = _validate.one_axis(axis_name) or axis_name  # ("tp",) is "tp"
    precision = _validate.static_precision(precision, what)
    method = None if method is None else ops._requested(method, what)
    for name, v in (("x", x), ("a", a), ("b", b)):
        _validate.check_array(what, name, v)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"{what}: the GEMM operands must be a `[m, k]` and b `[k, n]`; got a "
                         f"{_validate.shape_str(a.shape)}, b {_validate.shape_str(b.shape)}")
    if a.dtype != b.dtype:
        raise TypeError(f"{what}: `a` and `b` must have the same dtype; got a "
                        f"{np.dtype(a.dtype).name}, b {np.dtype(b.dtype).name}")
    for name, v in (("x", x), ("a", a)):  # what the CUDA path moves and multiplies
        if np.dtype(v.dtype) not in _validate.SUPPORTED_DTYPES:
            raise TypeError(f"{what}: `{name}` must have dtype {_validate.DTYPE_NAMES}; got "
                            f"{np.dtype(v.dtype).name}")
    axis = _validate.normalize_axis(what, "axis", axis, x.shape, last_ok=True)
    _validate.check_nonempty_axis(what, "axis", axis, x.shape,
                                  "all-gather" if kind == "ag" else "reduce-scatter")
    tp = _validate.bound_axis_size(what, axis_name)
    if kind == "rs":
        _validate.check_divisible(what, "axis", axis, x.shape, axis_name, tp)
    m = ops._resolve_for_size(method, tp, x, a, b, fn=what)
    if m == "auto":
        m = ("ring" if comm.get(axis_name) is not None and _validate.bound_by_shard_map(axis_name)
             else "xla")
        if m == "xla":
            comm.warn_no_communicator(what, axis_name)
        log.debug("jax_ub: %s method 'auto' -> %r (%s)", what, m, "the mesh axis has a communicator"
                  if m == "ring" else f"no jax_ub communicator for mesh axis {axis_name!r}")
    if m == "xla":
        return _reference(kind, x, a, b, axis_name, axis, precision)
    if m == "nccl":
        s = comm.get(axis_name)
        if s is None or s.transport != "nccl":
            raise ValueError(f"{what}: method='nccl' needs jax_ub.initialize(mesh, "
                             f"axis={axis_name!r}, transport='nccl'); the axis has "
                             f"{'no communicator' if s is None else 'transport ' + repr(s.transport)}")
        m = "ring"  # a set with transport nccl runs every algorithm over NCCL
    return _bulk(kind, x, a, b, axis_name, axis, precision, m)


def bulk_all_gather(x: jax.Array, a: jax.Array, b: jax.Array, axis_name: Any, *, axis: int = 0,
                    precision: Any = None, method: str | None = None):
    """``(lax.all_gather(x, axis_name, axis=axis, tiled=True), a @ b)``, overlapped on GPUs.

    x: the local shard; a[m, k], b[k, n]: an independent GEMM (e.g. the dgrad of the layer whose
    input x is re-gathered). axis: the dimension of x gathered. precision: the GEMM's, as for
    ``jnp.matmul`` (float32 operands follow XLA's TF32 rule). method: ``None`` (the configured
    one), ``"auto"``, ``"xla"`` or an all-gather algorithm (``"ring"``, ``"all_peer"``,
    ``"push"``; ``"push_merge"`` runs push's all-gather); the other names that
    :func:`jax_ub.all_gather_matmul` accepts run the all-gather algorithm they run there.
    """
    return _run("ag", x, a, b, axis_name, axis, precision, method, "bulk_all_gather")


def bulk_reduce_scatter(x: jax.Array, a: jax.Array, b: jax.Array, axis_name: Any, *,
                        axis: int = 0, precision: Any = None, method: str | None = None):
    """``(lax.psum_scatter(x, axis_name, scatter_dimension=axis, tiled=True), a @ b)``, overlapped
    on GPUs (fp32 accumulation in the reduction).

    x: the full-extent partial sums (dimension ``axis`` divisible by the axis size); a[m, k],
    b[k, n]: an independent GEMM (e.g. the wgrad while the dgrad is reduce-scattered). precision:
    the GEMM's, as for ``jnp.matmul``. method: ``None`` (the configured one), ``"auto"``,
    ``"xla"`` or a reduce-scatter algorithm (``"ring"``, ``"pipeline"``); the other names that
    :func:`jax_ub.matmul_reduce_scatter` accepts run the reduce-scatter algorithm they run there.
    """
    return _run("rs", x, a, b, axis_name, axis, precision, method, "bulk_reduce_scatter")
