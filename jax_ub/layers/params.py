"""Parameters of the TP/SP layers (:mod:`jax_ub.layers.core`): which dim of each is split over the TP
axis, the user's own partitioning names merged onto the other dims (mesh names here, logical names
through :mod:`jax_ub.layers.logical`), divisibility checks, initialization of whole parameters or
of this device's shard, and the per-projection initializers of the MLP.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jax_ub.layers import logical
from jax_ub.layers.logical import Resolved, Rules
from jax_ub.layers.mesh import Placement

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


@dataclasses.dataclass(frozen=True)
class ProjectionInits:
    """The initializers of one projection of a :class:`ParallelMLP`, and which were its own."""

    kernel_init: Any
    bias_init: Any
    own_kernel: bool
    own_bias: bool

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(kernel_init=self.kernel_init, bias_init=self.bias_init)


def projection_inits(kernel_init: Any, bias_init: Any, **own: tuple[Any, Any]) -> dict[str, ProjectionInits]:
    """Each projection's ``(kernel_init, bias_init)``: its own where given (not ``None``), else the
    MLP's shared ``kernel_init`` / ``bias_init``."""
    return {
        name: ProjectionInits(
            kernel_init if k is None else k, bias_init if b is None else b, k is not None, b is not None
        )
        for name, (k, b) in own.items()
    }


@contextlib.contextmanager
def building(where: str, projection: str, inits: ProjectionInits) -> Iterator[None]:
    """Notes on an error raised while building ``projection`` which initializers it came from (the
    message names the sub-layer's own ``kernel_init``/``bias_init`` and parameter)."""
    try:
        yield
    except (ValueError, TypeError) as e:
        k = (
            f"{projection}_kernel_init"
            if inits.own_kernel
            else f"kernel_init (no {projection}_kernel_init given)"
        )
        b = f"{projection}_bias_init" if inits.own_bias else f"bias_init (no {projection}_bias_init given)"
        e.add_note(f"While building {where}.{projection}: its `kernel` is from {k}, its `bias` from {b}.")
        raise


def local_initializer(
    init: Initializer, global_shape: Sequence[int], names: Sequence[Any], axis_name: str, tp: int
) -> Initializer:
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


def local_shape(
    global_shape: Sequence[int], names: Sequence[Any], axis_name: str, tp: int
) -> tuple[int, ...]:
    """``global_shape`` with each dim split over ``axis_name`` divided by ``tp``."""
    return tuple(d // tp if n == axis_name else d for d, n in zip(global_shape, names, strict=True))


def check_divisible(
    where: str, what: str, value: int, tp: int | None, axis_name: str, hint: str = ""
) -> None:
    if tp is not None and value % tp:
        raise ValueError(
            f"{where}: {what} must be divisible by the size of mesh axis "
            f"{axis_name!r} ({tp}); got {value}.{hint}"
        )


def check_param_divisible(
    where: str,
    param: str,
    shape: Sequence[int],
    names: Sequence[Any],
    dim_names: Sequence[str] | None,
    tp: int | None,
    axis_name: str,
) -> None:
    """Each dim of ``shape`` split over ``axis_name`` divides by ``tp``; the error names the dim
    by ``dim_names`` (e.g. ``out_features``) where given."""
    for dim, name in enumerate(names):
        if name == axis_name:
            what = (
                dim_names[dim] if dim_names is not None else f"parameter `{param}` dim {dim} of {list(shape)}"
            )
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


def merge_partitioning(
    where: str, param: str, layer_names: Sequence[Any], user_names: Any, axis_name: str
) -> tuple[Any, ...]:
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
            f"has {len(layer_names)} dims (the layer names it {layer_names})."
        )
    user = user + (None,) * (len(layer_names) - len(user))
    merged = []
    for dim, (mine, theirs) in enumerate(zip(layer_names, user, strict=True)):
        if mine == axis_name:
            if theirs not in (None, axis_name) and _axes_of(theirs) != (axis_name,):
                raise ValueError(
                    f"{where}: {param}_init's partitioning {user} names {theirs!r} on dim {dim} of "
                    f"`{param}`, which the layer splits over {axis_name!r} itself (it sets "
                    f"{layer_names}). Leave that dim None; other mesh axes (e.g. FSDP) may go on "
                    f"the dims the layer keeps whole."
                )
            merged.append(mine)
        else:
            if axis_name in _axes_of(theirs):
                raise ValueError(
                    f"{where}: {param}_init's partitioning {user} names the tensor-parallel axis "
                    f"{axis_name!r} on dim {dim} of `{param}`, which the layer keeps whole over it "
                    f"(it sets {layer_names}). The layer places {axis_name!r} itself: leave it out."
                )
            merged.append(theirs)
    return tuple(merged)


@dataclasses.dataclass(frozen=True)
class Boxed:
    """What an initializer returned: the array, and the box's names, rules and kind, if boxed."""

    value: Any  # the initializer's output (an array); None in inherited_names' box of names only
    names: Any = None  # the user's partitioning names (mesh axes or logical names), or None
    rules: Rules | None = None  # the box's own logical axis rules
    logical: bool = False  # a linen `LogicallyPartitioned` or NNX metadata with `sharding_rules`
    box: Any = None


def _rules(value: Any) -> Rules | None:
    return None if not value else tuple(tuple(r) for r in value)


