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
