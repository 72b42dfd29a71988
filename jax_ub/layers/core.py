"""Shared core of the tensor-/sequence-parallel dense layers (:mod:`jax_ub.nn`, :mod:`jax_ub.linen`).

Everything here is a plain function of arrays; the NNX and linen modules only own parameters and
call these. Activations are `[..., features]`: any number (>= 1) of leading dims before the
features, one of which is the sequence, ``seq_axis`` (default ``-2``: `[batch, seq, features]`,
`[tokens, features]`). With ``sequence_parallel=True`` (the default) the sequence is what is
all-gathered (column layer) and reduce-scattered (row layer), so it must divide by ``tp``; with
``sequence_parallel=False`` activations are replicated over the TP axis (Megatron's TP without
SP, e.g. for decode steps of one token): the column layer is a local GEMM, the row layer a GEMM and
an all-reduce (``lax.psum``), and the sequence may have any length.

Two ways to call a layer (the *mode* is chosen per call, automatically):

* **global** — the mesh axis ``axis_name`` is *not* bound by an enclosing :func:`jax.shard_map`.
  Arrays are global; the layer finds a mesh and applies :func:`jax.shard_map` itself, over every
  mesh axis not already manual. The mesh is the layer's ``mesh`` argument, else the one set with
  :func:`jax.set_mesh`, else the mesh of the kernel's own ``NamedSharding`` (a concrete array,
  i.e. a call outside ``jax.jit``), else (NNX) the concrete mesh the layer was built under.
  Parameters are split along ``axis_name`` as their partitioning metadata says; the batch (the
  first leading dim other than the sequence; `[tokens, features]` has none) is split over the mesh
  axes the layer's ``batch_axes`` names (:mod:`jax_ub.layers.activation`). By default
  (``"auto"``) those are the axes x comes sharded with on its batch where its sharding is known,
  else all the *other* free mesh axes (e.g. ``"dp"``) when the batch divides by their product, else
  none. An x whose known layout puts a non-TP axis elsewhere is refused, not re-sharded.
  ``batch_axes`` does not apply in local mode (x is already this device's shard).
* **local** — ``axis_name`` is bound (the call runs inside the user's own ``shard_map`` over it):
  arrays are this device's shards and the layer calls the primitives directly. Parameters may be
  local shards (the usual case: passed through ``shard_map`` with ``in_specs`` from their
  partitioning) or whole arrays (closed over, or passed replicated); whole ones are sliced to this
  device's shard. Both frameworks accept both (linen: at ``apply``; ``init`` inside ``shard_map``
  creates the local shards).

Detection uses :func:`jax.lax.axis_size`, which raises ``NameError`` for an unbound axis name, so an
enclosing ``shard_map`` over ``axis_name`` always wins over a ``mesh`` argument.

Partitioning: the layers name the TP dim of each parameter themselves. An initializer that already
returns a box (``nnx.with_partitioning``, ``nn.with_partitioning``) may name mesh axes on the dims
the layer keeps whole over ``axis_name`` (e.g. ``("fsdp", "tp")`` for a column kernel: FSDP on its
input dim); those names are merged into the layer's (:func:`jax_ub.layers.params.merge_partitioning`).
Naming another axis on the TP dim, or ``axis_name`` on another dim, is refused. Logical names
(``nn.with_logical_partitioning``; NNX ``sharding_rules`` / ``nnx.logical_axis_rules``) are kept
in the parameters' boxes and must map, through the rules, to ``axis_name`` on the TP dim and to
other axes elsewhere (:mod:`jax_ub.layers.logical`).

Where a call runs and on which mesh is :mod:`jax_ub.layers.mesh`; the parameters' partitioning and
initialization are :mod:`jax_ub.layers.params`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from jax_ub import _validate, gemm, ops, reference
from jax_ub.layers import activation
from jax_ub.layers.mesh import array_mesh, check_differentiable_here, placement, require_placement
from jax_ub.layers.params import check_divisible

__all__ = [
    "NORMS",
    "check_norm",
    "check_seq_axis",
    "column_parallel_dense",
    "glu",
    "layer_norm",
    "pack_gated",
    "rms_norm",
    "row_parallel_dense",
    "unpack_gated",
]

Array = jax.Array
Initializer = Callable[..., Array]


# --------------------------------------------------------------------------------------------------
# Options shared by the layers
# --------------------------------------------------------------------------------------------------

NORMS = ("layernorm", "rmsnorm", None)


def check_norm(where: str, norm: Any) -> str | None:
    """``norm`` of a :class:`ParallelMLP`: ``"layernorm"``, ``"rmsnorm"`` or ``None``."""
    if norm not in NORMS or isinstance(norm, bool):
        raise ValueError(f"{where}: `norm` must be 'layernorm', 'rmsnorm' or None (no norm); got {norm!r}.")
    return norm


def check_seq_axis(where: str, seq_axis: Any) -> int:
    """``seq_axis`` is an int and, counted from the end, not the last (features) axis."""
    if isinstance(seq_axis, bool) or not isinstance(seq_axis, int):
        raise TypeError(f"{where}: `seq_axis` must be an int (the sequence axis of x); got {seq_axis!r}.")
    if seq_axis == -1:
        raise ValueError(
            f"{where}: `seq_axis` must not be the last axis of x (-1: the features); got {seq_axis}."
        )
    return seq_axis


def check_dense_options(
    where: str,
    *,
    sizes: dict[str, Any],
    use_bias: Any,
    dtype: Any,
    param_dtype: Any,
    kernel_init: Any,
    bias_init: Any,
    mesh: Any,
    recompute_gathered: Any = None,
) -> None:
    """A dense layer's (or MLP's) constructor options, each refused naming the layer, the option,
    what it takes and what it got, before any parameter is drawn. ``sizes``: its dimensions by
    name (``in_features``, ``out_features``, ...), each an int >= 1."""
    for name, value in sizes.items():
        _validate.check_size(where, name, value)
    _validate.check_bool(where, "use_bias", use_bias)
    _validate.check_optional_bool(where, "recompute_gathered", recompute_gathered)
    _validate.check_float_dtype(where, "dtype", dtype, optional=True)
    _validate.check_float_dtype(where, "param_dtype", param_dtype)
    _validate.check_callable(where, "kernel_init", kernel_init)
    _validate.check_callable(where, "bias_init", bias_init)
    _validate.check_mesh_arg(where, mesh)


def check_norm_options(
    where: str, *, features: Any = None, epsilon: Any, dtype: Any, param_dtype: Any, mesh: Any
) -> None:
    """A norm's constructor options (``features``: None where the input gives it, as in linen)."""
    if features is not None:
        _validate.check_size(where, "features", features)
    _validate.check_epsilon(where, epsilon)
    _validate.check_float_dtype(where, "dtype", dtype, optional=True)
    _validate.check_float_dtype(where, "param_dtype", param_dtype)
    _validate.check_mesh_arg(where, mesh)