def unbox_init(where: str, param: str, value: Any) -> Boxed:
    """An initializer's output, with the names its box carries.

    Knows Flax's boxes: NNX ``VariableMetadata`` (``nnx.with_partitioning``/``with_metadata``,
    ``sharding_rules`` included), linen ``Partitioned`` (``nn.with_partitioning``) and
    ``LogicallyPartitioned`` (``nn.with_logical_partitioning``); refuses other boxes.
    """
    if isinstance(value, jax.Array) or not hasattr(value, "__dict__"):
        return Boxed(value)
    from flax.core import meta  # here: the ops do not need flax, only its layers do
    from flax.linen import spmd
    from flax.nnx import variablelib

    if isinstance(value, variablelib.VariableMetadata):
        md = value.metadata
        names = next(
            (md[k] for k in ("out_sharding", "sharding_names", "sharding") if md.get(k) is not None), None
        )
        if isinstance(names, jax.sharding.NamedSharding):
            names = names.spec
        rules = _rules(md.get("sharding_rules"))
        return Boxed(value.raw_value, names, rules, rules is not None, value)
    if isinstance(value, spmd.LogicallyPartitioned):
        return Boxed(value.value, value.names, _rules(value.rules), True, value)
    if isinstance(value, meta.Partitioned):
        return Boxed(value.value, value.names, None, False, value)
    if isinstance(value, meta.AxisMetadata):
        raise TypeError(
            f"{where}: {param}_init returned a {type(value).__name__} box, which the layer cannot "
            f"read. The layer sets the tensor-parallel partitioning of `{param}` itself: give a "
            f"plain initializer, or one wrapped in `with_partitioning` (mesh axis names) or "
            f"`nn.with_logical_partitioning` (logical names)."
        )
    return Boxed(value)


def inherited_names(kernel: Resolved) -> Boxed | None:
    """Names for a bias whose initializer carries none, when its kernel's are logical: the kernel's
    logical name of its output dim (the bias's one dim), with the kernel's rules, so that the bias
    translates with the same rules (MaxText's convention). ``None`` otherwise (the layer's names)."""
    if not kernel.logical:
        return None
    return Boxed(None, (kernel.names[1],), kernel.rules, True)


def init_param(
    where: str,
    param: str,
    init: Initializer,
    key: Array,
    global_shape: Sequence[int],
    dtype: Any,
    layer_names: Sequence[Any],
    axis_name: str,
    p: Placement,
    *,
    framework: str,
    slice_local: bool = True,
    default: Boxed | None = None,
) -> tuple[Array, Resolved, Any]:
    """Runs ``init`` at the parameter's global shape: ``(value, partitioning, user's box or None)``.

    The partitioning is the layer's merged with the names the initializer's box carries (mesh
    names: :func:`merge_partitioning`; logical names, ``framework`` ``"nnx"`` or ``"linen"``:
    :mod:`jax_ub.layers.logical`). ``default``: the names to use when ``init`` returns no box
    (:func:`inherited_names`). In local mode (``p.local``) with ``slice_local``, ``value`` is this
    device's shard of the whole initialisation (so local-mode init equals global-mode's).
    """
    layer_names = tuple(layer_names)
    got = unbox_init(where, param, init(key, tuple(global_shape), dtype))
    user = got if got.names is not None or default is None else dataclasses.replace(default, value=got.value)
    res = _partitioning(where, param, layer_names, user, axis_name, p, framework)
    raw = got.value
    if p.local:
        if res.mesh_names != layer_names:
            given = (
                f"logical names {res.names} map to mesh axes {res.mesh_names}, which"
                if res.logical
                else f"partitioning names {res.names}"
            )
            raise ValueError(
                f"{where}: {param}_init's {given} put mesh axes other than "
                f"{axis_name!r} on `{param}`; inside `jax.shard_map` over {axis_name!r} (local "
                f"mode) parameters are whole on the dims not split over {axis_name!r}. Build the "
                f"layer outside shard_map (global mode) to keep those names."
            )
        if slice_local:
            assert p.tp is not None
            raw = _slice_tp(raw, res.mesh_names, axis_name, p.tp)
    return raw, res, got.box


def _partitioning(
    where: str,
    param: str,
    layer_names: tuple[Any, ...],
    user: Boxed,
    axis_name: str,
    p: Placement,
    framework: str,
) -> Resolved:
    mesh_axes = None if p.mesh is None else tuple(p.mesh.axis_names)
    mesh_sizes = None if p.mesh is None else dict(p.mesh.shape)  # size-1 axes in a rule are ignored
    names = () if user.names is None else _entries(user.names)

    def merge(entries: tuple[Any, ...]) -> tuple[Any, ...]:
        return merge_partitioning(where, param, layer_names, entries, axis_name)

    if framework == "nnx":
        return logical.resolve_nnx(
            where, param, layer_names, names, user.rules, axis_name, mesh_axes, merge, mesh_sizes
        )
    if user.logical or (user.names is None and logical.linen_rules_cover(layer_names, axis_name)):
        # With rules in context, the layer's own boxes are logical too (`None`, and the rules' name
        # for the TP axis): one tree of logical names, which a "layers" name added by `nn.scan`
        # and `nn.logical_to_mesh_sharding` of the whole tree need.
        return logical.resolve_linen(
            where, param, layer_names, names, user.rules, axis_name, mesh_axes, mesh_sizes
        )
    merged = layer_names if user.names is None else merge(names)
    if mesh_axes is not None and user.names is not None:
        for dim, (name, entry) in enumerate(zip(names, merged, strict=False)):
            missing = [a for a in logical.axes_of(entry) if a not in mesh_axes]
            if missing:  # else jax's bare "Resource axis ... is not found in mesh" when placed
                raise ValueError(
                    f"{where}: `{param}` dim {dim} (the layer names `{param}` {layer_names}): "
                    f"{param}_init's partitioning names it {name!r}, but the mesh has no axis "
                    f"{missing[0]!r} (its axes: {mesh_axes}). Name an axis of the mesh, or None "
                    f"to keep the dim whole."
                )
    return logical.Resolved(merged, merged)
