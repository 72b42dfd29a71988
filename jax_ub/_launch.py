"""What every CUDA-path op does before its custom call: find the mesh axis's communicator (with the
errors that say why there is none), put the collective's axis in front, prepare the GEMMs it will
run, and have the operand check the program's mesh when it is lowered."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jax_ub import _ext, _ffi, _mesh_check, _validate, comm, gemm, methods


def comm_set(axis_name: Any, what: str, method: str | None = None) -> comm.CommSet:
    """The communicator set of ``axis_name`` for a call of ``what``, checked against the traced
    axis; ``method``: the call's, named in the errors (``"nccl"`` also needs transport nccl)."""
    if _validate.one_axis(axis_name) is None:
        how = f"method={method!r}" if method else "the CUDA path"
        raise ValueError(
            f"{what}: {how} runs over one mesh axis, and axis_name {axis_name!r} "
            f"names several: a jax_ub communicator spans one mesh axis. Use "
            f"method='auto' or 'xla' (XLA's collective over these axes), or build the "
            f"mesh with one axis for the TP group"
        )
    axis = _validate.one_axis(axis_name)
    s = comm.get(axis)
    if s is None:
        ok, why = _ext.cuda_path_available()
        if not ok:
            raise ValueError(
                f"{what}: no jax_ub communicator for mesh axis {axis!r}: the CUDA "
                f"path is unavailable here ({why}), so jax_ub.initialize created "
                f"none. The public ops (all_gather_matmul, ...) run XLA's reference "
                f"there; this transport-level call has none"
            )
        raise ValueError(
            f"{what}: no jax_ub communicator for mesh axis {axis!r}: call "
            f"jax_ub.initialize(mesh, axis={axis!r}) before tracing"
        )
    if not _validate.bound_by_shard_map(axis):
        how = f"method={method!r}" if method else "the CUDA path"
        raise ValueError(
            f"{what}: axis_name {axis!r} is bound here by jax.vmap (or pmap), not by a "
            f"jax.shard_map over the mesh given to jax_ub.initialize; {how} needs "
            f"the shard_map. Use method='auto' or 'xla' (XLA's collective over the "
            f"vmap axis)"
        )
    if method == methods.NCCL and s.transport != "nccl":
        raise ValueError(
            f"{what}: method='nccl' needs jax_ub.initialize(mesh, axis={axis!r}, "
            f"transport='nccl'); this axis was initialized with transport "
            f"{s.transport!r}"
        )
    size = jax.lax.axis_size(axis)
    if size != s.world:
        raise ValueError(
            f"{what}: axis {axis!r} has size {size} here but the communicator "
            f"was initialized with groups of {s.world}"
        )
    return s


def checked(x: jax.Array, s: comm.CommSet, what: str) -> jax.Array:
    """``x`` as the custom call's operand; lowering it inside shard_map checks that the program's
    mesh groups and orders the axis's devices as ``initialize`` did (:mod:`jax_ub._mesh_check`)."""
    return _mesh_check.check(x, what=what, axis=s.axis, groups=s.devices_key)


def front(x: jax.Array, axis: int) -> jax.Array:
    """``x`` with dimension ``axis`` moved to the front (the kernels gather/scatter rows)."""
    return x if axis == 0 else jnp.moveaxis(x, axis, 0)


def back(x: jax.Array, axis: int) -> jax.Array:
    """The inverse of :func:`front`."""
    return x if axis == 0 else jnp.moveaxis(x, 0, axis)


def warm(
    s: comm.CommSet,
    m: int,
    n: int,
    k: int,
    dtype: Any,
    precision: Any,
    accumulate: bool = False,
    reserve_sms: int = 0,
    ld: int = 0,
    w_dtype: Any = None,
    out_dtype: Any = None,
    fast_accum: bool = False,
) -> None:
    """Prepares (and tunes, ``JAX_UB_GEMM_TUNE``) the chunk GEMM on every local GPU at trace time:
    a kernel loaded lazily inside an op can stall the whole process (the
    context-wide module load waits for a peer GPU that waits in this op). ``w_dtype`` /
    ``out_dtype``: the FP8 chunk GEMMs' (``dtype`` is x's); ``fast_accum``: their accumulation."""
    ws = _ffi.workspace_bytes()  # one GEMM at a time
    gemm.warm(
        [dev for dev, _, _ in s.local],
        m,
        n,
        k,
        dtype,
        precision,
        workspace_bytes=ws,
        accumulate=accumulate,
        reserve_sms=reserve_sms,
        ld=ld,
        b_dtype=w_dtype,
        out_dtype=out_dtype,
        fast_accum=fast_accum,
    )
