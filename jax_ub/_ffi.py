"""Small helpers shared by the Python side of every FFI op family."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax


def result_type(shape: Sequence[int], dtype: Any, *inputs: Any) -> Any:
    """FFI result type that keeps shard_map's varying-axes info (vma) of the inputs.

    A bare ShapeDtypeStruct has no vma, which breaks ``shard_map(check_vma=True)``; derive the type
    from an input's aval instead, with the union of the inputs' vma.
    """
    vma: frozenset = frozenset()
    for x in inputs:
        vma |= getattr(jax.typeof(x), "vma", frozenset())
    aval = jax.typeof(inputs[0])
    try:
        return aval.update(shape=tuple(shape), dtype=jnp.dtype(dtype), vma=vma, weak_type=False)
    except TypeError:
        return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def workspace_type(*inputs: Any) -> Any:
    """A uint8 scratch result for cuBLASLt (``JAX_UB_GEMM_WORKSPACE_MIB``), allocated by XLA.

    A result rather than FFI scratch memory: XLA plans it with the program's other buffers.
    """
    from jax_ub import config

    nbytes = max(int(config.get().gemm_workspace_mib) << 20, 256)
    return result_type((nbytes,), jnp.uint8, *inputs)


def tf32_allowed(precision: Any) -> bool:
    """Whether a float32 GEMM may use TF32, following jax's precision rules.

    ``HIGHEST``/``HIGH``/"float32"/"highest" forbid it; ``None``/``DEFAULT`` follow
    ``jax_default_matmul_precision`` (whose default lets XLA use TF32 on GPUs).
    """
    if precision is None:
        precision = jax.config.jax_default_matmul_precision
    if precision is None:
        return True
    if isinstance(precision, (tuple, list)):
        return all(tf32_allowed(p) for p in precision)
    if isinstance(precision, str):
        return precision.lower() in ("default", "bfloat16", "tensorfloat32", "fastest")
    return precision == lax.Precision.DEFAULT
