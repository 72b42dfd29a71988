"""The mesh axes a TP/SP layer's activations keep on their non-TP dims in global mode.

A layer in global mode (:mod:`jax_ub.layers.core`) wraps its product in a ``shard_map`` whose
``in_specs``/``out_specs`` name every dim of x: the TP axis on the sequence (column layer, and the
row layer's output) or on the features (the row layer's input), and on the *batch* (the first
leading dim that is not the sequence) the mesh axes given by the layer's ``batch_axes``:

* ``"auto"`` (the default): the axes x comes sharded with on its batch, where its sharding is known
  (a concrete array's ``NamedSharding``; under ``jax.jit`` the type's spec on ``Explicit`` mesh
  axes); where it is not known, or x comes whole on its batch, every free mesh axis other than the
  TP axis of size > 1 when the batch divides by their product, else none.
* ``None`` (or ``()``): the batch whole on every device.
* a mesh axis, a logical name, or a tuple of them: the batch split over those axes, in that order.
  A name that the logical axis rules in context (``nn.logical_axis_rules`` /
  ``nnx.logical_axis_rules``, the ones the layers already read for their parameters) map is
  replaced by what they map it to (MaxText's ``"activation_batch"`` → ``("data", "fsdp")``); any
  other name must be a mesh axis, as in NNX's logical partitioning.

Refused, each naming the layer, what was expected and what was received: a ``batch_axes`` that is
not one of those forms; a name that is neither a mesh axis nor a rule's; the TP axis; an axis
named twice (also through a rule); an axis an enclosing ``shard_map`` already binds; axes given
for an x with no batch dim; a batch that does not divide by the axes' size. And where x's sharding
is known and puts a non-TP mesh axis on a dim where the layer's layout puts another (or none), the
layer refuses instead of re-sharding it: a sharded activation is never silently moved to another
layout. (An x that comes whole there is sliced, as before.)
"""

from __future__ import annotations

import math
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from jax_ub.layers import logical

AUTO = "auto"

__all__ = ["AUTO", "batch_entry", "check_batch_axes", "check_incoming", "default_batch_axes"]


def _fmt(shape: Any) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _entry(axes: tuple[str, ...]) -> Any:
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _spec_str(entries: Any) -> str:
    return repr(P(*entries))


def check_batch_axes(where: str, batch_axes: Any, axis_name: str | None = None) -> tuple[str, ...] | None:
    """``batch_axes``' form: ``"auto"`` (→ ``None``), ``None`` or ``()`` (→ ``()``), a name or a
    tuple/list of names (→ the names). ``axis_name``: the TP axis, refused among the names (a
    logical name is checked again once the rules have mapped it)."""
    if isinstance(batch_axes, str) and batch_axes == AUTO:
        return None
    if batch_axes is None:
        return ()
    names = (batch_axes,) if isinstance(batch_axes, str) else batch_axes
    if not isinstance(names, (tuple, list)) or not all(isinstance(n, str) and n for n in names):
        raise TypeError(
            f"{where}: `batch_axes` must be 'auto', None, a mesh axis or logical name (a str), or a "
            f"tuple of them; got {batch_axes!r} ({type(batch_axes).__name__})."
        )
    names = tuple(names)
    if axis_name is not None and axis_name in names:
        raise ValueError(
            f"{where}: `batch_axes` must name mesh axes other than the TP axis {axis_name!r} (the "
            f"layer places {axis_name!r} itself, on the sequence or the features); got "
            f"batch_axes={batch_axes!r}."
        )
    return names


def _free_axes(mesh: Any) -> tuple[str, ...]:
    manual = set(getattr(mesh, "manual_axes", ()) or ())
    return tuple(a for a in mesh.axis_names if a not in manual)


def default_batch_axes(mesh: Any, axis_name: str, batch: int | None) -> Any:
    """The batch's axes where nothing says otherwise: every free mesh axis but ``axis_name`` of
    size > 1 when ``batch`` divides by their product, else ``None`` (kept whole)."""
    if batch is None:
        return None
    axes = tuple(a for a in _free_axes(mesh) if a != axis_name and mesh.shape[a] > 1)
    if not axes or batch % math.prod(mesh.shape[a] for a in axes):
        return None
    return _entry(axes)


def _rules() -> tuple[tuple[str, Any], ...]:
    try:
        return logical.context_rules()
    except ImportError:  # without flax there are no rules to read
        return ()


def _mapped(where: str, batch_axes: Any, names: tuple[str, ...], mesh: Any) -> tuple[str, ...]:
    """``names`` with each logical name replaced by the mesh axes the context's rules map it to
    (the first rule for it), each other name kept (it must be a mesh axis)."""
    rules = _rules()
    first: dict[str, Any] = {}
    for key, value in rules:
        first.setdefault(key, value)
    out: list[str] = []
    for name in names:
        if name in first:
            out.extend(logical.axes_of(first[name]))
            continue
        if name not in mesh.axis_names:
            shown = ", ".join(f"({k!r}, {v!r})" for k, v in rules) or "none"
            raise ValueError(
                f"{where}: `batch_axes` {batch_axes!r} names {name!r}, which is neither an axis of "
                f"the mesh (its axes: {tuple(mesh.axis_names)}) nor a logical name that the "
                f"logical axis rules in context map (rules: {shown}). Expected mesh axes, or a "
                f"logical name such as MaxText's 'activation_batch' under `nn.logical_axis_rules` "
                f"/ `nnx.logical_axis_rules`."
            )
        out.append(name)
    return tuple(out)


