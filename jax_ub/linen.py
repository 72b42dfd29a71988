"""Flax linen tensor-/sequence-parallel layers: thin wrappers over the same core as :mod:`jax_ub.nn`.

* :class:`ColumnParallelDense` — SP→TP (all-gather + GEMM), `[batch, seq/tp, in]` →
  `[batch, seq, features/tp]` per device.
* :class:`RowParallelDense` — TP→SP (GEMM + reduce-scatter), `[batch, seq, in/tp]` →
  `[batch, seq/tp, features]` per device; bias added once after the reduce-scatter.
* :class:`ParallelMLP` — norm (``"layernorm"``, ``"rmsnorm"`` or ``None``) → column → activation
  → row (``gated=True``: the GLU family).

Modes are those of :mod:`jax_ub.nn` (global arrays under ``jax.set_mesh`` / ``mesh=``, or local
shards inside the user's ``jax.shard_map`` over ``axis_name``; see :mod:`jax_ub._layers`). The
input size is taken from ``x`` as usual in linen. Parameters are boxed with
``nn.with_partitioning`` (column kernel ``(None, axis_name)``, bias ``(axis_name,)``; row kernel
``(axis_name, None)``, bias ``(None,)``). In local mode the parameters have their local shapes (the
ones ``shard_map`` hands to the body), and ``init`` builds each device's shard of the same global
initialisation.

Example (4 host devices)::

    import jax, jax.numpy as jnp
    from jax_ub import linen as ubl

    mesh = jax.make_mesh((4,), ("tp",))
    with jax.set_mesh(mesh):
        mlp = ubl.ParallelMLP(ffn_features=256)
        x = jnp.ones((2, 16, 64))
        params = jax.jit(mlp.init)(jax.random.key(0), x)
        y = jax.jit(mlp.apply)(params, x)           # [2, 16, 64]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jax_ub import _layers
from jax_ub._layers import pack_gated, unpack_gated

__all__ = ["ColumnParallelDense", "ParallelMLP", "RowParallelDense", "pack_gated", "unpack_gated"]

default_kernel_init = nn.initializers.lecun_normal()
default_bias_init = nn.initializers.zeros_init()


def _with_placement(init: Callable[..., jax.Array], names: tuple[Any, ...],
                    mesh: Any) -> Callable[..., jax.Array]:
    def placed(*args: Any) -> jax.Array:
        return _layers.place(init(*args), names, mesh)

    return placed


def _param(module: nn.Module, name: str, init: Callable[..., jax.Array], shape: tuple[int, ...],
           dtype: Any, names: tuple[Any, ...], axis_name: str, mesh: Any) -> jax.Array:
    where = type(module).__name__
    p = _layers.placement(axis_name, mesh)
    for dim, n in enumerate(names):
        if n == axis_name:
            _layers.check_divisible(where, f"parameter `{name}` dim {dim} of {list(shape)}",
                                    shape[dim], p.tp, axis_name)
    if p.local:
        assert p.tp is not None
        init = _layers.local_initializer(init, shape, names, axis_name, p.tp)
        shape = _layers.local_shape(shape, names, axis_name, p.tp)
    elif p.tp is not None:  # global mode: born sharded (needed on Explicit meshes)
        init = _with_placement(init, names, p.mesh)
    concrete = mesh if isinstance(mesh, jax.sharding.Mesh) else None
    value = module.param(name, nn.with_partitioning(init, names, mesh=concrete), shape, dtype,
                         unbox=False)
    # Flax would constrain the value to its spec, which is illegal on the manual axes of local mode,
    # and on the Explicit axes of a `mesh=` given outside a mesh context (there the value was born
    # with its sharding).
    if p.local or (concrete is not None and _layers.explicit_axes(concrete)):
        return _raw(value)
    return nn.unbox(value)


def _raw(value: Any) -> jax.Array:
    return value.unbox(apply_constraint=False) if isinstance(value, nn.Partitioned) else value


class ColumnParallelDense(nn.Module):
    """Column-parallel dense layer: AG→GEMM (see :class:`jax_ub.nn.ColumnParallelDense`).

    Global mode: x `[batch, seq, in]` → `[batch, seq, features]` (features split over
    ``axis_name``); local mode: x `[batch, seq/tp, in]` → `[batch, seq, features/tp]`.
    ``recompute_gathered``: keep only the local x for the backward (``None``: configured default).
    """

    features: int
    _: dataclasses.KW_ONLY
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Callable[..., jax.Array] = default_kernel_init
    bias_init: Callable[..., jax.Array] = default_bias_init
    precision: Any = None
    method: str | None = None
    recompute_gathered: bool | None = None
    axis_name: str = "tp"
    mesh: Any = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel_names, bias_names = _layers.column_partitioning(self.axis_name)
        kernel = _param(self, "kernel", self.kernel_init, (x.shape[-1], self.features),
                        self.param_dtype, kernel_names, self.axis_name, self.mesh)
        bias = (_param(self, "bias", self.bias_init, (self.features,), self.param_dtype,
                       bias_names, self.axis_name, self.mesh) if self.use_bias else None)
        return _layers.column_parallel_dense(
            x, kernel, bias, out_features=self.features, axis_name=self.axis_name, mesh=self.mesh,
            dtype=self.dtype, precision=self.precision, method=self.method,
            recompute_gathered=self.recompute_gathered, where=type(self).__name__)


class RowParallelDense(nn.Module):
    """Row-parallel dense layer: GEMM→RS, bias once after (see :class:`jax_ub.nn.RowParallelDense`).

    Global mode: x `[batch, seq, in]` (in split over ``axis_name``) → `[batch, seq, features]`
    (seq split); local mode: x `[batch, seq, in/tp]` → `[batch, seq/tp, features]`.
    """

    features: int
    _: dataclasses.KW_ONLY
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Callable[..., jax.Array] = default_kernel_init
    bias_init: Callable[..., jax.Array] = default_bias_init
    precision: Any = None
    method: str | None = None
    axis_name: str = "tp"
    mesh: Any = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel_names, bias_names = _layers.row_partitioning(self.axis_name)
        p = _layers.placement(self.axis_name, self.mesh)
        in_features = x.shape[-1] * p.tp if p.local and p.tp else x.shape[-1]
        kernel = _param(self, "kernel", self.kernel_init, (in_features, self.features),
                        self.param_dtype, kernel_names, self.axis_name, self.mesh)
        bias = (_param(self, "bias", self.bias_init, (self.features,), self.param_dtype,
                       bias_names, self.axis_name, self.mesh) if self.use_bias else None)
        return _layers.row_parallel_dense(
            x, kernel, bias, in_features=in_features, axis_name=self.axis_name, mesh=self.mesh,
            dtype=self.dtype, precision=self.precision, method=self.method,
            where=type(self).__name__)


class LayerNorm(nn.Module):
    """LayerNorm over the last dim with replicated `[features]` scale and bias (token-local)."""

    _: dataclasses.KW_ONLY
    epsilon: float = 1e-6
    dtype: Any = None
    param_dtype: Any = jnp.float32
    axis_name: str = "tp"
    mesh: Any = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        f = (x.shape[-1],)
        scale = _param(self, "scale", nn.initializers.ones_init(), f, self.param_dtype, (None,),
                       self.axis_name, self.mesh)
        bias = _param(self, "bias", nn.initializers.zeros_init(), f, self.param_dtype, (None,),
                      self.axis_name, self.mesh)
        return _layers.layer_norm(x, scale, bias, epsilon=self.epsilon, dtype=self.dtype)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim (Llama, Mistral) with a replicated `[features]` scale, no bias."""

    _: dataclasses.KW_ONLY
    epsilon: float = 1e-6
    dtype: Any = None
    param_dtype: Any = jnp.float32
    axis_name: str = "tp"
    mesh: Any = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = _param(self, "scale", nn.initializers.ones_init(), (x.shape[-1],),
                       self.param_dtype, (None,), self.axis_name, self.mesh)
        return _layers.rms_norm(x, scale, epsilon=self.epsilon, dtype=self.dtype)


