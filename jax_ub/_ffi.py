"""Small helpers shared by the Python side of every FFI op family."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def varying_axes(x: Any) -> frozenset:
    """Mesh axes over which ``x`` varies inside ``shard_map`` (its vma), for any jax spelling."""
    return varying_axes_of_type(jax.typeof(x))


def varying_axes_of_type(aval: Any) -> frozenset:
    """:func:`varying_axes` of an abstract value (a jax aval or a ShapeDtypeStruct)."""
    vma = getattr(aval, "vma", None)  # jax 0.7-0.9
    if vma is None:  # jax >= 0.10: ShapedArray.manual_axis_type.varying
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", frozenset())
    return frozenset(vma)


def vary(x: Any, axes: Any) -> Any:
    """``x``, made to vary over the mesh ``axes`` too where it does not yet (``lax.pcast`` to
    varying; ``lax.pvary`` on a jax without it). A no-op outside ``shard_map(check_vma=True)``."""
    missing = tuple(sorted(frozenset(axes) - varying_axes(x), key=str))
    if not missing:
        return x
    return lax.pcast(x, missing, to="varying") if hasattr(lax, "pcast") else lax.pvary(x, missing)


def result_type(shape: Sequence[int], dtype: Any, *inputs: Any) -> Any:
    """FFI result type that keeps shard_map's varying-axes info (vma) of the inputs.

    The result varies over the union of the inputs' varying axes. A bare ShapeDtypeStruct would
    be typed invariant, and under ``check_vma=True`` autodiff would then psum the cotangents
    flowing back into it over those axes (gradients off by the axis size).
    """
    avals = [jax.typeof(x) for x in inputs]
    union = frozenset().union(*(varying_axes_of_type(a) for a in avals))
    i = max(range(len(avals)), key=lambda j: len(varying_axes_of_type(avals[j])))
    out = avals[i].update(shape=tuple(shape), dtype=jnp.dtype(dtype), weak_type=False)
    if union != varying_axes_of_type(out):
        mat = getattr(out, "manual_axis_type", None)
        if mat is not None:
            out = out.update(manual_axis_type=type(mat)(
                varying=union, unreduced=getattr(mat, "unreduced", frozenset()),
                reduced=getattr(mat, "reduced", frozenset())))
        else:
            out = out.update(vma=union)
    return out


def call(target: str, result_types: Any) -> Any:
    """``jax.ffi.ffi_call`` of one of jax_ub's targets. Under ``jax.vmap`` the custom call runs
    once per batch element (``vmap_method="sequential"``): its kernels take unbatched operands,
    and the collectives stay one op per element, in the same order on every rank."""
    return jax.ffi.ffi_call(target, result_types, vmap_method="sequential")


def workspace_type(*inputs: Any) -> Any:
    """A uint8 scratch result for cuBLASLt (``JAX_UB_GEMM_WORKSPACE_MIB``), allocated by XLA.

    A result rather than FFI scratch memory: XLA plans it with the program's other buffers.
    """
    return result_type((workspace_bytes(),), jnp.uint8, *inputs)


def workspace_bytes() -> int:
    """cuBLASLt workspace bytes of one GEMM call (``JAX_UB_GEMM_WORKSPACE_MIB``; at least 256: a
    plan key's part, so the warm-up at trace time must use the same)."""
    from jax_ub import config

    return max(int(config.get().gemm_workspace_mib) << 20, 256)


# Precision names (any case) under which XLA lets a float32 GEMM use TF32 on NVIDIA GPUs: at most
# HIGH (XLA's rule for a dot without an algorithm), or the TF32 dot algorithm.
_TF32_NAMES = frozenset({"default", "fastest", "bfloat16", "high", "tensorfloat32", "bfloat16_3x",
                         "tf32_tf32_f32"})


def tf32_allowed(precision: Any) -> bool:
    """Whether a float32 GEMM may use TF32, following what XLA does on NVIDIA GPUs.

    ``DEFAULT`` and ``HIGH`` (also spelled "default", "fastest", "bfloat16", "high",
    "tensorfloat32", "bfloat16_3x") allow it; ``HIGHEST`` ("highest", "float32") forbids it;
    ``None`` follows ``jax_default_matmul_precision`` (unset: TF32 allowed). A dot algorithm
    preset (or its name): ``TF32_TF32_F32`` and ``DEFAULT`` allow it, and every
    other (``F32_F32_F32``, ``BF16_BF16_F32``, ...) gets full float32, which cuBLASLt can always
    honour and which is at least as precise as asked. A pair needs both entries to allow it.
    """
    if precision is None:
        precision = jax.config.jax_default_matmul_precision
    if precision is None:
        return True
    if isinstance(precision, (tuple, list)):
        return all(tf32_allowed(p) for p in precision)
    if isinstance(precision, lax.DotAlgorithmPreset):
        precision = precision.name
    if isinstance(precision, str):
        return precision.strip().lower() in _TF32_NAMES
    return precision in (lax.Precision.DEFAULT, lax.Precision.HIGH)


# ------------------------------------------------------------------------------------------------
# The integers the C++ side decodes, each mapping behind one function (its values mirror the enums
# of csrc/: AgAlgo and RsAlgo in csrc/overlap/schedules.h, DType in csrc/gemm/cublaslt.h, the bulk
# op's kind, the test hook's failure points).

# (collective, schedule) -> AgAlgo / RsAlgo. push_merge is push's kernel (AgAlgo::kPush): the
# ``merge`` attribute says how it multiplies.
_SCHEDULE_CODES = {("ag", "ring"): 0, ("ag", "all_peer"): 1, ("ag", "push"): 2, ("ag", "push_merge"): 2,
                   ("rs", "ring"): 0, ("rs", "pipeline"): 1, ("rs", "chain"): 2, ("rs", "columns"): 3}
_DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}
_BULK_KINDS = {"ag": 0, "rs": 1}  # the bulk op's collective: 0 all-gather, 1 reduce-scatter
_FAILURE_CODES = {"none": 0, "before": 1, "after": 2, "stall_watchdog": 3, "drop_poison": 4}


def schedule_code(collective: str, schedule: str) -> np.int32:
    """The ``algo`` attribute of an all-gather (``collective`` ``"ag"``) or reduce-scatter
    (``"rs"``) custom call running ``schedule`` (a name of :data:`jax_ub.methods.SCHEDULES`)."""
    try:
        return np.int32(_SCHEDULE_CODES[(collective, schedule)])
    except KeyError:
        raise ValueError(f"no {collective} schedule {schedule!r}; have "
                         f"{sorted(s for c, s in _SCHEDULE_CODES if c == collective)}") from None


def dtype_code(dtype: Any) -> int:
    """The ``DType`` code of a GEMM operand dtype (float32, float16 or bfloat16)."""
    name = jnp.dtype(dtype).name
    try:
        return _DTYPE_CODES[name]
    except KeyError:
        raise ValueError(f"no GEMM dtype code for {name}; have {sorted(_DTYPE_CODES)}") from None


def bulk_kind_code(collective: str) -> np.int32:
    """The ``kind`` attribute of ``jax_ub_bulk``: ``"ag"`` (all-gather) or ``"rs"``."""
    return np.int32(_BULK_KINDS[collective])


def failure_codes() -> dict[str, int]:
    """The test hook's failure points (``comm_inject_failure``), by name."""
    return dict(_FAILURE_CODES)
