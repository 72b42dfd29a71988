"""The Flax linen modules of :mod:`jax_ub.linen` (documented there): parameters boxed with
``nn.with_partitioning``, the forward pass in :mod:`jax_ub.layers.core`, as for NNX.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jax_ub import _validate
from jax_ub.layers import core, logical, params, qkv
from jax_ub.layers import mesh as _mesh
from jax_ub.layers.activation import AUTO, check_batch_axes
from jax_ub.layers.core import pack_gated, unpack_gated

__all__ = [
    "ColumnParallelDense",
    "ParallelMLP",
    "QKVParallelDense",
    "RowParallelDense",
    "pack_gated",
    "unpack_gated",
]

default_kernel_init = nn.initializers.lecun_normal()
default_bias_init = nn.initializers.zeros_init()


def _box_mesh(box: Any) -> Any:
    """The mesh a user's box names (linen ``Partitioned.mesh``, NNX metadata ``mesh``), if any."""
    if isinstance(box, nn.Partitioned):
        return box.mesh
    return getattr(box, "metadata", {}).get("mesh") if box is not None else None


def _param(
    module: nn.Module,
    name: str,
    init: Callable[..., Any],
    shape: tuple[int, ...],
    dtype: Any,
    names: tuple[Any, ...],
    axis_name: str,
    mesh: Any,
    dim_names: Sequence[str] | None = None,
    default: params.Boxed | None = None,
) -> tuple[jax.Array, logical.Resolved | None]:
    """The parameter ``name`` (boxed ``nn.Partitioned``, or ``nn.LogicallyPartitioned`` with an
    initializer's logical names), unboxed, and its partitioning where ``init`` ran (else None).

    ``default``: the names of an ``init`` that returns no box
    (:func:`jax_ub.layers.params.inherited_names`).
    """
    where = type(module).__name__
    p = _mesh.placement(where, axis_name, mesh)
    _mesh.check_axis_in_mesh(where, axis_name, p)
    shape = tuple(shape)
    params.check_param_divisible(where, name, shape, names, dim_names, p.tp, axis_name)
    concrete = mesh if isinstance(mesh, jax.sharding.Mesh) else None
    # Local mode: `apply` may be given this device's shards (what `init` makes there) or the whole
    # parameters (e.g. replicated through shard_map's in_specs); the layer slices whole ones.
    whole = (
        p.local
        and module.has_variable("params", name)
        and np.shape(_raw(module.get_variable("params", name))) == shape
    )
    resolved: list[logical.Resolved] = []

    def init_boxed(key: jax.Array, *_: Any) -> nn.Partitioned:
        raw, res, box = params.init_param(
            where,
            name,
            init,
            key,
            shape,
            dtype,
            names,
            axis_name,
            p,
            framework="linen",
            slice_local=not whole,
            default=default,
        )
        resolved.append(res)
        if not p.local and p.tp is not None:  # global mode: born sharded (needed on Explicit meshes)
            raw = core.place(raw, res.mesh_names, p.mesh)
        box_mesh = concrete if concrete is not None else _box_mesh(box)
        if res.logical:  # the logical names stay, for `nn.logical_to_mesh_sharding`
            return nn.LogicallyPartitioned(raw, res.names, mesh=box_mesh, rules=res.rules)
        return nn.Partitioned(raw, res.names, mesh=box_mesh)

    requested = shape
    if p.local and not whole:
        assert p.tp is not None
        requested = params.local_shape(shape, names, axis_name, p.tp)
    value = module.param(name, init_boxed, requested, dtype, unbox=False)
    res = resolved[0] if resolved else None
    # Flax would constrain the value to its spec, which is illegal on the manual axes of local mode,
    # and on the Explicit axes of a `mesh=` given outside a mesh context (there the value was born
    # with its sharding).
    if p.local or (concrete is not None and core.explicit_axes(concrete)):
        return _raw(value), res
    return nn.unbox(value), res