def _given(
    where: str, batch_axes: Any, names: tuple[str, ...], x: Any, mesh: Any, axis_name: str, bdim: int | None
) -> Any:
    """The batch entry for the axes the caller named, after every check."""
    axes = _mapped(where, batch_axes, names, mesh)
    via = "" if axes == names else f" (which the logical axis rules map to {axes!r})"
    for a in axes:
        if a not in mesh.axis_names:
            raise ValueError(
                f"{where}: `batch_axes` {batch_axes!r}{via} names the mesh axis {a!r}, but the mesh "
                f"has no such axis (its axes: {tuple(mesh.axis_names)})."
            )
        if a == axis_name:
            raise ValueError(
                f"{where}: `batch_axes` {batch_axes!r}{via} names the TP axis {axis_name!r}; expected "
                f"mesh axes other than it (the layer places {axis_name!r} itself)."
            )
        if a not in _free_axes(mesh):
            raise ValueError(
                f"{where}: `batch_axes` {batch_axes!r}{via} names the mesh axis {a!r}, which an "
                f"enclosing shard_map already binds (x is this device's shard over it); expected "
                f"free axes: {tuple(b for b in _free_axes(mesh) if b != axis_name)}."
            )
    twice = next((a for i, a in enumerate(axes) if a in axes[:i]), None)
    if twice is not None:
        raise ValueError(
            f"{where}: `batch_axes` {batch_axes!r}{via} names the mesh axis {twice!r} twice; expected "
            f"each axis once (a dim is split over each mesh axis at most once)."
        )
    if not axes:
        return None
    if bdim is None:
        raise ValueError(
            f"{where}: `batch_axes` {batch_axes!r}{via} splits the batch, but x has no batch dim "
            f"(x.shape={_fmt(x.shape)}: the features and the sequence only); expected a batch dim "
            f"before the features besides the sequence, or batch_axes=None."
        )
    size = math.prod(int(mesh.shape[a]) for a in axes)
    if x.shape[bdim] % size:
        sizes = ", ".join(f"{a!r}: {mesh.shape[a]}" for a in axes)
        raise ValueError(
            f"{where}: the batch (x.shape={_fmt(x.shape)}, dim {bdim}) must divide by the size {size} "
            f"of `batch_axes` {batch_axes!r}{via} ({sizes}); got a batch of {x.shape[bdim]}."
        )
    return _entry(axes)


def incoming(x: Any, mesh: Any, axis_name: str) -> tuple[tuple[str, ...], ...] | None:
    """The free mesh axes other than ``axis_name`` that x is known to come sharded over, per dim,
    or ``None`` where its layout is not known (under ``jax.jit`` on ``Auto`` axes, a single-device
    array, an array on a mesh with other axes)."""
    sharding: Any = None
    if isinstance(x, jax.core.Tracer):
        try:
            sharding = jax.typeof(x).sharding
        except Exception:  # an aval without a sharding (an older jax): nothing known
            return None
        types = getattr(getattr(sharding, "mesh", None), "axis_types", None)
        if not types or jax.sharding.AxisType.Explicit not in tuple(types):
            return None  # on Auto axes the type says nothing of the layout
    elif isinstance(x, jax.Array):
        sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return None
    if tuple(sharding.mesh.axis_names) != tuple(mesh.axis_names):
        return None
    free = set(_free_axes(mesh)) - {axis_name}
    spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
    return tuple(
        tuple(a for a in logical.axes_of(e if e is not P.UNCONSTRAINED else None) if a in free)
        for e in spec[: x.ndim]
    )


def batch_entry(where: str, x: Any, mesh: Any, axis_name: str, bdim: int | None, batch_axes: Any) -> Any:
    """The ``PartitionSpec`` entry of the batch dim ``bdim`` of ``x`` (global mode) for
    ``batch_axes`` (module docstring)."""
    names = check_batch_axes(where, batch_axes, axis_name)
    if names is not None:
        return _given(where, batch_axes, names, x, mesh, axis_name, bdim)
    known = incoming(x, mesh, axis_name)
    if bdim is not None and known is not None and known[bdim]:
        return _entry(known[bdim])
    return default_batch_axes(mesh, axis_name, None if bdim is None else x.shape[bdim])


def check_incoming(where: str, x: Any, mesh: Any, axis_name: str, spec: P, batch_axes: Any) -> None:
    """Refuses an x whose known layout puts a non-TP mesh axis where ``spec`` (the layer's input
    layout) does not: the ``shard_map`` would re-shard it. Dims x comes whole on are fine (sliced)."""
    known = incoming(x, mesh, axis_name)
    if known is None:
        return
    entries = tuple(spec) + (None,) * (x.ndim - len(spec))
    want = tuple(tuple(a for a in logical.axes_of(e) if a != axis_name) for e in entries)
    for d, got in enumerate(known):
        if got and got != want[d]:
            received = _spec_str(_entry(g) for g in known)
            expected = _spec_str(entries)
            raise ValueError(
                f"{where}: x (shape {_fmt(x.shape)}) comes sharded {received} over the mesh axes "
                f"other than the TP axis {axis_name!r}, but the layer's input layout is {expected} "
                f"(batch_axes={batch_axes!r}); dim {d} would be re-sharded from {_entry(got)!r} to "
                f"{_entry(want[d])!r}. Expected an x sharded as the layer's layout on those axes: give "
                f"the layer `batch_axes=` the axes x keeps on its batch, or reshard x first."
            )
