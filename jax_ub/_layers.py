"""Shared core of the tensor-/sequence-parallel dense layers (:mod:`jax_ub.nn`, :mod:`jax_ub.linen`).

Everything here is a plain function of arrays; the NNX and linen modules only own parameters and
call these. Activations are `[batch, seq, features]`; the sequence is axis 1.

Two ways to call a layer (the *mode* is chosen per call, automatically):

* **global** — the mesh axis ``axis_name`` is *not* bound by an enclosing :func:`jax.shard_map`.
  Arrays are global; the layer finds a mesh (its ``mesh`` argument, else the one set with
  :func:`jax.set_mesh`) and applies :func:`jax.shard_map` itself, over every mesh axis not already
  manual. Parameters are split along ``axis_name`` as their partitioning metadata says; the batch
  dim is split over all the *other* free mesh axes (e.g. ``"dp"``) when the batch divides by their
  product, else kept whole on each of them.
* **local** — ``axis_name`` is bound (the call runs inside the user's own ``shard_map`` over it):
  arrays are this device's shards and the layer calls the primitives directly. Parameters may be
  local shards (the usual case: passed through ``shard_map`` with ``in_specs`` from their
  partitioning) or whole arrays (closed over); whole ones are sliced to this device's shard.

Detection uses :func:`jax.lax.axis_size`, which raises ``NameError`` for an unbound axis name, so an
enclosing ``shard_map`` over ``axis_name`` always wins over a ``mesh`` argument.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jax_ub import _validate, ops

__all__ = [
    "NORMS",
    "Placement",
    "check_norm",
    "column_parallel_dense",
    "column_partitioning",
    "glu",
    "layer_norm",
    "local_initializer",
    "pack_gated",
    "placement",
    "rms_norm",
    "row_parallel_dense",
    "row_partitioning",
    "unpack_gated",
]

Array = jax.Array
Initializer = Callable[..., Array]


# --------------------------------------------------------------------------------------------------
# Mode selection
# --------------------------------------------------------------------------------------------------


def bound_axis_size(axis_name: str) -> int | None:
    """Size of mesh axis ``axis_name`` if an enclosing ``shard_map`` binds it, else ``None``."""
    try:
        return int(lax.axis_size(axis_name))
    except NameError:
        return None


def _context_mesh(mesh: Any) -> Any:
    if mesh is not None:
        return mesh
    abstract = jax.sharding.get_abstract_mesh()
    return None if abstract is None or abstract.empty else abstract


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a layer runs: ``local`` (inside the user's shard_map) or on global arrays over ``mesh``.

    ``tp`` is the size of the tensor-parallel axis, or ``None`` when neither a bound axis nor a mesh
    with that axis is known (only possible at construction time).
    """

    local: bool
    tp: int | None
    mesh: Any = None


def placement(axis_name: str, mesh: Any = None) -> Placement:
    """The mode a layer is in right now (see the module docstring); never raises."""
    size = bound_axis_size(axis_name)
    if size is not None:
        return Placement(local=True, tp=size)
    m = _context_mesh(mesh)
    if m is not None and axis_name in m.axis_names:
        return Placement(local=False, tp=int(m.shape[axis_name]), mesh=m)
    return Placement(local=False, tp=None, mesh=m)


def _require(where: str, axis_name: str, mesh: Any) -> Placement:
    p = placement(axis_name, mesh)
    if p.tp is None:
        found = "no mesh" if p.mesh is None else f"a mesh with axes {tuple(p.mesh.axis_names)}"
        raise ValueError(
            f"{where}: mesh axis {axis_name!r} is unknown here ({found}). Call the layer under "
            f"`jax.set_mesh(mesh)` or give it `mesh=` (global arrays), or call it inside "
            f"`jax.shard_map` over {axis_name!r} (local shards).")
    return p


# --------------------------------------------------------------------------------------------------
# Options shared by the layers
# --------------------------------------------------------------------------------------------------

NORMS = ("layernorm", "rmsnorm", None)


def check_norm(where: str, norm: Any) -> str | None:
    """``norm`` of a :class:`ParallelMLP`: ``"layernorm"``, ``"rmsnorm"`` or ``None``."""
    if norm not in NORMS or isinstance(norm, bool):
        raise ValueError(f"{where}: `norm` must be 'layernorm', 'rmsnorm' or None (no norm); "
                         f"got {norm!r}.")
    return norm


