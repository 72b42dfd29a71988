"""The Flax NNX modules of :mod:`jax_ub.nn` (documented there): parameters as ``nnx.Param`` with
partitioning metadata, the forward pass in :mod:`jax_ub.layers.core`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx import variablelib

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

default_kernel_init = nnx.initializers.lecun_normal()
default_bias_init = nnx.initializers.zeros_init()

# Sharding keys of a user's VariableMetadata, replaced by the merged names (see _param).
_SHARDING_KEYS = ("out_sharding", "sharding_names", "sharding", "eager_sharding", "sharding_rules")


def _param(
    where: str,
    param: str,
    init: Callable[..., Any],
    key: jax.Array,
    shape: Sequence[int],
    dtype: Any,
    names: tuple[Any, ...],
    axis_name: str,
    mesh: Any,
    dim_names: Sequence[str] | None = None,
    default: params.Boxed | None = None,
) -> tuple[nnx.Param, logical.Resolved]:
    """A parameter of global ``shape`` split over ``axis_name`` as ``names`` says, and its
    partitioning.

    Inside a shard_map over ``axis_name`` it is created as this device's shard; under a mesh with
    ``axis_name`` it is created sharded; otherwise as a plain array. Metadata is always attached.
    ``init`` may return a box (``nnx.with_partitioning``, ``nnx.with_metadata``): its names (mesh
    axes, or logical names with ``sharding_rules`` / ``nnx.logical_axis_rules``) go on the dims the
    layer keeps whole over ``axis_name`` and its other metadata is kept. ``default``: the names of
    an ``init`` that returns no box (:func:`jax_ub.layers.params.inherited_names`).
    """
    p = _mesh.placement(where, axis_name, mesh)
    _mesh.check_axis_in_mesh(where, axis_name, p)
    shape = tuple(shape)
    params.check_param_divisible(where, param, shape, names, dim_names, p.tp, axis_name)
    raw, res, box = params.init_param(
        where, param, init, key, shape, dtype, names, axis_name, p, framework="nnx", default=default
    )
    eager = not p.local and p.tp is not None
    concrete = mesh if isinstance(mesh, jax.sharding.Mesh) else None
    if (
        eager
        and concrete is not None
        and core.explicit_axes(concrete)
        and jax.sharding.get_abstract_mesh().empty
    ):
        # `mesh=` an Explicit-axes mesh with none in context: placed here by `device_put`, which
        # also works under `nnx.jit` (Flax's eager sharding would `reshard` to a mesh the jit has
        # no devices of; see core._to_spec).
        raw = core.place(raw, res.mesh_names, concrete)
        eager = False
    if isinstance(box, variablelib.VariableMetadata):
        metadata = {k: v for k, v in box.metadata.items() if k not in _SHARDING_KEYS}
    else:  # none, or a linen Partitioned: its mesh is all it has beside the names
        metadata = {"mesh": getattr(box, "mesh", None)}
    if concrete is not None or "mesh" not in metadata:
        metadata["mesh"] = concrete
    # The names as the user wrote them (logical ones too: `nnx.get_partition_spec` translates them
    # under the same rules) and the box's own rules; eager sharding composes them with the context's.
    metadata["out_sharding"] = res.names
    if res.rules:
        metadata["sharding_rules"] = res.rules
    if isinstance(box, variablelib.VariableMetadata):
        boxed = dataclasses.replace(box, raw_value=raw, metadata=metadata)
    else:
        boxed = variablelib.VariableMetadata(raw, metadata=metadata)
    return nnx.Param(boxed, eager_sharding=eager), res


def _check_rngs(where: str, rngs: Any) -> None:
    if not isinstance(rngs, nnx.Rngs):
        raise TypeError(
            f"{where}: `rngs` must be an nnx.Rngs (e.g. nnx.Rngs(0)); got {rngs!r} ({type(rngs).__name__})"
        )


def _check_options(
    where: str,
    sizes: dict[str, Any],
    *,
    rngs: Any,
    use_bias: Any,
    dtype: Any,
    param_dtype: Any,
    kernel_init: Any,
    bias_init: Any,
    seq_axis: Any,
    sequence_parallel: Any,
    batch_axes: Any,
    axis_name: Any,
    mesh: Any,
    recompute_gathered: Any = None,
    **forward: Any,
) -> None:
    """A dense layer's (or MLP's) constructor options, each refused naming the layer
    (``forward``: ``precision``, ``method`` and ``fp8``, checked where the layer runs)."""
    core.check_dense_options(
        where,
        sizes=sizes,
        use_bias=use_bias,
        dtype=dtype,
        param_dtype=param_dtype,
        kernel_init=kernel_init,
        bias_init=bias_init,
        mesh=mesh,
        recompute_gathered=recompute_gathered,
    )
    _check_rngs(where, rngs)
    core.check_seq_axis(where, seq_axis)
    _validate.check_bool(where, "sequence_parallel", sequence_parallel)
    _mesh.check_layer_axis(where, axis_name)
    check_batch_axes(where, batch_axes, axis_name)


class _ParallelDense(nnx.Module):
    """Parameters and options shared by the column- and row-parallel layers."""

    _partitioning: Callable[[str], tuple[Any, Any]]

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        use_bias: bool = True,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        kernel_init: Callable[..., Any] = default_kernel_init,
        bias_init: Callable[..., Any] = default_bias_init,
        precision: Any = None,
        method: str | None = None,
        fp8: Any = None,
        seq_axis: int = -2,
        sequence_parallel: bool = True,
        batch_axes: Any = AUTO,
        axis_name: str = "tp",
        mesh: Any = None,
        rngs: nnx.Rngs,
    ):
        where = type(self).__name__
        _check_options(
            where,
            {"in_features": in_features, "out_features": out_features},
            rngs=rngs,
            use_bias=use_bias,
            dtype=dtype,
            param_dtype=param_dtype,
            kernel_init=kernel_init,
            bias_init=bias_init,
            seq_axis=seq_axis,
            sequence_parallel=sequence_parallel,
            batch_axes=batch_axes,
            axis_name=axis_name,
            mesh=mesh,
        )
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = use_bias
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.precision = precision
        self.method = method
        self.fp8 = fp8
        self.seq_axis = seq_axis
        self.sequence_parallel = sequence_parallel
        self.batch_axes = batch_axes
        self.axis_name = axis_name
        self.mesh = mesh
        # The concrete mesh this layer is built under: its mesh when called with none in context.
        self._mesh_at_build = _mesh.concrete_mesh(mesh)
        kernel_names, bias_names = type(self)._partitioning(axis_name)
        dims = ("in_features", "out_features")
        self.kernel, kernel = _param(
            where,
            "kernel",
            kernel_init,
            rngs.params(),
            (in_features, out_features),
            param_dtype,
            kernel_names,
            axis_name,
            mesh,
            dims,
        )
        self.bias = (
            _param(
                where,
                "bias",
                bias_init,
                rngs.params(),
                (out_features,),
                param_dtype,
                bias_names,
                axis_name,
                mesh,
                dims[1:],
                params.inherited_names(kernel),
            )[0]
            if use_bias
            else None
        )

    def _options(self) -> dict[str, Any]:
        return dict(core.call_options(self), default_mesh=self._mesh_at_build, where=type(self).__name__)


class ColumnParallelDense(_ParallelDense):
    """Column-parallel dense layer (sequence-parallel in, tensor-parallel out): AG→GEMM.

    Global mode: x `[..., seq, in_features]` with seq split over ``axis_name`` →
    `[..., seq, out_features]` with the features split over ``axis_name``. Local mode (inside
    ``shard_map``): x `[..., seq/tp, in_features]` → `[..., seq, out_features/tp]`. Any number
    (>= 1) of leading dims; the sequence is ``seq_axis`` (e.g. `[batch, seq, in]`,
    `[tokens, in]`, or `[seq, batch, in]` with ``seq_axis=0``).

    Args:
      in_features: input size (the hidden size; not split).
      out_features: global output size, divisible by ``tp``.
      use_bias: add a bias `[out_features]` (split over ``axis_name``).
      dtype: compute dtype (default: promoted from input and parameters).
      param_dtype: parameter dtype.
      kernel_init, bias_init: initializers, called with the global shapes. One wrapped in
        ``nnx.with_partitioning`` may name mesh axes on the dim the layer keeps whole (e.g.
        ``("fsdp", None)`` or ``("fsdp", "tp")`` for the kernel: FSDP on its input dim); the layer
        names the ``axis_name`` dim itself and refuses another axis there. Logical names work too
        (e.g. ``("embed", "mlp")`` under ``nnx.logical_axis_rules``; see
        :mod:`jax_ub.layers.logical`); a bias with a plain ``bias_init`` then takes the kernel's
        logical name of its output dim.
      precision: passed to the GEMM.
      method: overlap algorithm for :func:`jax_ub.all_gather_matmul` (``None``: configured default;
        ``"xla"``: pure-XLA reference).
      fp8: a :class:`jax_ub.FP8Recipe`: the op quantizes x and the kernel to FP8 with current
        scaling (the all-gather moves FP8 bytes), the master parameters stay in ``param_dtype``
        (``None``: no FP8).
      recompute_gathered: keep only the local (sequence-sharded) x for the backward instead of the
        gathered one, ``tp``× smaller, and re-gather it there under the dgrad GEMM (``None``: the
        configured default, ``JAX_UB_RECOMPUTE_GATHERED``); see :func:`jax_ub.all_gather_matmul`.
      seq_axis: the sequence axis of x (default ``-2``), the one all-gathered; not the last.
      sequence_parallel: ``False``: x `[..., in_features]` replicated over ``axis_name``, any
        sequence length (e.g. decode steps), a local GEMM with no all-gather (Megatron's TP without
        SP; ``method`` and ``recompute_gathered`` do not apply). The output is the same.
      batch_axes: the mesh axes the batch (the first leading dim other than the sequence) of x
        and of the output is split over in global mode: ``"auto"`` (default: the axes x comes
        sharded with where known, else every other free axis of size > 1 that divides it),
        ``None`` (whole), or mesh axes / logical names (e.g. ``("data", "fsdp")``, or
        ``"activation_batch"`` under logical axis rules); see :mod:`jax_ub.layers.activation`.
      axis_name: the tensor-parallel mesh axis.
      mesh: mesh for global mode (default: the one set with ``jax.set_mesh``, else the kernel's
        own sharding's, else the concrete mesh the layer was built under).
      rngs: random streams; ``rngs.params`` initialises the parameters.
    """

    _partitioning = staticmethod(params.column_partitioning)

    def __init__(
        self, in_features: int, out_features: int, *, recompute_gathered: bool | None = None, **kwargs: Any
    ):
        _validate.check_optional_bool(type(self).__name__, "recompute_gathered", recompute_gathered)
        super().__init__(in_features, out_features, **kwargs)
        self.recompute_gathered = recompute_gathered

    def __call__(self, x: jax.Array) -> jax.Array:
        return core.column_parallel_dense(
            x,
            self.kernel[...],
            None if self.bias is None else self.bias[...],
            out_features=self.out_features,
            in_features=self.in_features,
            recompute_gathered=self.recompute_gathered,
            **self._options(),
        )


class RowParallelDense(_ParallelDense):
    """Row-parallel dense layer (tensor-parallel in, sequence-parallel out): GEMM→RS.

    Global mode: x `[..., seq, in_features]` with the features split over ``axis_name`` →
    `[..., seq, out_features]` with seq split over ``axis_name``. Local mode: x
    `[..., seq, in_features/tp]` → `[..., seq/tp, out_features]`. The bias `[out_features]`
    (replicated) is added once, after the reduce-scatter.

    Args: as :class:`ColumnParallelDense` except ``recompute_gathered``, which this layer does not
    accept (there is no gathered input to keep or recompute), with ``in_features`` (global)
    divisible by ``tp``; ``method`` goes to :func:`jax_ub.matmul_reduce_scatter`; ``seq_axis`` is
    the axis reduce-scattered. ``sequence_parallel=False``: the partial products are summed with
    an all-reduce (``lax.psum``) instead, and the output `[..., out_features]` is replicated over
    ``axis_name``, for any sequence length.
    """

    _partitioning = staticmethod(params.row_partitioning)

    def __call__(self, x: jax.Array) -> jax.Array:
        return core.row_parallel_dense(
            x,
            self.kernel[...],
            None if self.bias is None else self.bias[...],
            in_features=self.in_features,
            out_features=self.out_features,
            **self._options(),
        )


class QKVParallelDense(_ParallelDense):
    """Fused QKV projection of grouped-query attention, column-parallel (AG→GEMM), heads split
    over ``axis_name``.

    ``__call__(x)`` → ``(q, k, v)`` shaped for :func:`jax.nn.dot_product_attention` (`[B, T, N,
    H]`). Global mode: x `[..., seq, in_features]` (seq split over ``axis_name``) → q `[..., seq,
    num_heads, head_dim]`, k and v `[..., seq, num_kv_heads, head_dim]`, heads split over
    ``axis_name``. Local mode: x `[..., seq/tp, in_features]` → q `[..., seq, num_heads/tp,
    head_dim]`, k and v `[..., seq, num_kv_heads/tp, head_dim]`.

    One kernel `[in_features, (num_heads + 2 * num_kv_heads) * head_dim]` whose ``tp`` column
    blocks are each device's ``[q heads | k heads | v heads]`` (:mod:`jax_ub.layers.qkv`; the
    layout depends on ``tp``: build it from separate q, k, v matrices with
    :func:`jax_ub.nn.pack_qkv`, split it with :func:`jax_ub.nn.unpack_qkv`). ``num_heads`` and
    ``num_kv_heads`` must be divisible by ``tp``; key/value heads are not replicated.

    Args: ``num_heads``, ``num_kv_heads`` (``num_heads`` a multiple of it; equal for multi-head
    attention), ``head_dim``; ``use_bias`` (default ``False``, as Llama; Qwen-style models have
    one); the rest as :class:`ColumnParallelDense` (``fp8``, ``recompute_gathered``,
    ``seq_axis``, ``sequence_parallel``, ``batch_axes``, ``mesh``, ...).
    """

    _partitioning = staticmethod(params.column_partitioning)

    def __init__(
        self,
        in_features: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        use_bias: bool = False,
        recompute_gathered: bool | None = None,
        **kwargs: Any,
    ):
        where = type(self).__name__
        _validate.check_size(where, "in_features", in_features)
        _validate.check_bool(where, "use_bias", use_bias)
        _validate.check_optional_bool(where, "recompute_gathered", recompute_gathered)
        _validate.check_mesh_arg(where, kwargs.get("mesh"))
        out = qkv.qkv_features(where, num_heads, num_kv_heads, head_dim)
        axis_name = kwargs.get("axis_name", "tp")
        p = _mesh.placement(where, axis_name, kwargs.get("mesh"))
        qkv.check_heads(where, num_heads, num_kv_heads, p.tp, axis_name)
        super().__init__(in_features, out, use_bias=use_bias, **kwargs)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.recompute_gathered = recompute_gathered

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        return qkv.qkv_parallel_dense(
            x,
            self.kernel[...],
            None if self.bias is None else self.bias[...],
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            in_features=self.in_features,
            recompute_gathered=self.recompute_gathered,
            **self._options(),
        )


class LayerNorm(nnx.Module):
    """LayerNorm over the last dim with replicated `[features]` scale and bias (token-local)."""

    def __init__(
        self,
        features: int,
        *,
        epsilon: float = 1e-6,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        axis_name: str = "tp",
        mesh: Any = None,
        rngs: nnx.Rngs,
    ):
        where = type(self).__name__
        core.check_norm_options(
            where, features=features, epsilon=epsilon, dtype=dtype, param_dtype=param_dtype, mesh=mesh
        )
        _check_rngs(where, rngs)
        self.epsilon = epsilon
        self.dtype = dtype
        ones = nnx.initializers.ones_init()
        zeros = nnx.initializers.zeros_init()
        self.scale = _param(
            "LayerNorm", "scale", ones, rngs.params(), (features,), param_dtype, (None,), axis_name, mesh
        )[0]
        self.bias = _param(
            "LayerNorm", "bias", zeros, rngs.params(), (features,), param_dtype, (None,), axis_name, mesh
        )[0]

    def __call__(self, x: jax.Array) -> jax.Array:
        return core.layer_norm(
            x, self.scale[...], self.bias[...], epsilon=self.epsilon, dtype=self.dtype, where="LayerNorm"
        )


class RMSNorm(nnx.Module):
    """RMSNorm over the last dim (Llama, Mistral) with a replicated `[features]` scale, no bias."""

    def __init__(
        self,
        features: int,
        *,
        epsilon: float = 1e-6,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        axis_name: str = "tp",
        mesh: Any = None,
        rngs: nnx.Rngs,
    ):
        where = type(self).__name__
        core.check_norm_options(
            where, features=features, epsilon=epsilon, dtype=dtype, param_dtype=param_dtype, mesh=mesh
        )
        _check_rngs(where, rngs)
        self.epsilon = epsilon
        self.dtype = dtype
        self.scale = _param(
            "RMSNorm",
            "scale",
            nnx.initializers.ones_init(),
            rngs.params(),
            (features,),
            param_dtype,
            (None,),
            axis_name,
            mesh,
        )[0]

    def __call__(self, x: jax.Array) -> jax.Array:
        return core.rms_norm(x, self.scale[...], epsilon=self.epsilon, dtype=self.dtype, where="RMSNorm")


_NORMS: dict[str | None, Any] = {"layernorm": LayerNorm, "rmsnorm": RMSNorm, None: None}


class ParallelMLP(nnx.Module):
    """Transformer MLP for TP/SP: ``down(activation(up(norm(x))))`` (no residual); gated:
    ``down(activation(gate) * linear)`` with ``gate``, ``linear`` from one ``up`` projection.

    x `[..., seq, features]` → `[..., seq, features]`, the sequence split over ``axis_name`` on
    both sides (global mode; local mode sees `[..., seq/tp, features]`). ``up`` is a
    :class:`ColumnParallelDense` ``features → ffn_features``, ``down`` a :class:`RowParallelDense`
    ``ffn_features → features``; ``ffn_features`` must be divisible by ``tp``.

    Args: ``activation`` (default :func:`jax.nn.gelu`); ``norm``: ``"layernorm"`` (default: scale
    and bias, mean subtracted), ``"rmsnorm"`` (Llama, Mistral: a scale only, no mean subtraction)
    or ``None`` (no norm and no norm parameters, for an input normalised already); ``epsilon`` of
    the norm; ``recompute_gathered`` for ``up`` (the only all-gather); ``fp8`` (a
    :class:`jax_ub.FP8Recipe`) for both projections; ``seq_axis``,
    ``sequence_parallel`` (``False``: replicated activations, any sequence length) and
    ``batch_axes`` (the mesh axes of the batch in global mode) for both layers; the rest as
    :class:`ColumnParallelDense` (``kernel_init`` and ``bias_init`` for both).

    ``up_kernel_init``, ``down_kernel_init``, ``up_bias_init``, ``down_bias_init``: one
    projection's initializer (default ``kernel_init`` / ``bias_init``), e.g. ``down`` scaled by
    ``1/sqrt(2 * layers)``, or FSDP / logical names per projection:
    ``nnx.with_partitioning(init, ("fsdp", None))`` on ``up`` (its `[features, ffn]` kernel split
    over FSDP on the features) and ``(None, "fsdp")`` on ``down``; logical names such as
    ``("embed", "mlp")`` and ``("mlp", "embed")`` with rules (see :mod:`jax_ub.layers.logical`).
    Gated, ``up_kernel_init`` draws the interleaved `[features, 2 * ffn_features]` kernel whole
    (there is no separate gate projection): a fan-in initializer (the default ``lecun_normal``)
    has the scale of two `[features, ffn_features]` halves, a fan-out/fan-avg one does not.

    ``gated=True``: the GLU family, e.g. SwiGLU with ``activation=jax.nn.silu`` and
    ``use_bias=False``, GeGLU with the default gelu. Llama's and Mistral's MLP is that SwiGLU with
    ``norm="rmsnorm"`` and ``epsilon`` = the model's ``rms_norm_eps`` (the norm's scale is the
    checkpoint's ``post_attention_layernorm.weight``). ``up`` is then one
    ``features → 2 * ffn_features`` layer, so one all-gather feeds both halves; its features are
    interleaved (unit j's gate at column 2j, its linear part at 2j + 1), so every device holds whole
    pairs. :func:`pack_gated` builds that kernel (and bias) from the two `[features, ffn]` halves
    and :func:`unpack_gated` splits it. ``ffn_features`` must then be divisible by ``tp``.
    """

    def __init__(
        self,
        features: int,
        ffn_features: int,
        *,
        activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu,
        use_bias: bool = True,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        kernel_init: Callable[..., Any] = default_kernel_init,
        bias_init: Callable[..., Any] = default_bias_init,
        up_kernel_init: Callable[..., Any] | None = None,
        down_kernel_init: Callable[..., Any] | None = None,
        up_bias_init: Callable[..., Any] | None = None,
        down_bias_init: Callable[..., Any] | None = None,
        precision: Any = None,
        method: str | None = None,
        fp8: Any = None,
        epsilon: float = 1e-6,
        recompute_gathered: bool | None = None,
        gated: bool = False,
        norm: str | None = "layernorm",
        seq_axis: int = -2,
        sequence_parallel: bool = True,
        batch_axes: Any = AUTO,
        axis_name: str = "tp",
        mesh: Any = None,
        rngs: nnx.Rngs,
    ):
        where = type(self).__name__
        common = dict(
            use_bias=use_bias,
            dtype=dtype,
            param_dtype=param_dtype,
            precision=precision,
            method=method,
            fp8=fp8,
            seq_axis=seq_axis,
            sequence_parallel=sequence_parallel,
            batch_axes=batch_axes,
            axis_name=axis_name,
            mesh=mesh,
            rngs=rngs,
        )
        _check_options(
            where,
            {"features": features, "ffn_features": ffn_features},
            kernel_init=kernel_init,
            bias_init=bias_init,
            recompute_gathered=recompute_gathered,
            **common,
        )
        core.check_mlp_options(
            where,
            activation=activation,
            gated=gated,
            epsilon=epsilon,
            projection_inits={
                "up_kernel_init": up_kernel_init,
                "down_kernel_init": down_kernel_init,
                "up_bias_init": up_bias_init,
                "down_bias_init": down_bias_init,
            },
        )
        norm = core.check_norm(where, norm)
        _mesh.check_axis_in_mesh(where, axis_name, _mesh.placement(where, axis_name, mesh))
        if gated:
            core.check_gated(where, ffn_features, axis_name, mesh)
        self.activation = activation
        self.gated = gated
        inits = params.projection_inits(
            kernel_init, bias_init, up=(up_kernel_init, up_bias_init), down=(down_kernel_init, down_bias_init)
        )
        norm_cls = _NORMS[norm]
        self.norm = (
            None
            if norm_cls is None
            else norm_cls(
                features,
                epsilon=epsilon,
                dtype=dtype,
                param_dtype=param_dtype,
                axis_name=axis_name,
                mesh=mesh,
                rngs=rngs,
            )
        )
        with params.building(where, "up", inits["up"]):
            self.up = ColumnParallelDense(
                features,
                2 * ffn_features if gated else ffn_features,
                recompute_gathered=recompute_gathered,
                **inits["up"].kwargs,
                **common,
            )
        with params.building(where, "down", inits["down"]):
            self.down = RowParallelDense(ffn_features, features, **inits["down"].kwargs, **common)

    def __call__(self, x: jax.Array) -> jax.Array:
        # Here, not in the norm: its error would not say which layer.
        up = self.up
        core.check_x(
            type(self).__name__,
            x,
            up.in_features,
            "features",
            seq_axis=up.seq_axis,
            sequence_parallel=up.sequence_parallel,
        )
        h = self.up(x if self.norm is None else self.norm(x))
        if self.gated:
            core.check_gated(
                type(self).__name__,
                self.down.in_features,
                up.axis_name,
                up.mesh,
                (_mesh.array_mesh(up.kernel[...]), up._mesh_at_build),
            )
            h = core.glu(h, self.activation)
        else:
            h = self.activation(h)
        return self.down(h)
