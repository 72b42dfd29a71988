"""Pure-XLA semantics of the jax_ub primitives: the fallback path and the oracle of every test.

Both functions run inside :func:`jax.shard_map` over a mesh axis ``axis_name`` of size ``tp`` and
see local shards. They are the plain JAX expressions of the ops' semantics, with no custom VJP: their
gradients are whatever JAX derives, which is what :mod:`jax_ub.ops` must reproduce.

Example (4 host devices or more, e.g. ``XLA_FLAGS=--xla_force_host_platform_device_count=4``)::

    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from jax_ub import reference

    mesh = Mesh(np.array(jax.devices()[:4]), ("tp",))
    x = jnp.ones((8, 16), jnp.float32)          # [m*tp, k], rows sharded over "tp"
    w = jnp.ones((16, 32), jnp.float32)         # [k, n], columns sharded over "tp"
    f = jax.shard_map(lambda x, w: reference.all_gather_matmul(x, w, "tp"), mesh=mesh,
                      in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp"))
    y = f(x, w)                                 # [8, 32] == x @ w
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jax_ub import _ffi

__all__ = ["all_gather_matmul", "matmul_reduce_scatter"]


def _product(dot: Callable[[Any, Any], jax.Array], x: jax.Array, w: jax.Array) -> jax.Array:
    """``dot(x, w)``; where ``x`` or ``w`` has no elements, the zeros that product equals (an empty
    result, or a sum over an empty contraction), made without a dot.

    XLA of jax 0.11.2 dies (SIGSEGV) compiling a dot whose result has no elements inside a
    ``shard_map`` over 2 devices that also takes an operand split over the axis (as every jax_ub
    op does): on CPU, and beside an all-gather on two H200s (``lab-2026-11:scripts/zero_size_probe.py``).
    jax_ub's ops send every zero-size operand to this path, and would have taken the process down.
    Zeros also differentiate to the right (zero) gradients, with no dot in the backward either. The
    zeros vary over the mesh axes the operands vary over, as the dot's result would."""
    if x.size and w.size:
        return dot(x, w)
    out = jax.eval_shape(dot, x, w)
    return _ffi.vary(jnp.zeros(out.shape, out.dtype), _ffi.varying_axes(x) | _ffi.varying_axes(w))


def matmul(x: jax.Array, w: jax.Array, *, precision: Any = None) -> jax.Array:
    """``jnp.matmul(x, w, precision=precision)``, with no dot where an operand is empty
    (:func:`_product`)."""
    return _product(functools.partial(jnp.matmul, precision=precision), x, w)


def dot_general(x: jax.Array, w: jax.Array, dimension_numbers: Any, *, precision: Any = None) -> jax.Array:
    """``lax.dot_general``, with no dot where an operand is empty (:func:`_product`)."""
    return _product(
        functools.partial(lax.dot_general, dimension_numbers=dimension_numbers, precision=precision), x, w
    )


def all_gather_matmul(
    x: jax.Array,
    w: jax.Array,
    axis_name: Any,
    *,
    gather_axis: int = 0,
    return_gathered: bool = False,
    precision: Any = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """``all_gather(x) @ w`` over mesh axis ``axis_name`` (AG→GEMM, column-parallel input).

    Args:
      x: `[..., m, k]`, the local shard; gathered (tiled) along ``gather_axis`` over ``axis_name``.
      w: `[k, n_local]` with the dtype of ``x``.
      axis_name: the mesh axis of size ``tp`` to gather over.
      gather_axis: any axis of ``x`` but the last (contracting) one; negative counts from the end.
      return_gathered: also return the gathered ``x``.
      precision: passed to the dot.

    Returns:
      y: `[..., m*tp, n_local]` (``gather_axis`` grows by ``tp``) with the dtype of ``x``, and with
      ``return_gathered`` also the gathered x `[..., m*tp, k]`.
    """
    x_gathered = lax.all_gather(x, axis_name, axis=gather_axis % x.ndim, tiled=True)
    y = matmul(x_gathered, w, precision=precision)
    return (y, x_gathered) if return_gathered else y


def matmul_reduce_scatter(
    x: jax.Array,
    w: jax.Array,
    axis_name: Any,
    *,
    scatter_axis: int = 0,
    precision: Any = None,
) -> jax.Array:
    """``reduce_scatter(x @ w)`` over mesh axis ``axis_name`` (GEMM→RS, row-parallel output).

    Args:
      x: `[..., M, k_local]`, the local shard; ``x.shape[scatter_axis]`` divisible by ``tp``.
      w: `[k_local, n]` with the dtype of ``x``.
      axis_name: the mesh axis of size ``tp`` to sum and scatter over.
      scatter_axis: any axis of ``x`` but the last (contracting) one; negative counts from the end.
      precision: passed to the dot.

    Returns:
      `[..., M/tp, n]` (``scatter_axis`` shrinks by ``tp``) with the dtype of ``x``: this shard's
      slice of the sum over ``axis_name`` of the partial products.
    """
    partial = matmul(x, w, precision=precision)
    # x's axes before the last are y's axes too, so scatter_axis (even negative) names the same one.
    return lax.psum_scatter(partial, axis_name, scatter_dimension=scatter_axis % x.ndim, tiled=True)
