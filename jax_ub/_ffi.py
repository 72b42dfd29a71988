"""Small helpers shared by the Python side of every FFI op family."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def varying_axes(x: Any) -> frozenset:
    """Mesh axes over which ``x`` varies inside ``shard_map`` (its vma), for any jax spelling."""
    return varying_axes_of_type(jax.typeof(x))


def varying_axes_of_type(aval: Any) -> frozenset:
    """:func:`varying_axes` of an abstract value (a jax aval or a ShapeDtypeStruct)."""
    vma: Any = getattr(aval, "vma", None)  # jax 0.7-0.9
    if vma is None:  # jax >= 0.10: ShapedArray.manual_axis_type.varying
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", frozenset())
    return frozenset(vma)


def vary(x: Any, axes: Any) -> Any:
    """``x``, made to vary over the mesh ``axes`` too where it does not yet (``lax.pcast`` to
    varying; ``lax.pvary`` on a jax without it). A no-op outside ``shard_map(check_vma=True)``."""
    missing = tuple(sorted(frozenset(axes) - varying_axes(x), key=str))
    if not missing:
        return x
    return lax.pcast(x, missing, to="varying") if hasattr(lax, "pcast") else cast(Any, lax).pvary(x, missing)


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
            out = out.update(
                manual_axis_type=type(mat)(
                    varying=union,
                    unreduced=getattr(mat, "unreduced", frozenset()),
                    reduced=getattr(mat, "reduced", frozenset()),
                )
            )
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
_TF32_NAMES = frozenset(
    {"default", "fastest", "bfloat16", "high", "tensorfloat32", "bfloat16_3x", "tf32_tf32_f32"}
)


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
        precision = cast(Any, jax.config).jax_default_matmul_precision
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
# The integers the C++ side decodes come from the extension's own enum table
# (:func:`jax_ub._ext.enums`, built from the C++ enum definitions), read when a CUDA call is built:
# Python keeps no copy of them. Only a name that has no C++ enumerator of its own is mapped here.

# push_merge runs push's kernel (AgAlgo::kPush); the ``merge`` attribute says how it multiplies.
_KERNEL_OF = {("ag", "push_merge"): "push"}
_TABLES = {"ag": "ag_algorithm", "rs": "rs_algorithm"}


def _enum(table: str) -> dict[str, int]:
    from jax_ub import _ext  # the extension loader; imported here, as only CUDA calls need it

    return _ext.enums()[table]


def schedule_code(collective: str, schedule: str) -> np.int32:
    """The ``algo`` attribute of an all-gather (``collective`` ``"ag"``) or reduce-scatter
    (``"rs"``) custom call running ``schedule`` (a name of :data:`jax_ub.methods.SCHEDULES`)."""
    if collective not in _TABLES:
        raise ValueError(f"no collective {collective!r}; have {sorted(_TABLES)}")
    table = _enum(_TABLES[collective])
    kernel = _KERNEL_OF.get((collective, schedule), schedule)
    if kernel not in table:
        raise ValueError(
            f"no {collective} schedule {schedule!r}; have "
            f"{sorted([*table, *(s for c, s in _KERNEL_OF if c == collective)])}"
        )
    return np.int32(table[kernel])


def dtype_code(dtype: Any) -> int:
    """The ``DType`` code of a GEMM operand dtype (float32, float16, bfloat16, or a float8)."""
    name = jnp.dtype(dtype).name
    table = _enum("dtype")
    if name not in table:
        raise ValueError(f"no GEMM dtype code for {name}; have {sorted(table)}")
    return table[name]


def gemm_types_code(a: Any, b: Any = None, out: Any = None, fast_accum: bool = False) -> int:
    """``gemm_warmup``'s ``dtype`` for a GEMM of ``a @ b -> out`` (``b``, ``out`` default to ``a``):
    ``a``'s code where all three are one dtype, else ``a | (b + 1) << 8 | (out + 1) << 16 |
    fast_accum << 24`` (the FP8 GEMMs, ``fast_accum`` their fast accumulation; ``GemmTypes::Code``
    in ``csrc/gemm/cublaslt.h``)."""
    ca = dtype_code(a)
    cb = ca if b is None else dtype_code(b)
    co = ca if out is None else dtype_code(out)
    if ca == cb == co and not fast_accum:
        return ca
    return ca | (cb + 1) << 8 | (co + 1) << 16 | int(bool(fast_accum)) << 24


def bulk_kind_code(collective: str) -> np.int32:
    """The ``kind`` attribute of ``jax_ub_bulk``: ``"ag"`` (all-gather) or ``"rs"``."""
    table = _enum("bulk_kind")
    if collective not in table:
        raise ValueError(f"no bulk kind {collective!r}; have {sorted(table)}")
    return np.int32(table[collective])


def failure_codes() -> dict[str, int]:
    """The test hook's failure points (``comm_inject_failure``), by name."""
    return dict(_enum("failure"))