_NORMS: dict[str | None, Any] = {"layernorm": LayerNorm, "rmsnorm": RMSNorm, None: None}


class ParallelMLP(nn.Module):
    """Transformer MLP for TP/SP: ``down(activation(up(norm(x))))`` (see :class:`jax_ub.nn.ParallelMLP`).

    x `[batch, seq, features]` → same shape, the sequence split over ``axis_name`` on both sides;
    the output size is the input's. Submodules ``norm``, ``up``, ``down`` as in NNX;
    ``norm``: ``"layernorm"`` (default), ``"rmsnorm"`` (scale only, Llama/Mistral) or ``None`` (no
    ``norm`` submodule); ``recompute_gathered`` applies to ``up``. ``gated=True``:
    ``down(activation(gate) * linear)``
    from one interleaved ``up`` of ``2 * ffn_features`` (SwiGLU with ``activation=jax.nn.silu``;
    layout and :func:`pack_gated` as in :class:`jax_ub.nn.ParallelMLP`).
    """

    ffn_features: int
    _: dataclasses.KW_ONLY
    activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Callable[..., jax.Array] = default_kernel_init
    bias_init: Callable[..., jax.Array] = default_bias_init
    precision: Any = None
    method: str | None = None
    epsilon: float = 1e-6
    recompute_gathered: bool | None = None
    gated: bool = False
    norm: str | None = "layernorm"
    axis_name: str = "tp"
    mesh: Any = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        norm_cls = _NORMS[_layers.check_norm(type(self).__name__, self.norm)]
        if self.gated:
            _layers.check_gated(type(self).__name__, self.ffn_features, self.axis_name, self.mesh)
        common = dict(use_bias=self.use_bias, dtype=self.dtype, param_dtype=self.param_dtype,
                      kernel_init=self.kernel_init, bias_init=self.bias_init,
                      precision=self.precision, method=self.method, axis_name=self.axis_name,
                      mesh=self.mesh)
        h = x if norm_cls is None else norm_cls(
            epsilon=self.epsilon, dtype=self.dtype, param_dtype=self.param_dtype,
            axis_name=self.axis_name, mesh=self.mesh, name="norm")(x)
        h = ColumnParallelDense(2 * self.ffn_features if self.gated else self.ffn_features,
                                name="up", recompute_gathered=self.recompute_gathered, **common)(h)
        h = _layers.glu(h, self.activation) if self.gated else self.activation(h)
        return RowParallelDense(x.shape[-1], name="down", **common)(h)