def _dense_params(
    module: ColumnParallelDense | RowParallelDense | QKVParallelDense,
    in_features: int,
    features: int | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """``(kernel [in_features, features], bias [features] or None)`` of a dense layer; a bias
    whose initializer names nothing takes the kernel's logical output name, if it has one."""
    partitioning = (
        params.row_partitioning if isinstance(module, RowParallelDense) else params.column_partitioning
    )
    features = module.features if features is None else features
    kernel_names, bias_names = partitioning(module.axis_name)
    kernel, res = _param(
        module,
        "kernel",
        module.kernel_init,
        (in_features, features),
        module.param_dtype,
        kernel_names,
        module.axis_name,
        module.mesh,
        _DIMS,
    )
    if not module.use_bias:
        return kernel, None
    bias, _ = _param(
        module,
        "bias",
        module.bias_init,
        (features,),
        module.param_dtype,
        bias_names,
        module.axis_name,
        module.mesh,
        _DIMS[1:],
        None if res is None else params.inherited_names(res),
    )
    return kernel, bias


class _Dense(nn.Module):
    """The fields the dense layers and :class:`ParallelMLP` share (documented on
    :class:`jax_ub.nn.ColumnParallelDense`). Each subclass repeats ``_: dataclasses.KW_ONLY``
    before its own fields, which keeps them and Flax's ``parent`` and ``name`` keyword-only, as
    here."""

    _: dataclasses.KW_ONLY
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Callable[..., Any] = default_kernel_init
    bias_init: Callable[..., Any] = default_bias_init
    precision: Any = None
    method: str | None = None
    fp8: Any = None
    seq_axis: int = -2
    sequence_parallel: bool = True
    batch_axes: Any = AUTO
    axis_name: str = "tp"
    mesh: Any = None

    def _check(self, x: Any, sizes: dict[str, Any], recompute_gathered: Any = None) -> str:
        """The fields and ``x`` (an array), checked at the top of ``__call__``; returns the
        layer's name for the errors that follow."""
        where = type(self).__name__
        core.check_dense_options(
            where,
            sizes=sizes,
            use_bias=self.use_bias,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=self.kernel_init,
            bias_init=self.bias_init,
            mesh=self.mesh,
            recompute_gathered=recompute_gathered,
        )
        core.check_seq_axis(where, self.seq_axis)
        _mesh.check_layer_axis(where, self.axis_name)
        check_batch_axes(where, self.batch_axes, self.axis_name)
        _validate.check_array(where, "x", x)
        return where

    def _options(self) -> dict[str, Any]:
        """The options of the forward pass (:mod:`jax_ub.layers.core`), a sublayer's included."""
        return core.call_options(self)


def _raw(value: Any) -> jax.Array:
    return value.unbox(apply_constraint=False) if isinstance(value, nn.Partitioned) else value


_DIMS = ("in_features (x.shape[-1])", "features")


class ColumnParallelDense(_Dense):
    """Column-parallel dense layer: AG→GEMM (see :class:`jax_ub.nn.ColumnParallelDense`).

    Global mode: x `[..., seq, in]` → `[..., seq, features]` (features split over
    ``axis_name``); local mode: x `[..., seq/tp, in]` → `[..., seq, features/tp]`. The sequence is
    ``seq_axis`` (default ``-2``). ``recompute_gathered``: keep only the local x for the backward
    (``None``: configured default). ``fp8``: a :class:`jax_ub.FP8Recipe` (FP8 GEMMs with current
    scaling, parameters kept in ``param_dtype``). ``sequence_parallel=False``: x replicated over
    ``axis_name``, a local GEMM, any sequence length. ``batch_axes``: the mesh axes of the batch in
    global mode (``"auto"``, ``None``, mesh axes or logical names; :mod:`jax_ub.layers.activation`).
    ``kernel_init``/``bias_init`` may be wrapped in ``nn.with_partitioning`` naming mesh axes on the
    dims the layer keeps whole (e.g. ``("fsdp", None)``): merged with the layer's own names.
    """

    features: int
    _: dataclasses.KW_ONLY
    recompute_gathered: bool | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        where = self._check(x, {"features": self.features}, self.recompute_gathered)
        in_features = x.shape[-1] if x.ndim else 0
        kernel, bias = _dense_params(self, in_features)
        return core.column_parallel_dense(
            x,
            kernel,
            bias,
            out_features=self.features,
            recompute_gathered=self.recompute_gathered,
            where=where,
            **self._options(),
        )


class RowParallelDense(_Dense):
    """Row-parallel dense layer: GEMM→RS, bias once after (see :class:`jax_ub.nn.RowParallelDense`).

    Global mode: x `[..., seq, in]` (in split over ``axis_name``) → `[..., seq, features]`
    (seq split); local mode: x `[..., seq, in/tp]` → `[..., seq/tp, features]`. The sequence is
    ``seq_axis`` (default ``-2``). ``sequence_parallel=False``: an all-reduce instead of the
    reduce-scatter, output replicated over ``axis_name``, any sequence length. ``batch_axes``: as
    :class:`ColumnParallelDense`'s.
    """

    features: int
    _: dataclasses.KW_ONLY

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        where = self._check(x, {"features": self.features})
        p = _mesh.placement(where, self.axis_name, self.mesh)
        x_in = x.shape[-1] if x.ndim else 0
        in_features = x_in * p.tp if p.local and p.tp else x_in
        kernel, bias = _dense_params(self, in_features)
        return core.row_parallel_dense(
            x,
            kernel,
            bias,
            in_features=in_features,
            out_features=self.features,
            where=where,
            **self._options(),
        )


class QKVParallelDense(_Dense):
    """Fused QKV projection of grouped-query attention, column-parallel (see
    :class:`jax_ub.nn.QKVParallelDense`): x `[..., seq, hidden]` → ``(q, k, v)``, `[..., seq,
    num_heads, head_dim]` and `[..., seq, num_kv_heads, head_dim]` twice, heads split over
    ``axis_name`` (local mode: x `[..., seq/tp, hidden]`, ``/tp`` heads). One ``kernel``
    `[hidden, (num_heads + 2 * num_kv_heads) * head_dim]` in the per-device layout of
    :mod:`jax_ub.layers.qkv` (:func:`jax_ub.linen.pack_qkv` builds it); no bias by default.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    _: dataclasses.KW_ONLY
    use_bias: bool = False
    recompute_gathered: bool | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        where = self._check(x, {}, self.recompute_gathered)
        out = qkv.qkv_features(where, self.num_heads, self.num_kv_heads, self.head_dim)
        p = _mesh.placement(where, self.axis_name, self.mesh)
        qkv.check_heads(where, self.num_heads, self.num_kv_heads, p.tp, self.axis_name)
        in_features = x.shape[-1] if x.ndim else 0
        kernel, bias = _dense_params(self, in_features, out)
        return qkv.qkv_parallel_dense(
            x,
            kernel,
            bias,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            recompute_gathered=self.recompute_gathered,
            where=where,
            **self._options(),
        )


class _Norm(nn.Module):
    """The fields of :class:`LayerNorm` and :class:`RMSNorm`, which differ only in their
    ``__call__``. Each subclass repeats ``_: dataclasses.KW_ONLY``, which keeps Flax's ``parent``
    and ``name`` keyword-only there too (all arguments keyword-only, as before the base class)."""

    _: dataclasses.KW_ONLY
    epsilon: float = 1e-6
    dtype: Any = None
    param_dtype: Any = jnp.float32
    axis_name: str = "tp"
    mesh: Any = None


def _check_norm(module: _Norm, x: Any) -> str:
    """A norm's fields and its ``x`` (an array of at least 1 dim: its last dim sizes the
    parameters), checked before any parameter; returns the norm's name."""
    where = type(module).__name__
    core.check_norm_options(
        where, epsilon=module.epsilon, dtype=module.dtype, param_dtype=module.param_dtype, mesh=module.mesh
    )
    core.check_norm_x(where, x)
    return where