# --------------------------------------------------------------------------------------------------
# Partitioning metadata and initialisation
# --------------------------------------------------------------------------------------------------


def column_partitioning(axis_name: str) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Partitioning names of the column-parallel ``(kernel [in, out], bias [out])``."""
    return (None, axis_name), (axis_name,)


def row_partitioning(axis_name: str) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Partitioning names of the row-parallel ``(kernel [in, out], bias [out])``."""
    return (axis_name, None), (None,)


def local_initializer(init: Initializer, global_shape: Sequence[int], names: Sequence[Any],
                      axis_name: str, tp: int) -> Initializer:
    """Wraps ``init`` to build this device's shard of a ``global_shape`` parameter (local mode).

    The whole parameter is drawn from the same key on every device and sliced along the dims that
    ``names`` split over ``axis_name``, so local-mode initialisation equals global-mode's.
    """
    global_shape = tuple(global_shape)

    def init_local(key: Array, shape: Any = None, dtype: Any = jnp.float32) -> Array:
        del shape  # the local shape; the global one is what the initializer must see
        value = init(key, global_shape, dtype)
        for dim, name in enumerate(names):
            if name == axis_name:
                n = global_shape[dim] // tp
                value = lax.dynamic_slice_in_dim(value, lax.axis_index(axis_name) * n, n, axis=dim)
        return value

    return init_local