def check_mlp_options(
    where: str, *, activation: Any, gated: Any, epsilon: Any, projection_inits: dict[str, Any]
) -> None:
    """The options a :class:`ParallelMLP` adds to its layers' (checked by the layers): the
    activation, ``gated``, the norm's ``epsilon`` and each projection's optional initializers."""
    _validate.check_callable(where, "activation", activation)
    _validate.check_bool(where, "gated", gated)
    _validate.check_epsilon(where, epsilon)
    for name, init in projection_inits.items():
        _validate.check_callable(where, name, init, optional=True)


# --------------------------------------------------------------------------------------------------
# Helpers for the two modes
# --------------------------------------------------------------------------------------------------


def _fmt(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _promote(dtype: Any, x: Array, kernel: Array, bias: Array | None) -> tuple[Array, Array, Array | None]:
    present = [a for a in (x, kernel, bias) if a is not None]
    dtype = jnp.result_type(*present) if dtype is None else dtype
    return (
        jnp.asarray(x, dtype),
        jnp.asarray(kernel, dtype),
        None if bias is None else jnp.asarray(bias, dtype),
    )


def _local_slice(where: str, name: str, value: Array, dim: int, full: int, tp: int, axis_name: str) -> Array:
    """``value`` as this device's shard along ``dim``: given local (``full/tp``) or whole (``full``)."""
    size = value.shape[dim]
    n = full // tp
    if size == n:
        return value
    if size == full:
        return lax.dynamic_slice_in_dim(value, lax.axis_index(axis_name) * n, n, axis=dim)
    raise ValueError(
        f"{where}: inside shard_map over {axis_name!r} (size {tp}), `{name}` dim {dim} "
        f"must be the local shard ({n}) or the whole parameter ({full}); "
        f"got {name}.shape={_fmt(value.shape)}."
    )


def _free_axes(mesh: Any) -> tuple[str, ...]:
    manual = set(getattr(mesh, "manual_axes", ()) or ())
    return tuple(a for a in mesh.axis_names if a not in manual)


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
        # are Explicit): a bare PartitionSpec would name no mesh, and `reshard` to a NamedSharding
        # inside `jax.jit` leaves the jit's devices unknown (jax's "Length of device assignment 1
        # is not equal to the size of the mesh"); `device_put` onto the mesh's devices sets them,
        # so `jax.jit(init)` and a build under `nnx.jit` work with `mesh=` alone.
        return jax.device_put(value, jax.sharding.NamedSharding(mesh, target))
    return jax.sharding.reshard(value, target)


def place(value: Array, names: Sequence[Any], mesh: Any) -> Array:
    """``value`` resharded to ``P(*names)`` on the Explicit axes of ``mesh`` (no-op otherwise).

    Lets Flax's sharding constraints (which assert on Explicit axes) accept a fresh parameter.
    """
    if mesh is None:
        return value
    return _to_spec(value, P(*names), explicit_axes(mesh) & set(_free_axes(mesh)), mesh)


def _shard_map(
    body: Callable[..., Array], mesh: Any, args: Sequence[Array | None], in_specs: Sequence[P], out_spec: P
) -> Array:
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
    mapped = jax.shard_map(
        inner, mesh=mesh, in_specs=tuple(in_specs[i] for i in present), out_specs=out_spec, **kw
    )
    return mapped(*(_to_spec(a, in_specs[i], explicit, mesh) for i, a in enumerate(args) if a is not None))


def _layout(features: str, seq_axis: int, sequence_parallel: bool, seq: str = "seq") -> str:
    if not sequence_parallel:
        return f"[..., {features}]"
    if seq_axis == -2:
        return f"[..., {seq}, {features}]"
    return f"[..., {features}] with the sequence ({seq}) on axis {seq_axis}"


def check_x(
    where: str,
    x: Array,
    hidden: int | None,
    hidden_name: str,
    *,
    seq_axis: int = -2,
    sequence_parallel: bool = True,
    seq: str = "seq",
) -> int | None:
    """``x`` is `[..., hidden]` with its sequence on ``seq_axis`` (not the last axis); returns that
    axis, non-negative (``None`` without sequence parallelism where x has no such axis)."""
    _validate.check_array(where, "x", x)
    layout = _layout(hidden_name, seq_axis, sequence_parallel, seq)
    ndim = x.ndim
    axis = seq_axis + ndim if seq_axis < 0 else seq_axis
    if sequence_parallel and (ndim < 2 or not 0 <= axis < ndim - 1):
        raise ValueError(
            f"{where}: x must be `{layout}`: at least 2 dims, the sequence on axis "
            f"seq_axis={seq_axis} and the features last; got x.shape={_fmt(x.shape)}."
        )
    if ndim < 1:
        raise ValueError(
            f"{where}: x must be `{layout}` (at least 1 dim: the features); got x.shape={_fmt(x.shape)}."
        )
    if hidden is not None and x.shape[-1] != hidden:
        raise ValueError(
            f"{where}: x must be `{layout}` with {hidden_name} == {hidden}; got x.shape={_fmt(x.shape)}."
        )
    return axis if 0 <= axis < ndim - 1 else None


def _check_seq_divisible(where: str, x: Array, axis: int, tp: int, axis_name: str) -> None:
    check_divisible(
        where,
        f"the sequence length (x.shape={_fmt(x.shape)}, axis {axis})",
        x.shape[axis],
        tp,
        axis_name,
        hint=(
            f" For a sequence that does not split over {axis_name!r} (a decode step, a prompt of "
            f"any length), build the layer with `sequence_parallel=False`: activations "
            f"replicated over {axis_name!r}, no all-gather in the column layer and an all-reduce "
            f"instead of the reduce-scatter in the row layer."
        ),
    )


def _batch_dim(ndim: int, seq: int | None) -> int | None:
    """The batch dim of global mode: the first leading dim that is not the sequence."""
    return next((d for d in range(ndim - 1) if d != seq), None)


def _spec(ndim: int, entries: dict[int | None, Any]) -> P:
    return P(*(entries.get(d) for d in range(ndim)))


def _local_dot(x: Array, kernel: Array, precision: Any) -> Array:
    """The GEMM of a layer without sequence parallelism: a plain XLA dot (nothing to overlap).

    Named like :func:`jax_ub.matmul`'s output, so that :func:`jax_ub.checkpoint_policy` and
    ``save_only_these_names(*jax_ub.CHECKPOINT_NAMES)`` keep it as they keep the overlapped ops'.
    """
    return checkpoint_name(
        reference.matmul(x, kernel, precision=_validate.static_precision(precision)), gemm.OUT_NAME
    )


def _shape_error(where: str, name: str, expected: str, got: Sequence[int], hint: str = "") -> None:
    raise ValueError(f"{where}: {name} must be {expected}; got {name}.shape={_fmt(got)}.{hint}")


def _transposed_hint(kernel: Array, in_features: int, out_features: int) -> str:
    if in_features != out_features and tuple(kernel.shape) == (out_features, in_features):
        return " It is [out_features, in_features] (PyTorch's layout for a Linear weight): transpose it."
    return ""


def _check_kernel_2d(where: str, kernel: Array) -> None:
    if kernel.ndim != 2:
        _shape_error(where, "kernel", "`[in_features, out_features]` (2 dims)", kernel.shape)


def _check_kernel(
    where: str, kernel: Array, in_features: int, out_features: int, tp: int, split_dim: int, local: bool
) -> None:
    """``kernel`` is `[in_features, out_features]`; in local mode its ``split_dim`` may also be the
    local shard (``/ tp``)."""
    whole = (in_features, out_features)
    shard = tuple(d // tp if i == split_dim else d for i, d in enumerate(whole))
    ok = kernel.ndim == 2 and (tuple(kernel.shape) == whole or (local and tuple(kernel.shape) == shard))
    if ok:
        return
    expected = f"`[in_features, out_features]` = {_fmt(whole)}"
    if local and tp > 1:
        expected += f" (whole) or this device's shard {_fmt(shard)}"
    _shape_error(where, "kernel", expected, kernel.shape, _transposed_hint(kernel, in_features, out_features))


def _check_bias(where: str, bias: Array | None, out_features: int, tp: int, split: bool, local: bool) -> None:
    if bias is None:
        return
    ok = bias.ndim == 1 and (
        bias.shape[0] == out_features or (local and split and bias.shape[0] == out_features // tp)
    )
    if ok:
        return
    expected = f"`[out_features]` = [{out_features}]"
    if local and split and tp > 1:
        expected += f" (whole) or this device's shard [{out_features // tp}]"
    _shape_error(where, "bias", expected, bias.shape)


# --------------------------------------------------------------------------------------------------
# The collectives of the layers, and their local stand-ins
# --------------------------------------------------------------------------------------------------
#
# Under :func:`comm_stand_ins` the layers run with every collective replaced by a local stand-in of
# the same shapes and the same GEMM kernels as jax_ub's (:func:`jax_ub.ops.local_matmul`: cuBLASLt
# on GPUs, in FP8 where the layer has ``fp8=``): the all-gather by ``tp`` local copies of the shard,
# the reduce-scatter by this device's rows of the local GEMM, the all-reduce by nothing. The
# results are wrong on purpose; the time is the floor a benchmark compares the overlap against (no
# communication at all).

_STAND_INS: contextvars.ContextVar[bool] = contextvars.ContextVar("jax_ub_comm_stand_ins", default=False)


@contextlib.contextmanager
def comm_stand_ins() -> Iterator[None]:
    """Within this context (at trace time), the layers' collectives are local stand-ins (see above)."""
    token = _STAND_INS.set(True)
    try:
        yield
    finally:
        _STAND_INS.reset(token)


def _all_gather_matmul(x: Array, w: Array, axis_name: str, *, gather_axis: int, fp8: Any, **kw: Any) -> Array:
    if _STAND_INS.get():
        tp = int(lax.axis_size(axis_name))
        return ops.local_matmul(jnp.concatenate([x] * tp, axis=gather_axis), w, fp8=fp8)
    return cast(
        Array,
        ops.all_gather_matmul(x, w, axis_name, gather_axis=gather_axis, fp8=fp8, **kw),
    )


def _matmul_reduce_scatter(
    x: Array, w: Array, axis_name: str, *, scatter_axis: int, fp8: Any, **kw: Any
) -> Array:
    if _STAND_INS.get():
        tp = int(lax.axis_size(axis_name))
        y = ops.local_matmul(x, w, fp8=fp8)
        return lax.slice_in_dim(y, 0, x.shape[scatter_axis] // tp, axis=scatter_axis)
    return ops.matmul_reduce_scatter(x, w, axis_name, scatter_axis=scatter_axis, fp8=fp8, **kw)


def _psum(y: Array, axis_name: str) -> Array:
    return y if _STAND_INS.get() else lax.psum(y, axis_name)


# --------------------------------------------------------------------------------------------------
# The layers
# --------------------------------------------------------------------------------------------------


CALL_OPTIONS = (
    "axis_name",
    "mesh",
    "dtype",
    "precision",
    "method",
    "fp8",
    "seq_axis",
    "sequence_parallel",
    "batch_axes",
)


def call_options(layer: Any) -> dict[str, Any]:
    """The options a layer (NNX or linen) passes to :func:`column_parallel_dense` /
    :func:`row_parallel_dense` at each call: its attributes named in :data:`CALL_OPTIONS`."""
    return {name: getattr(layer, name) for name in CALL_OPTIONS}


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
    in_features: int | None = None,
    axis_name: str = "tp",
    mesh: Any = None,
    dtype: Any = None,
    precision: Any = None,
    method: str | None = None,
    recompute_gathered: bool | None = None,
    seq_axis: int = -2,
    sequence_parallel: bool = True,
    default_mesh: Any = None,
    fp8: Any = None,
    batch_axes: Any = activation.AUTO,
    where: str = "ColumnParallelDense",
    epilogue: Callable[[Array], Any] | None = None,
    epilogue_specs: Callable[[int | None, Any], Any] | None = None,
) -> Any:
    """Column-parallel dense (SP→TP): all-gather the sequence, multiply by this shard's columns.

    ``recompute_gathered`` goes to :func:`jax_ub.all_gather_matmul` (``None``: the configured
    default): keep only the local x for the backward and re-gather it there.

    Global mode: x `[..., seq, ..., in]` (sequence on ``seq_axis``, split over ``axis_name``),
    kernel `[in, out]`, bias `[out]` → `[..., seq, ..., out]` split over ``axis_name`` on the last
    dim. Local mode: x `[..., seq/tp, ..., in]`, kernel `[in, out/tp]` (or whole), bias `[out/tp]`
    (or whole) → `[..., seq, ..., out/tp]`.

    ``sequence_parallel=False``: x `[..., in]` replicated over ``axis_name`` (whole in local mode
    too), a local GEMM without all-gather (``method`` and ``recompute_gathered`` do not apply).

    ``in_features`` (global) is checked against the kernel when given (default
    ``kernel.shape[0]``). ``default_mesh``: the mesh of global mode when neither ``mesh``, a
    context mesh nor the kernel's own sharding names one. ``fp8``: a :class:`jax_ub.FP8Recipe`
    for :func:`jax_ub.all_gather_matmul` (``None``: the compute dtype).

    ``batch_axes``: the mesh axes of the batch in global mode (:mod:`jax_ub.layers.activation`:
    ``"auto"``, ``None``, mesh axes or logical names).

    ``epilogue``: applied to each device's `[..., seq, ..., out/tp]` output (bias added) inside
    the layer (local mode: to the result; global mode: inside its ``shard_map``), e.g. the QKV
    layer's split into heads; ``epilogue_specs(batch_dim, batch_axes)`` then gives the global
    mode's ``out_specs`` of what it returns.
    """
    _validate.check_array(where, "x", x)
    _check_call_options(where, method, precision)
    check_seq_axis(where, seq_axis)
    _validate.check_bool(where, "sequence_parallel", sequence_parallel)
    activation.check_batch_axes(where, batch_axes, axis_name)
    p = require_placement(where, axis_name, mesh, (array_mesh(kernel), array_mesh(x), default_mesh))
    check_differentiable_here(where, p, (x, kernel, bias))
    tp = p.tp
    assert tp is not None
    check_divisible(where, "out_features", out_features, tp, axis_name)
    _check_kernel_2d(where, kernel)
    if in_features is None:
        in_features = kernel.shape[0]
    # The kernel first: a wrong kernel (e.g. transposed) must not be reported as a wrong x.
    _check_kernel(where, kernel, in_features, out_features, tp, 1, p.local)
    _check_bias(where, bias, out_features, tp, True, p.local)
    seq_label = "seq/tp" if p.local else "seq"
    seq = check_x(
        where,
        x,
        in_features,
        "in_features",
        seq_axis=seq_axis,
        sequence_parallel=sequence_parallel,
        seq=seq_label,
    )
    x, kernel, bias = _promote(dtype, x, kernel, bias)

    def body(x: Array, kernel: Array, bias: Array | None) -> Array:
        if sequence_parallel:
            assert seq is not None  # check_x returns the sequence axis under sequence parallelism
            y = cast(  # without return_gathered: one array
                Array,
                _all_gather_matmul(
                    x,
                    kernel,
                    axis_name,
                    gather_axis=seq,
                    method=method,
                    precision=precision,
                    recompute_gathered=recompute_gathered,
                    fp8=fp8,
                ),
            )
        else:
            y = _local_dot(x, kernel, precision)
        y = y if bias is None else y + bias
        return y if epilogue is None else epilogue(y)

    if p.local:
        kernel = _local_slice(where, "kernel", kernel, 1, out_features, tp, axis_name)
        if bias is not None:
            bias = _local_slice(where, "bias", bias, 0, out_features, tp, axis_name)
        return body(x, kernel, bias)

    if sequence_parallel:
        assert seq is not None  # check_x returns the sequence axis under sequence parallelism
        _check_seq_divisible(where, x, seq, tp, axis_name)
    bdim = _batch_dim(x.ndim, seq)
    b = activation.batch_entry(where, x, p.mesh, axis_name, bdim, batch_axes)
    x_spec = {bdim: b, seq: axis_name} if sequence_parallel else {bdim: b}
    activation.check_incoming(where, x, p.mesh, axis_name, _spec(x.ndim, x_spec), batch_axes)
    out_spec = (
        _spec(x.ndim, {bdim: b, x.ndim - 1: axis_name}) if epilogue_specs is None else epilogue_specs(bdim, b)
    )
    return _shard_map(
        body,
        p.mesh,
        (x, kernel, bias),
        (_spec(x.ndim, x_spec), P(None, axis_name), P(axis_name)),
        out_spec,
    )


def row_parallel_dense(
    x: Array,
    kernel: Array,
    bias: Array | None,
    *,
    in_features: int | None = None,
    out_features: int | None = None,
    axis_name: str = "tp",
    mesh: Any = None,
    dtype: Any = None,
    precision: Any = None,
    method: str | None = None,
    seq_axis: int = -2,
    sequence_parallel: bool = True,
    default_mesh: Any = None,
    fp8: Any = None,
    batch_axes: Any = activation.AUTO,
    where: str = "RowParallelDense",
) -> Array:
    """Row-parallel dense (TP→SP): multiply by this shard's rows, reduce-scatter over the sequence.

    The bias is added once, after the reduce-scatter.

    Global mode: x `[..., seq, ..., in]` (split over ``axis_name`` on the last dim), kernel
    `[in, out]`, bias `[out]` → `[..., seq, ..., out]` with the sequence (``seq_axis``) split over
    ``axis_name``. Local mode: x `[..., seq, ..., in/tp]`, kernel `[in/tp, out]` (or whole), bias
    `[out]` → `[..., seq/tp, ..., out]`.

    ``sequence_parallel=False``: the partial products are summed with an all-reduce
    (``lax.psum``, in the compute dtype) instead: `[..., out]` replicated over ``axis_name``, any
    sequence length (``method`` does not apply).

    ``in_features`` and ``out_features`` (global) are checked when given; they default to the
    kernel's in global mode, and to ``x.shape[-1] * tp`` and ``kernel.shape[1]`` in local mode.
    ``fp8``: a :class:`jax_ub.FP8Recipe` for :func:`jax_ub.matmul_reduce_scatter` (``None``: the
    compute dtype). ``batch_axes``: as :func:`column_parallel_dense`'s (input and output keep them).
    """
    _validate.check_array(where, "x", x)
    _check_call_options(where, method, precision)
    check_seq_axis(where, seq_axis)
    _validate.check_bool(where, "sequence_parallel", sequence_parallel)
    activation.check_batch_axes(where, batch_axes, axis_name)
    p = require_placement(where, axis_name, mesh, (array_mesh(kernel), array_mesh(x), default_mesh))
    check_differentiable_here(where, p, (x, kernel, bias))
    tp = p.tp
    assert tp is not None
    _check_kernel_2d(where, kernel)
    if in_features is None:
        in_features = x.shape[-1] * tp if p.local and x.ndim else kernel.shape[0]
    check_divisible(where, "in_features", in_features, tp, axis_name)
    if out_features is None:
        out_features = kernel.shape[1]
    _check_kernel(where, kernel, in_features, out_features, tp, 0, p.local)
    _check_bias(where, bias, out_features, tp, False, p.local)
    if p.local:
        seq = check_x(
            where,
            x,
            in_features // tp,
            "in_features/tp",
            seq_axis=seq_axis,
            sequence_parallel=sequence_parallel,
        )
    else:
        seq = check_x(
            where, x, in_features, "in_features", seq_axis=seq_axis, sequence_parallel=sequence_parallel
        )
    if sequence_parallel:
        assert seq is not None  # check_x returns the sequence axis under sequence parallelism
        _check_seq_divisible(where, x, seq, tp, axis_name)
    x, kernel, bias = _promote(dtype, x, kernel, bias)

    def body(x: Array, kernel: Array, bias: Array | None) -> Array:
        if sequence_parallel:
            assert seq is not None  # check_x returns the sequence axis under sequence parallelism
            y = _matmul_reduce_scatter(
                x, kernel, axis_name, scatter_axis=seq, method=method, precision=precision, fp8=fp8
            )
        else:
            y = _psum(_local_dot(x, kernel, precision), axis_name)
        return y if bias is None else y + bias

    if p.local:
        kernel = _local_slice(where, "kernel", kernel, 0, in_features, tp, axis_name)
        return body(x, kernel, bias)

    bdim = _batch_dim(x.ndim, seq)
    b = activation.batch_entry(where, x, p.mesh, axis_name, bdim, batch_axes)
    x_spec = _spec(x.ndim, {bdim: b, x.ndim - 1: axis_name})
    activation.check_incoming(where, x, p.mesh, axis_name, x_spec, batch_axes)
    out = {bdim: b, seq: axis_name} if sequence_parallel else {bdim: b}
    in_specs = (x_spec, P(axis_name, None), P(None))
    return _shard_map(body, p.mesh, (x, kernel, bias), in_specs, _spec(x.ndim, out))


def check_norm_x(where: str, x: Any, *params: Array | None) -> None:
    """A norm's ``x`` is an array `[..., features]` (at least 1 dim) whose last dim is the size of
    its `[features]` parameters (a mismatch would broadcast, or fail in jax naming neither)."""
    _validate.check_array(where, "x", x)
    if x.ndim < 1:
        raise ValueError(
            f"{where}: x must be `[..., features]` (at least 1 dim: the features); "
            f"got x.shape={_fmt(x.shape)}."
        )
    for param in params:
        if param is not None and param.ndim == 1 and x.shape[-1] != param.shape[0]:
            raise ValueError(
                f"{where}: x must be `[..., features]` with features == {param.shape[0]} (the size of "
                f"the norm's parameters); got x.shape={_fmt(x.shape)}."
            )


def layer_norm(
    x: Array,
    scale: Array | None,
    bias: Array | None,
    *,
    epsilon: float = 1e-6,
    dtype: Any = None,
    where: str = "layer_norm",
) -> Array:
    """LayerNorm over the last dim (statistics in float32); a token-local op, so no communication.

    x `[..., features]`, scale/bias `[features]` (replicated) → `[..., features]` in ``dtype``
    (default: the promoted dtype of x and the parameters). ``where``: the name errors give.
    """
    check_norm_x(where, x, scale, bias)
    out_dtype = jnp.result_type(*(a for a in (x, scale, bias) if a is not None)) if dtype is None else dtype
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * lax.rsqrt(var + epsilon)
    if scale is not None:
        y = y * scale.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(out_dtype)


def rms_norm(
    x: Array, scale: Array | None, *, epsilon: float = 1e-6, dtype: Any = None, where: str = "rms_norm"
) -> Array:
    """RMSNorm over the last dim (Llama, Mistral): ``x / sqrt(mean(x**2) + epsilon) * scale``, no
    mean subtraction and no bias, statistics in float32; token-local, so no communication.

    x `[..., features]`, scale `[features]` (replicated) → `[..., features]` in ``dtype`` (default:
    the promoted dtype of x and scale). The scale multiplies in float32 before the cast (Hugging
    Face's ``LlamaRMSNorm`` casts first, then scales: the same in float32, within rounding below).
    ``where``: the name errors give.
    """
    check_norm_x(where, x, scale)
    out_dtype = jnp.result_type(*(a for a in (x, scale) if a is not None)) if dtype is None else dtype
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
        raise ValueError(
            f"pack_gated: gate and linear must have the same shape; got "
            f"{_fmt(gate.shape)} and {_fmt(linear.shape)}."
        )
    return jnp.stack([gate, linear], axis=-1).reshape(*gate.shape[:-1], 2 * gate.shape[-1])


def unpack_gated(packed: Array) -> tuple[Array, Array]:
    """Inverse of :func:`pack_gated`: `[..., 2 * ffn]` → ``(gate, linear)``, `[..., ffn]` each."""
    if packed.ndim < 1 or packed.shape[-1] % 2:
        raise ValueError(
            f"unpack_gated: the last dim must be even (gate/linear pairs); got {_fmt(packed.shape)}."
        )
    pairs = packed.reshape(*packed.shape[:-1], packed.shape[-1] // 2, 2)
    return pairs[..., 0], pairs[..., 1]


def glu(h: Array, activation: Callable[[Array], Array]) -> Array:
    """``activation(gate) * linear`` of the interleaved `[..., 2 * units]` → `[..., units]`.

    Elementwise per pair, so it runs on global arrays split over the last dim (the split moves to
    the units, no communication) and on local shards alike.
    """
    gate, linear = unpack_gated(h)
    return activation(gate) * linear


def check_gated(
    where: str, ffn_features: int, axis_name: str, mesh: Any, fallbacks: Sequence[Any] = ()
) -> None:
    """A gated MLP's ``ffn_features`` must split into whole gate/linear pairs per device."""
    check_divisible(
        where,
        "ffn_features (gated: each device holds whole gate/linear pairs)",
        ffn_features,
        placement(where, axis_name, mesh, fallbacks).tp,
        axis_name,
    )