def _norm_param(module: _Norm, name: str, init: Callable[..., Any], x: jax.Array) -> jax.Array:
    """A norm's replicated `[features]` parameter (``x.shape[-1]`` features; x checked by
    :func:`_check_norm`)."""
    return _param(
        module, name, init, (x.shape[-1],), module.param_dtype, (None,), module.axis_name, module.mesh
    )[0]


class LayerNorm(_Norm):
    """LayerNorm over the last dim with replicated `[features]` scale and bias (token-local)."""

    _: dataclasses.KW_ONLY

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        where = _check_norm(self, x)
        scale = _norm_param(self, "scale", nn.initializers.ones_init(), x)
        bias = _norm_param(self, "bias", nn.initializers.zeros_init(), x)
        return core.layer_norm(x, scale, bias, epsilon=self.epsilon, dtype=self.dtype, where=where)


class RMSNorm(_Norm):
    """RMSNorm over the last dim (Llama, Mistral) with a replicated `[features]` scale, no bias."""

    _: dataclasses.KW_ONLY

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        where = _check_norm(self, x)
        scale = _norm_param(self, "scale", nn.initializers.ones_init(), x)
        return core.rms_norm(x, scale, epsilon=self.epsilon, dtype=self.dtype, where=where)


_NORMS: dict[str | None, Any] = {"layernorm": LayerNorm, "rmsnorm": RMSNorm, None: None}