def local_shape(global_shape: Sequence[int], names: Sequence[Any], axis_name: str,
                tp: int) -> tuple[int, ...]:
    """``global_shape`` with each dim split over ``axis_name`` divided by ``tp``."""
    return tuple(d // tp if n == axis_name else d for d, n in zip(global_shape, names, strict=True))


def check_divisible(where: str, what: str, value: int, tp: int | None, axis_name: str) -> None:
    if tp is not None and value % tp:
        raise ValueError(f"{where}: {what} must be divisible by the size of mesh axis "
                         f"{axis_name!r} ({tp}); got {value}.")


# --------------------------------------------------------------------------------------------------
# Helpers for the two modes
# --------------------------------------------------------------------------------------------------


def _fmt(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _promote(dtype: Any, *arrays: Array | None) -> tuple[Array | None, ...]:
    present = [a for a in arrays if a is not None]
    dtype = jnp.result_type(*present) if dtype is None else dtype
    return tuple(None if a is None else jnp.asarray(a, dtype) for a in arrays)


def _local_slice(where: str, name: str, value: Array, dim: int, full: int, tp: int,
                 axis_name: str) -> Array:
    """``value`` as this device's shard along ``dim``: given local (``full/tp``) or whole (``full``)."""
    size = value.shape[dim]
    n = full // tp
    if size == n:
        return value
    if size == full:
        return lax.dynamic_slice_in_dim(value, lax.axis_index(axis_name) * n, n, axis=dim)
    raise ValueError(f"{where}: inside shard_map over {axis_name!r} (size {tp}), `{name}` dim {dim} "
                     f"must be the local shard ({n}) or the whole parameter ({full}); "
                     f"got {name}.shape={_fmt(value.shape)}.")


def _free_axes(mesh: Any) -> tuple[str, ...]:
    manual = set(getattr(mesh, "manual_axes", ()) or ())
    return tuple(a for a in mesh.axis_names if a not in manual)


def _batch_axes(mesh: Any, axis_name: str, batch: int) -> Any:
    """Mesh axes the batch is split over in global mode (None: kept whole)."""
    axes = tuple(a for a in _free_axes(mesh) if a != axis_name and mesh.shape[a] > 1)
    if not axes or batch % math.prod(mesh.shape[a] for a in axes):
        return None
    return axes[0] if len(axes) == 1 else axes


def explicit_axes(mesh: Any) -> set[str]:
    types = getattr(mesh, "axis_types", None)
    if types is None:
        return set()
    explicit = jax.sharding.AxisType.Explicit
    return {a for a, t in zip(mesh.axis_names, types, strict=True) if t == explicit}


def _to_spec(value: Array, spec: P, explicit: set[str], mesh: Any) -> Array:
    """Reshards ``value`` to ``spec`` on Explicit mesh axes (shard_map does it itself for Auto)."""
    if not explicit:
        return value

    def keep(entry: Any) -> Any:
        if entry is None:
            return None
        names = (entry,) if isinstance(entry, str) else tuple(entry)
        names = tuple(n for n in names if n in explicit)
        return None if not names else names[0] if len(names) == 1 else names

    target = P(*(keep(e) for e in spec))
    if jax.sharding.get_abstract_mesh().empty and isinstance(mesh, jax.sharding.Mesh):
        # A layer given `mesh=` outside any mesh context (e.g. a `jax.make_mesh` mesh, whose axes
        # are Explicit): a bare PartitionSpec would name no mesh.
        target = jax.sharding.NamedSharding(mesh, target)
    return jax.sharding.reshard(value, target)


def place(value: Array, names: Sequence[Any], mesh: Any) -> Array:
    """``value`` resharded to ``P(*names)`` on the Explicit axes of ``mesh`` (no-op otherwise).

    Lets Flax's sharding constraints (which assert on Explicit axes) accept a fresh parameter.
    """
    if mesh is None:
        return value
    return _to_spec(value, P(*names), explicit_axes(mesh) & set(_free_axes(mesh)), mesh)


def _shard_map(body: Callable[..., Array], mesh: Any, args: Sequence[Array | None],
               in_specs: Sequence[P], out_spec: P) -> Array:
    """``shard_map(body)(*args)`` over every free axis of ``mesh``; ``None`` args pass through."""
    present = [i for i, a in enumerate(args) if a is not None]
    explicit = explicit_axes(mesh) & set(_free_axes(mesh))

    def inner(*arrays: Array) -> Array:
        full: list[Array | None] = [None] * len(args)
        for i, a in zip(present, arrays, strict=True):
            full[i] = a
        return body(*full)

    kw: dict[str, Any] = {}
    if len(_free_axes(mesh)) != len(mesh.axis_names):  # nested in a shard_map over other axes
        kw["axis_names"] = set(_free_axes(mesh))
    mapped = jax.shard_map(inner, mesh=mesh, in_specs=tuple(in_specs[i] for i in present),
                           out_specs=out_spec, **kw)
    return mapped(*(_to_spec(args[i], in_specs[i], explicit, mesh) for i in present))


def check_x(where: str, x: Array, layout: str, hidden: int | None, hidden_name: str) -> None:
    if x.ndim != 3:
        raise ValueError(f"{where}: x must be `{layout}` (3 dims, sequence on axis 1); "
                         f"got x.shape={_fmt(x.shape)}.")
    if hidden is not None and x.shape[-1] != hidden:
        raise ValueError(f"{where}: x must be `{layout}` with {hidden_name} == {hidden}; "
                         f"got x.shape={_fmt(x.shape)}.")


# --------------------------------------------------------------------------------------------------
# The layers
# --------------------------------------------------------------------------------------------------


def _check_call_options(where: str, method: Any, precision: Any) -> None:
    """``method`` and ``precision`` checked at the layer, so that an error names it."""
    if method is not None:
        ops._requested(method, where)
    _validate.check_precision(where, precision)


def column_parallel_dense(
    x: Array,
    kernel: Array,
    bias: Array | None,
    *,
    out_features: int,
    axis_name: str = "tp",
    mesh: Any = None,
    dtype: Any = None,
    precision: Any = None,
    method: str | None = None,
    recompute_gathered: bool | None = None,
    where: str = "ColumnParallelDense",
) -> Array:
    """Column-parallel dense (SP→TP): all-gather the sequence, multiply by this shard's columns.

    ``recompute_gathered`` goes to :func:`jax_ub.all_gather_matmul` (``None``: the configured
    default): keep only the local x for the backward and re-gather it there.

    Global mode: x `[batch, seq, in]` (sequence split over ``axis_name``), kernel `[in, out]`, bias
    `[out]` → `[batch, seq, out]` split over ``axis_name`` on the last dim.
    Local mode: x `[batch, seq/tp, in]`, kernel `[in, out/tp]` (or whole), bias `[out/tp]` (or
    whole) → `[batch, seq, out/tp]`.
    """
    in_features = kernel.shape[0]
    _check_call_options(where, method, precision)
    p = _require(where, axis_name, mesh)
    tp = p.tp
    assert tp is not None
    check_divisible(where, "out_features", out_features, tp, axis_name)
    x, kernel, bias = _promote(dtype, x, kernel, bias)

    def body(x: Array, kernel: Array, bias: Array | None) -> Array:
        y = ops.all_gather_matmul(x, kernel, axis_name, gather_axis=1, method=method,
                                  precision=precision, recompute_gathered=recompute_gathered)
        return y if bias is None else y + bias

    if p.local:
        check_x(where, x, "[batch, seq/tp, in_features]", in_features, "in_features")
        kernel = _local_slice(where, "kernel", kernel, 1, out_features, tp, axis_name)
        if bias is not None:
            bias = _local_slice(where, "bias", bias, 0, out_features, tp, axis_name)
        return body(x, kernel, bias)

    check_x(where, x, "[batch, seq, in_features]", in_features, "in_features")
    check_divisible(where, f"the sequence length (x.shape={_fmt(x.shape)}, axis 1)", x.shape[1],
                    tp, axis_name)
    if kernel.shape[1] != out_features:
        raise ValueError(f"{where}: kernel must be `[in_features, out_features]` = "
                         f"[{in_features}, {out_features}]; got {_fmt(kernel.shape)}.")
    b = _batch_axes(p.mesh, axis_name, x.shape[0])
    return _shard_map(body, p.mesh, (x, kernel, bias),
                      (P(b, axis_name, None), P(None, axis_name), P(axis_name)),
                      P(b, None, axis_name))


def row_parallel_dense(
    x: Array,
    kernel: Array,
    bias: Array | None,
    *,
    in_features: int | None = None,
    axis_name: str = "tp",
    mesh: Any = None,
    dtype: Any = None,
    precision: Any = None,
    method: str | None = None,
    where: str = "RowParallelDense",
) -> Array:
    """Row-parallel dense (TP→SP): multiply by this shard's rows, reduce-scatter over the sequence.

    The bias is added once, after the reduce-scatter.

    Global mode: x `[batch, seq, in]` (split over ``axis_name`` on the last dim), kernel
    `[in, out]`, bias `[out]` → `[batch, seq, out]` with the sequence split over ``axis_name``.
    Local mode: x `[batch, seq, in/tp]`, kernel `[in/tp, out]` (or whole), bias `[out]` →
    `[batch, seq/tp, out]`.

    ``in_features`` (global) is checked when given; it defaults to ``kernel.shape[0]`` in global
    mode and to ``x.shape[-1] * tp`` in local mode.
    """
    _check_call_options(where, method, precision)
    p = _require(where, axis_name, mesh)
    tp = p.tp
    assert tp is not None
    x, kernel, bias = _promote(dtype, x, kernel, bias)

    def body(x: Array, kernel: Array, bias: Array | None) -> Array:
        y = ops.matmul_reduce_scatter(x, kernel, axis_name, scatter_axis=1, method=method,
                                      precision=precision)
        return y if bias is None else y + bias

    if p.local:
        check_x(where, x, "[batch, seq, in_features/tp]", None, "")
        full_in = x.shape[-1] * tp if in_features is None else in_features
        check_divisible(where, "in_features", full_in, tp, axis_name)
        check_x(where, x, "[batch, seq, in_features/tp]", full_in // tp, "in_features/tp")
        check_divisible(where, f"the sequence length (x.shape={_fmt(x.shape)}, axis 1)",
                        x.shape[1], tp, axis_name)
        kernel = _local_slice(where, "kernel", kernel, 0, full_in, tp, axis_name)
        return body(x, kernel, bias)

    full_in = kernel.shape[0] if in_features is None else in_features
    check_divisible(where, "in_features", full_in, tp, axis_name)
    check_x(where, x, "[batch, seq, in_features]", full_in, "in_features")
    check_divisible(where, f"the sequence length (x.shape={_fmt(x.shape)}, axis 1)", x.shape[1],
                    tp, axis_name)
    if kernel.shape[0] != full_in:
        raise ValueError(f"{where}: kernel must be `[in_features, out_features]` with "
                         f"in_features == {full_in}; got {_fmt(kernel.shape)}.")
    b = _batch_axes(p.mesh, axis_name, x.shape[0])
    return _shard_map(body, p.mesh, (x, kernel, bias),
                      (P(b, None, axis_name), P(axis_name, None), P(None)),
                      P(b, axis_name, None))


def layer_norm(x: Array, scale: Array | None, bias: Array | None, *, epsilon: float = 1e-6,
               dtype: Any = None) -> Array:
    """LayerNorm over the last dim (statistics in float32); a token-local op, so no communication.

    x `[..., features]`, scale/bias `[features]` (replicated) → `[..., features]` in ``dtype``
    (default: the promoted dtype of x and the parameters).
    """
    out_dtype = jnp.result_type(*(a for a in (x, scale, bias) if a is not None)) \
        if dtype is None else dtype
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * lax.rsqrt(var + epsilon)
    if scale is not None:
        y = y * scale.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(out_dtype)


def rms_norm(x: Array, scale: Array | None, *, epsilon: float = 1e-6, dtype: Any = None) -> Array:
    """RMSNorm over the last dim (Llama, Mistral): ``x / sqrt(mean(x**2) + epsilon) * scale``, no
    mean subtraction and no bias, statistics in float32; token-local, so no communication.

    x `[..., features]`, scale `[features]` (replicated) → `[..., features]` in ``dtype`` (default:
    the promoted dtype of x and scale). The scale multiplies in float32 before the cast (Hugging
    Face's ``LlamaRMSNorm`` casts first, then scales: the same in float32, within rounding below).
    """
    out_dtype = jnp.result_type(*(a for a in (x, scale) if a is not None)) \
        if dtype is None else dtype
    xf = x.astype(jnp.float32)
    y = xf * lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + epsilon)
    if scale is not None:
        y = y * scale.astype(jnp.float32)
    return y.astype(out_dtype)


# --------------------------------------------------------------------------------------------------
# Gated MLPs (GLU family: SwiGLU with silu, GeGLU with gelu)
# --------------------------------------------------------------------------------------------------
#
# The gated ``up`` projection is one column-parallel layer of 2 * ffn features, so one all-gather
# feeds both halves. Its features are interleaved, unit j's gate at 2j and its linear part at
# 2j + 1: every tp shard of ``ffn`` whole units is then a contiguous block of columns, for any tp,
# and the pairs never straddle two devices (a layout of all gates then all linear parts would put
# only gates on the first devices).


def pack_gated(gate: Array, linear: Array) -> Array:
    """The interleaved ``up`` parameter of a gated :class:`ParallelMLP` from its two halves.

    ``gate`` and ``linear``: `[..., ffn]` each (kernels `[features, ffn]`, biases `[ffn]`; e.g. a
    Llama checkpoint's ``gate_proj`` and ``up_proj`` weights, transposed) → `[..., 2 * ffn]`
    with ``gate[..., j]`` at column ``2j`` and ``linear[..., j]`` at ``2j + 1``.
    """
    if gate.shape != linear.shape:
        raise ValueError(f"pack_gated: gate and linear must have the same shape; got "
                         f"{_fmt(gate.shape)} and {_fmt(linear.shape)}.")
    return jnp.stack([gate, linear], axis=-1).reshape(*gate.shape[:-1], 2 * gate.shape[-1])


def unpack_gated(packed: Array) -> tuple[Array, Array]:
    """Inverse of :func:`pack_gated`: `[..., 2 * ffn]` → ``(gate, linear)``, `[..., ffn]` each."""
    if packed.ndim < 1 or packed.shape[-1] % 2:
        raise ValueError(f"unpack_gated: the last dim must be even (gate/linear pairs); got "
                         f"{_fmt(packed.shape)}.")
    pairs = packed.reshape(*packed.shape[:-1], packed.shape[-1] // 2, 2)
    return pairs[..., 0], pairs[..., 1]


def glu(h: Array, activation: Callable[[Array], Array]) -> Array:
    """``activation(gate) * linear`` of the interleaved `[..., 2 * units]` → `[..., units]`.

    Elementwise per pair, so it runs on global arrays split over the last dim (the split moves to
    the units, no communication) and on local shards alike.
    """
    gate, linear = unpack_gated(h)
    return activation(gate) * linear


def check_gated(where: str, ffn_features: int, axis_name: str, mesh: Any) -> None:
    """A gated MLP's ``ffn_features`` must split into whole gate/linear pairs per device."""
    check_divisible(where, "ffn_features (gated: each device holds whole gate/linear pairs)",
                    ffn_features, placement(axis_name, mesh).tp, axis_name)
