"""The program's mesh must group and order the TP devices as ``jax_ub.initialize`` did.

A jax_ub custom call finds its rank from the device it runs on: the communicator that
``initialize(mesh, axis)`` created there. ``shard_map`` numbers the same device by its position
along ``axis`` in *its* mesh. When the two meshes order (or group) the devices differently, every
shard would land in another rank's rows, a silently wrong result. Inside the custom call there is
no way to see the program's partition; the mesh is only visible when ``shard_map``'s body is
lowered. So each CUDA op passes its operand through :func:`check`, an identity primitive that
emits nothing and, at lowering, compares the lowering context's mesh with the communicators'
groups, raising a ``ValueError`` that names both on a mismatch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import Mesh

Groups = tuple[tuple[int, ...], ...]

_p = Primitive("jax_ub_mesh_check")
_p.def_impl(lambda x, **_: x)
_p.def_abstract_eval(lambda x, **_: x)
batching.primitive_batchers[_p] = lambda args, dims, **kw: (_p.bind(args[0], **kw), dims[0])
ad.primitive_jvps[_p] = lambda primals, tangents, **kw: (_p.bind(primals[0], **kw), tangents[0])


def check(x: Any, *, what: str, axis: str, groups: Groups) -> Any:
    """``x`` unchanged; lowering it inside ``shard_map`` checks that the mesh's groups along
    ``axis`` (device ids, in axis order) are among ``groups``, the communicators' (rank order)."""
    return _p.bind(x, what=what, axis=axis, groups=groups)


def program_groups(mesh: Any, axis: str) -> Groups | None:
    """Device ids of each group along ``axis`` of a concrete mesh, in axis order (None when the
    mesh is abstract or lacks the axis)."""
    if not isinstance(mesh, Mesh):  # an AbstractMesh (or none): no devices to compare
        return None
    devices, names = mesh.devices, tuple(mesh.axis_names)
    if axis not in names:
        return None
    devs = np.moveaxis(np.asarray(devices), names.index(axis), -1)
    return tuple(tuple(int(d.id) for d in row) for row in devs.reshape(-1, devs.shape[-1]))


def mismatch(what: str, axis: str, program: Groups, groups: Groups) -> str | None:
    known = set(groups)
    bad = [g for g in program if g not in known]
    if not bad:
        return None
    return (
        f"{what}: mesh axis {axis!r} of this program has the device group {list(bad[0])} "
        f"(device ids in axis order), but jax_ub.initialize created the groups "
        f"{[list(g) for g in groups]} (in rank order). Each GPU would run as another rank than "
        f"shard_map's axis index and the shards would land in the wrong rows. Call "
        f"jax_ub.initialize with the mesh that shard_map uses (the same devices in the same "
        f"order along {axis!r})."
    )


def _lower(ctx: Any, x: Any, *, what: str, axis: str, groups: Groups) -> list[Any]:
    mesh = getattr(ctx.module_context.axis_context, "mesh", None)
    program = program_groups(mesh, axis)
    if program is not None:
        msg = mismatch(what, axis, program, groups)
        if msg:
            raise ValueError(msg)
    return [x]


mlir.register_lowering(_p, _lower)