class ParallelMLP(_Dense):
    """Transformer MLP for TP/SP: ``down(activation(up(norm(x))))`` (see :class:`jax_ub.nn.ParallelMLP`).

    x `[..., seq, features]` → same shape, the sequence (``seq_axis``) split over ``axis_name`` on
    both sides; the output size is the input's. Submodules ``norm``, ``up``, ``down`` as in NNX;
    ``norm``: ``"layernorm"`` (default), ``"rmsnorm"`` (scale only, Llama/Mistral) or ``None`` (no
    ``norm`` submodule); ``recompute_gathered`` applies to ``up``; ``sequence_parallel=False``:
    replicated activations, any sequence length; ``batch_axes`` (the mesh axes of the batch in
    global mode) applies to both projections. ``gated=True``: ``down(activation(gate) *
    linear)`` from one interleaved ``up`` of ``2 * ffn_features`` (SwiGLU with
    ``activation=jax.nn.silu``; layout and :func:`pack_gated` as in :class:`jax_ub.nn.ParallelMLP`).
    ``up_kernel_init``, ``down_kernel_init``, ``up_bias_init``, ``down_bias_init``: one
    projection's initializer, default ``kernel_init`` / ``bias_init`` (e.g.
    ``nn.with_logical_partitioning(init, ("embed", "mlp"))`` on ``up`` and ``("mlp", "embed")``
    on ``down``, or a smaller scale on ``down``).
    """

    ffn_features: int
    _: dataclasses.KW_ONLY
    activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu
    up_kernel_init: Callable[..., Any] | None = None
    down_kernel_init: Callable[..., Any] | None = None
    up_bias_init: Callable[..., Any] | None = None
    down_bias_init: Callable[..., Any] | None = None
    epsilon: float = 1e-6
    recompute_gathered: bool | None = None
    gated: bool = False
    norm: str | None = "layernorm"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        where = self._check(x, {"ffn_features": self.ffn_features}, self.recompute_gathered)
        core.check_mlp_options(
            where,
            activation=self.activation,
            gated=self.gated,
            epsilon=self.epsilon,
            projection_inits={
                "up_kernel_init": self.up_kernel_init,
                "down_kernel_init": self.down_kernel_init,
                "up_bias_init": self.up_bias_init,
                "down_bias_init": self.down_bias_init,
            },
        )
        norm_cls = _NORMS[core.check_norm(where, self.norm)]
        _mesh.check_axis_in_mesh(where, self.axis_name, _mesh.placement(where, self.axis_name, self.mesh))
        core.check_x(
            where, x, None, "features", seq_axis=self.seq_axis, sequence_parallel=self.sequence_parallel
        )
        if self.gated:
            core.check_gated(where, self.ffn_features, self.axis_name, self.mesh)
        common = dict(use_bias=self.use_bias, param_dtype=self.param_dtype, **self._options())
        inits = params.projection_inits(
            self.kernel_init,
            self.bias_init,
            up=(self.up_kernel_init, self.up_bias_init),
            down=(self.down_kernel_init, self.down_bias_init),
        )
        h = (
            x
            if norm_cls is None
            else norm_cls(
                epsilon=self.epsilon,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                axis_name=self.axis_name,
                mesh=self.mesh,
                name="norm",
            )(x)
        )
        with params.building(where, "up", inits["up"]):
            h = ColumnParallelDense(
                2 * self.ffn_features if self.gated else self.ffn_features,
                name="up",
                recompute_gathered=self.recompute_gathered,
                **inits["up"].kwargs,
                **common,
            )(h)
        h = core.glu(h, self.activation) if self.gated else self.activation(h)
        with params.building(where, "down", inits["down"]):
            return RowParallelDense(x.shape[-1], name="down", **inits["down"].kwargs, **common)(h)
