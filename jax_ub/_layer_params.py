"""Parameters of the TP/SP layers (:mod:`jax_ub._layers`): which dim of each is split over the TP
axis, the user's own partitioning names merged onto the other dims, divisibility checks, and
initialization of whole parameters or of this device's shard.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jax_ub._layer_mesh import Placement

Array = jax.Array
Initializer = Callable[..., Array]

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
        return _slice_tp(init(key, global_shape, dtype), names, axis_name, tp)

    return init_local


def _slice_tp(value: Array, names: Sequence[Any], axis_name: str, tp: int) -> Array:
    """This device's shard of a whole ``value`` along the dims ``names`` split over ``axis_name``."""
    for dim, name in enumerate(names):
        if name == axis_name:
            n = value.shape[dim] // tp
            value = lax.dynamic_slice_in_dim(value, lax.axis_index(axis_name) * n, n, axis=dim)
    return value


def local_shape(global_shape: Sequence[int], names: Sequence[Any], axis_name: str,
                tp: int) -> tuple[int, ...]:
    """``global_shape`` with each dim split over ``axis_name`` divided by ``tp``."""
    return tuple(d // tp if n == axis_name else d for d, n in zip(global_shape, names, strict=True))


def check_divisible(where: str, what: str, value: int, tp: int | None, axis_name: str,
                    hint: str = "") -> None:
    if tp is not None and value % tp:
        raise ValueError(f"{where}: {what} must be divisible by the size of mesh axis "
                         f"{axis_name!r} ({tp}); got {value}.{hint}")


def check_param_divisible(where: str, param: str, shape: Sequence[int], names: Sequence[Any],
                          dim_names: Sequence[str] | None, tp: int | None, axis_name: str) -> None:
    """Each dim of ``shape`` split over ``axis_name`` divides by ``tp``; the error names the dim
    by ``dim_names`` (e.g. ``out_features``) where given."""
    for dim, name in enumerate(names):
        if name == axis_name:
            what = (dim_names[dim] if dim_names is not None
                    else f"parameter `{param}` dim {dim} of {list(shape)}")
            check_divisible(where, what, shape[dim], tp, axis_name)


def _entries(names: Any) -> tuple[Any, ...]:
    """Partitioning names as a tuple (a ``PartitionSpec`` or a sequence of names)."""
    if isinstance(names, str):
        return (names,)
    return tuple(tuple(e) if isinstance(e, list) else e for e in names)


def _axes_of(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def merge_partitioning(where: str, param: str, layer_names: Sequence[Any], user_names: Any,
                       axis_name: str) -> tuple[Any, ...]:
    """The layer's partitioning names with the user's on the dims the layer keeps whole over
    ``axis_name``: ``(None, "tp")`` and ``("fsdp", "tp")`` give ``("fsdp", "tp")``.

    The TP dims are the layer's to name: the user may leave them ``None`` or name ``axis_name``
    there too, and may not name ``axis_name`` anywhere else.
    """
    layer_names = tuple(layer_names)
    user = _entries(user_names)
    if len(user) > len(layer_names):
        raise ValueError(
            f"{where}: {param}_init's partitioning {user} has {len(user)} entries, but `{param}` "
            f"has {len(layer_names)} dims (the layer names it {layer_names}).")
    user = user + (None,) * (len(layer_names) - len(user))
    merged = []
    for dim, (mine, theirs) in enumerate(zip(layer_names, user, strict=True)):
        if mine == axis_name:
            if theirs not in (None, axis_name) and _axes_of(theirs) != (axis_name,):
                raise ValueError(
                    f"{where}: {param}_init's partitioning {user} names {theirs!r} on dim {dim} of "
                    f"`{param}`, which the layer splits over {axis_name!r} itself (it sets "
                    f"{layer_names}). Leave that dim None; other mesh axes (e.g. FSDP) may go on "
                    f"the dims the layer keeps whole.")
            merged.append(mine)
        else:
            if axis_name in _axes_of(theirs):
                raise ValueError(
                    f"{where}: {param}_init's partitioning {user} names the tensor-parallel axis "
                    f"{axis_name!r} on dim {dim} of `{param}`, which the layer keeps whole over it "
                    f"(it sets {layer_names}). The layer places {axis_name!r} itself: leave it out.")
            merged.append(theirs)
    return tuple(merged)


_LOGICAL = ("logical axis names (`nn.with_logical_partitioning`, `sharding_rules`) are not "
            "supported: the layer names the tensor-parallel dim with the mesh axis itself; give mesh "
            "axis names for the other dims instead (e.g. `with_partitioning(init, ('fsdp', None))`)")


def unbox_init(where: str, param: str, value: Any) -> tuple[Array, Any, Any]:
    """``(array, user's partitioning names or None, the box or None)`` of an initializer's output.

    Knows Flax's boxes: NNX ``VariableMetadata`` (``nnx.with_partitioning``/``with_metadata``) and
    linen ``Partitioned`` (``nn.with_partitioning``); refuses logical names and unknown boxes.
    """
    if isinstance(value, jax.Array) or not hasattr(value, "__dict__"):
        return value, None, None
    from flax.core import meta  # here: the ops do not need flax, only its layers do
    from flax.nnx import variablelib

    if isinstance(value, variablelib.VariableMetadata):
        md = value.metadata
        if md.get("sharding_rules"):
            raise TypeError(f"{where}: {param}_init: {_LOGICAL}.")
        names = next((md[k] for k in ("out_sharding", "sharding_names", "sharding")
                      if md.get(k) is not None), None)
        if isinstance(names, jax.sharding.NamedSharding):
            names = names.spec
        return value.raw_value, names, value
    if type(value).__name__ == "LogicallyPartitioned":  # flax.linen.spmd, a Partitioned subclass
        raise TypeError(f"{where}: {param}_init: {_LOGICAL}.")
    if isinstance(value, meta.Partitioned):
        return value.value, value.names, value
    if isinstance(value, meta.AxisMetadata):
        raise TypeError(
            f"{where}: {param}_init returned a {type(value).__name__} box, which the layer cannot "
            f"read. The layer sets the tensor-parallel partitioning of `{param}` itself: give a "
            f"plain initializer, or one wrapped in `with_partitioning` (mesh axis names).")
    return value, None, None


def init_param(where: str, param: str, init: Initializer, key: Array, global_shape: Sequence[int],
               dtype: Any, layer_names: Sequence[Any], axis_name: str, p: Placement, *,
               slice_local: bool = True) -> tuple[Array, tuple[Any, ...], Any]:
    """Runs ``init`` at the parameter's global shape: ``(value, names, user's box or None)``.

    ``names`` are the layer's partitioning merged with the one the initializer's box carries
    (:func:`merge_partitioning`). In local mode (``p.local``) with ``slice_local``, ``value`` is
    this device's shard of the whole initialisation (so local-mode init equals global-mode's).
    """
    layer_names = tuple(layer_names)
    raw, user_names, box = unbox_init(where, param, init(key, tuple(global_shape), dtype))
    names = layer_names if user_names is None else merge_partitioning(
        where, param, layer_names, user_names, axis_name)
    if p.local:
        if names != layer_names:
            raise ValueError(
                f"{where}: {param}_init's partitioning names {names} put mesh axes other than "
                f"{axis_name!r} on `{param}`; inside `jax.shard_map` over {axis_name!r} (local "
                f"mode) parameters are whole on the dims not split over {axis_name!r}. Build the "
                f"layer outside shard_map (global mode) to keep those names.")
        if slice_local:
            assert p.tp is not None
            raw = _slice_tp(raw, names, axis_name, p.tp)
    return raw, names, box


