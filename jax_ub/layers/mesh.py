"""Where a TP/SP layer runs (:mod:`jax_ub.layers.core`): inside the user's ``shard_map`` over its axis
(local mode) or not (global mode), and which mesh a global call uses (the ``mesh`` argument,
:func:`jax.set_mesh`'s, the kernel's own ``NamedSharding``, or the one a layer was built under).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax import lax

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


def array_mesh(a: Any) -> Any:
    """The concrete mesh of ``a``'s ``NamedSharding`` (a committed array outside jit), else None."""
    if a is None or isinstance(a, jax.core.Tracer) or not isinstance(a, jax.Array):
        return None
    sharding = getattr(a, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    return mesh if isinstance(mesh, jax.sharding.Mesh) and not mesh.empty else None


def concrete_mesh(mesh: Any = None) -> Any:
    """``mesh`` if it is a concrete ``Mesh``, else the one set with ``jax.set_mesh``, else None.

    An NNX layer keeps this from its construction, to run when called with no mesh in context.
    """
    if isinstance(mesh, jax.sharding.Mesh):
        return mesh
    if mesh is not None:  # an AbstractMesh given on purpose: nothing concrete to keep
        return None
    try:
        m = jax.sharding.get_mesh()
    except ValueError:  # inside a trace (nnx.jit / nnx.eval_shape): jax's public call refuses
        try:
            from jax._src import mesh as mesh_lib  # the same thread-local, read without the guard

            m = mesh_lib.get_concrete_mesh()
        except Exception:  # a private API: any change just loses the fallback
            return None
    return m if isinstance(m, jax.sharding.Mesh) and not m.empty else None


def _legacy_mesh() -> Any:
    """The mesh of a legacy ``with mesh:`` block (which these layers do not read), if any."""
    try:
        from jax._src import mesh as mesh_lib

        m = mesh_lib.thread_resources.env.physical_mesh
    except Exception:  # a private API: without it the message just says less
        return None
    return None if m is None or m.empty else m


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a layer runs: ``local`` (inside the user's shard_map) or on global arrays over ``mesh``.

    ``tp`` is the size of the tensor-parallel axis, or ``None`` when neither a bound axis nor a mesh
    with that axis is known (only possible at construction time).
    """

    local: bool
    tp: int | None
    mesh: Any = None


def check_layer_axis(where: str, axis_name: Any) -> None:
    """A layer shards over one mesh axis, named by a str; anything else is a TypeError here, before
    jax reads it as an axis name (an int would give jax's own, unrelated error)."""
    if isinstance(axis_name, str):
        return
    hint = (
        f" Pass {axis_name[0]!r}: the layers take one axis name, not a {type(axis_name).__name__}."
        if isinstance(axis_name, (tuple, list)) and len(axis_name) == 1 and isinstance(axis_name[0], str)
        else ""
    )
    raise TypeError(
        f"{where}: `axis_name` must be the name (a str) of the mesh's tensor-parallel axis, e.g. "
        f"'tp'; got {axis_name!r} ({type(axis_name).__name__}).{hint}"
    )


def placement(where: str, axis_name: str, mesh: Any = None, fallbacks: Sequence[Any] = ()) -> Placement:
    """The mode a layer is in right now (see the module docstring). Raises only for an
    ``axis_name`` that is not a str (:func:`check_layer_axis`).

    ``fallbacks``: meshes to use, in order, when neither ``mesh`` nor a context mesh is set.
    """
    check_layer_axis(where, axis_name)
    size = bound_axis_size(axis_name)
    if size is not None:
        return Placement(local=True, tp=size)
    m = _context_mesh(mesh)
    if m is None:
        m = next((f for f in fallbacks if f is not None), None)
    if m is not None and axis_name in m.axis_names:
        return Placement(local=False, tp=int(m.shape[axis_name]), mesh=m)
    return Placement(local=False, tp=None, mesh=m)


def check_axis_in_mesh(where: str, axis_name: str, p: Placement) -> None:
    """A known mesh without ``axis_name`` is an error where the layer is built, not at its call."""
    if not p.local and p.tp is None and p.mesh is not None:
        raise ValueError(
            f"{where}: mesh axis {axis_name!r} (the layer's `axis_name`) is not an axis of the mesh "
            f"(axes {tuple(p.mesh.axis_names)}). Give `axis_name=` the mesh's tensor-parallel axis, "
            f"or use a mesh with an axis {axis_name!r}."
        )


def require_placement(where: str, axis_name: str, mesh: Any, fallbacks: Sequence[Any] = ()) -> Placement:
    p = placement(where, axis_name, mesh, fallbacks)
    if p.tp is None:
        if p.mesh is not None:
            raise ValueError(
                f"{where}: mesh axis {axis_name!r} is unknown here (a mesh with axes "
                f"{tuple(p.mesh.axis_names)}). Give `axis_name=` the mesh's tensor-parallel axis, "
                f"or call the layer inside `jax.shard_map` over {axis_name!r} (local shards)."
            )
        legacy = _legacy_mesh()
        found = (
            "no mesh"
            if legacy is None
            else (
                f"no mesh set with `jax.set_mesh`; the legacy `with mesh:` context holds a mesh with "
                f"axes {tuple(legacy.axis_names)}, which these layers do not read: use "
                f"`with jax.set_mesh(mesh):` instead"
            )
        )
        raise ValueError(
            f"{where}: mesh axis {axis_name!r} is unknown here ({found}). Call the layer under "
            f"`jax.set_mesh(mesh)` or give it `mesh=` (global arrays; outside `jax.jit`, parameters "
            f"sharded on a mesh are enough), or call it inside `jax.shard_map` over {axis_name!r} "
            f"(local shards)."
        )
    return p


def check_differentiable_here(where: str, p: Placement, arrays: Sequence[Any]) -> None:
    """Refuses, with what to do, a global-mode call differentiated eagerly (``jax.grad`` outside
    ``jax.jit``) on an Explicit-axes mesh that no ``jax.set_mesh`` holds: jax cannot run an eager
    gradient of arrays typed on such a mesh (its own message, "Length of device assignment 1 is
    not equal to the size of the mesh", comes after the layer, from any code, without saying why).
    ``jax.jit`` of the gradient, or ``jax.set_mesh`` around it, works."""
    mesh = p.mesh
    if p.local or not isinstance(mesh, jax.sharding.Mesh) or _context_mesh(None) is not None:
        return
    types = getattr(mesh, "axis_types", None) or ()
    if jax.sharding.AxisType.Explicit not in tuple(types):
        return
    differentiated = [a for a in arrays if type(a).__name__ in ("JVPTracer", "LinearizeTracer")]
    if not differentiated:
        return
    try:
        from jax._src import core as jax_core

        if jax_core.unsafe_am_i_under_a_jit():
            return
    except Exception:  # a private API: without it, no refusal (jax's own error stands)
        return
    raise ValueError(
        f"{where}: differentiated outside `jax.jit` on a mesh with Explicit axes "
        f"{tuple(mesh.axis_names)} (from the layer's `mesh=`, or the mesh it was built under) that "
        f"no `jax.set_mesh` holds: jax cannot compute an eager gradient of arrays on such a mesh. "
        f"Differentiate under `with jax.set_mesh(mesh):`, or jit the gradient "
        f"(`jax.jit(jax.grad(loss))`, `nnx.jit(nnx.grad(loss))`)."
    )
