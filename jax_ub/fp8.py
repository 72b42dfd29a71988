"""FP8 in the jax_ub primitives: the recipe, current-scaling quantization, the checks of FP8
arguments, and the reference semantics (the CPU path and the oracle of every FP8 result).

Conventions (the scaled-matmul / cuBLASLt ``A_SCALE``/``B_SCALE`` ones):

* A scale is a float32 *dequantization* scale of shape ``()``, one per tensor: a float8 tensor
  ``q`` with scale ``s`` stands for ``q.astype(float32) * s``.
* Current scaling (:func:`quantize`): ``s = max(amax(|t|) / finfo(fp8).max, tiny)`` (exactly:
  :func:`scale_from_amax`) from the tensor just computed, and ``q = clip(t / s, -max, max)`` cast
  to the FP8 dtype (saturating). Over a mesh axis (``axis_name``) the amax is the ``pmax`` of the
  local ones, so every rank gets the same scale: what an all-gathered operand needs, since the
  GEMM applies one scale to all its rows.
* Operand pairs: ``e4m3 × e4m3``, ``e4m3 × e5m2``, ``e5m2 × e4m3``. ``e5m2 × e5m2`` is refused
  (cuBLASLt has no such kernel).
* The reference (:func:`all_gather_matmul`, :func:`matmul_reduce_scatter`, :func:`scaled_matmul`):
  dequantize both operands to float32, a float32 dot at ``HIGHEST`` precision, then the collective
  (the reduce-scatter sums float32 partials), then a cast to the output dtype (bfloat16 by
  default, float32 on request). The all-gather gathers the FP8 operand (one byte per element).
* XLA's FP8 path (:func:`scaled_dot`, what the ops run where they run through XLA: a TP axis of
  size 1, ``method="xla"``, off the CUDA path): ``lax.dot_general`` on the float8 operands into
  float32, times ``a_scale * b_scale``, cast; XLA's GPU backend hands that dot to cuBLASLt's FP8
  GEMM. It equals the reference up to float32 rounding order (bound in :func:`scaled_dot`).

:class:`FP8Recipe` is the option of :func:`jax_ub.all_gather_matmul` and friends that quantizes
higher-precision operands with current scaling before the communication; its backward is the
hybrid recipe (gradients in e5m2, documented in ``docs/fp8.md``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_ub import reference

__all__ = [
    "FP8Recipe",
    "all_gather_matmul",
    "dequantize",
    "matmul_reduce_scatter",
    "quantize",
    "scale_from_amax",
    "scaled_dot",
    "scaled_matmul",
]

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
FP8_DTYPES = (E4M3, E5M2)
FP8_NAMES = ", ".join(d.name for d in FP8_DTYPES)
# The output dtypes of an FP8 GEMM (cuBLASLt's D with FP8 inputs and fp32 compute).
OUT_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(np.float32))
OUT_NAMES = ", ".join(d.name for d in OUT_DTYPES)
# The dtypes the recipe quantizes from (those of jax_ub's higher-precision path).
HIGH_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(np.float16), np.dtype(np.float32))
_TINY = float(np.finfo(np.float32).tiny)


def is_fp8(dtype: Any) -> bool:
    try:
        return np.dtype(dtype) in FP8_DTYPES
    except TypeError:
        return False


def _name(dtype: Any) -> str:
    try:
        return np.dtype(dtype).name
    except TypeError:
        return repr(dtype)


@dataclasses.dataclass(frozen=True)
class FP8Recipe:
    """Quantize the operands of an op to FP8 with current scaling (per tensor), and run its
    backward in FP8 too.

    Attributes:
      fwd_dtype: the dtype of x and w in the forward: ``float8_e4m3fn`` (both operands share it,
        and ``e5m2 × e5m2`` has no kernel).
      bwd_dtype: the dtype of the output gradient ``dy`` in the backward (``float8_e5m2``, the
        hybrid recipe, or ``float8_e4m3fn``); ``None``: the backward runs in the operands' own
        precision (e.g. bfloat16) on the dequantized forward operands.
      out_dtype: the output dtype; ``None``: x's dtype. The FP8 GEMMs write bfloat16 or float32
        (a float16 output is computed in float32 and cast).
      fwd_fast_accum: the forward GEMMs (CUDA path) use cuBLASLt's fast accumulation (faster; an
        error that grows with k, ``docs/fp8.md``); the backward GEMMs always accumulate in full.
        Default off: the forward then meets the reference within the stated FP8 tolerance.
    """

    fwd_dtype: Any = E4M3
    bwd_dtype: Any = E5M2
    out_dtype: Any = None
    fwd_fast_accum: bool = False

    def __post_init__(self) -> None:
        fwd = _dtype_or_none(self.fwd_dtype)
        if fwd != E4M3:
            raise ValueError(
                f"FP8Recipe: `fwd_dtype` must be float8_e4m3fn (x and w are both quantized to it, "
                f"and float8_e5m2 x float8_e5m2 has no FP8 GEMM); got {_name(self.fwd_dtype)}"
            )
        bwd = _dtype_or_none(self.bwd_dtype)
        if bwd is not None and bwd not in FP8_DTYPES:
            raise ValueError(
                f"FP8Recipe: `bwd_dtype` must be one of {FP8_NAMES}, or None (backward in the "
                f"operands' precision); got {_name(self.bwd_dtype)}"
            )
        out = _dtype_or_none(self.out_dtype)
        if out is not None and out not in HIGH_DTYPES:
            raise ValueError(
                f"FP8Recipe: `out_dtype` must be one of "
                f"{', '.join(d.name for d in HIGH_DTYPES)}, or None (x's dtype); got {_name(self.out_dtype)}"
            )
        if not isinstance(self.fwd_fast_accum, bool):
            raise TypeError(f"FP8Recipe: `fwd_fast_accum` must be a bool; got {self.fwd_fast_accum!r}")
        object.__setattr__(self, "fwd_dtype", fwd)
        object.__setattr__(self, "bwd_dtype", bwd)
        object.__setattr__(self, "out_dtype", out)


def _dtype_or_none(d: Any) -> np.dtype | None:
    if d is None:
        return None
    try:
        return np.dtype(d)
    except TypeError as e:
        raise TypeError(f"FP8Recipe: a dtype was expected; got {d!r}") from e


# ----------------------------------------------------------------------------------------------
# Current scaling.


def scale_from_amax(amax: jax.Array, dtype: Any) -> jax.Array:
    """The float32 dequantization scale ``max(amax * (1 / finfo(dtype).max), tiny)``, the
    reciprocal rounded to float32 first (XLA turns a division by a constant into that product, so
    it is written so: every backend computes the same scale), ``tiny`` float32's smallest normal
    number. The floor applies to the scale, not to the amax: ``tiny / max`` would be a subnormal
    float32, which CPUs and GPUs flush to zero (then ``0 / 0`` for an all-zero tensor)."""
    inv = np.float32(1.0) / np.float32(jnp.finfo(dtype).max)
    return jnp.maximum(jnp.asarray(amax, jnp.float32) * inv, _TINY)


def quantize(t: jax.Array, dtype: Any, axis_name: Any = None) -> tuple[jax.Array, jax.Array]:
    """``(q, scale)``: ``t`` in FP8 ``dtype`` with current scaling (see the module docstring).

    ``axis_name``: the mesh axis (bound by an enclosing ``shard_map``) whose ranks share one scale,
    the ``pmax`` of their amax; ``None``: this tensor's own."""
    t32 = t.astype(jnp.float32)
    amax = jnp.max(jnp.abs(t32)) if t.size else jnp.zeros((), jnp.float32)
    if axis_name is not None:
        amax = lax.pmax(amax, axis_name)
    scale = scale_from_amax(amax, dtype)
    fmax = float(jnp.finfo(dtype).max)
    q = jnp.clip(t32 / scale, -fmax, fmax).astype(dtype)
    return q, scale


def dequantize(q: jax.Array, scale: jax.Array, dtype: Any = jnp.float32) -> jax.Array:
    """``q.astype(float32) * scale``, cast to ``dtype``."""
    return (q.astype(jnp.float32) * scale).astype(dtype)


# ----------------------------------------------------------------------------------------------
# Checks (trace time), each error naming the public function, what was expected and what was got.


def check_pair(fn: str, x_dtype: Any, w_dtype: Any, names: tuple[str, str] = ("x", "w")) -> None:
    """Both FP8, and not ``e5m2 × e5m2``."""
    a, b = np.dtype(x_dtype), np.dtype(w_dtype)
    if a not in FP8_DTYPES or b not in FP8_DTYPES:
        raise TypeError(
            f"{fn}: with `scales`, `{names[0]}` and `{names[1]}` must both be FP8 ({FP8_NAMES}); got "
            f"{names[0]} {a.name}, {names[1]} {b.name} (for higher-precision operands pass "
            f"fp8=jax_ub.FP8Recipe() instead of scales)"
        )
    if a == E5M2 and b == E5M2:
        raise TypeError(
            f"{fn}: FP8 operand dtypes must be float8_e4m3fn x float8_e4m3fn, float8_e4m3fn x "
            f"float8_e5m2 or float8_e5m2 x float8_e4m3fn (there is no float8_e5m2 x float8_e5m2 "
            f"GEMM); got {names[0]} {a.name}, {names[1]} {b.name}"
        )


def check_scales(
    fn: str, scales: Any, names: tuple[str, str] = ("x_scale", "w_scale")
) -> tuple[jax.Array, jax.Array]:
    """``scales`` is a pair (``names``: ``(x_scale, w_scale)``), each a float32 array of shape
    ``()``."""
    if not isinstance(scales, (tuple, list)) or len(scales) != 2:
        raise TypeError(
            f"{fn}: `scales` must be a pair ({names[0]}, {names[1]}) of float32 arrays of shape (); "
            f"got {type(scales).__name__}"
            + (f" of length {len(scales)}" if isinstance(scales, (tuple, list)) else "")
        )
    for name, s in zip(names, scales, strict=True):
        if not (hasattr(s, "shape") and hasattr(s, "dtype")):
            raise TypeError(
                f"{fn}: `scales`' {name} must be a float32 array of shape (); got {type(s).__name__} "
                f"(e.g. jnp.float32({s!r}))"
            )
        if tuple(s.shape) != () or np.dtype(s.dtype) != np.float32:
            raise TypeError(
                f"{fn}: `scales`' {name} must be a float32 array of shape () (one dequantization "
                f"scale per tensor); got {np.dtype(s.dtype).name} of shape {tuple(s.shape)}"
            )
    return scales[0], scales[1]


def out_dtype(fn: str, preferred_element_type: Any, default: Any) -> np.dtype:
    """The output dtype of an FP8 call: ``preferred_element_type`` (bfloat16 or float32), or
    ``default``."""
    if preferred_element_type is None:
        return np.dtype(default)
    try:
        d = np.dtype(preferred_element_type)
    except TypeError:
        d = None
    if d not in OUT_DTYPES:
        raise TypeError(
            f"{fn}: `preferred_element_type` of an FP8 call must be one of {OUT_NAMES} (the output "
            f"dtypes of an FP8 GEMM), or None; got {_name(preferred_element_type)}"
        )
    return d


def call_mode(
    fn: str,
    a: Any,
    b: Any,
    scales: Any,
    recipe: Any,
    preferred_element_type: Any,
    names: tuple[str, str] = ("x", "w"),
) -> tuple[str, Any, np.dtype] | None:
    """The checks of a call's FP8 arguments for its GEMM ``a @ b`` (``names``: how the call names
    a and b): None for a call without them, else ``("scaled", (a_scale, b_scale), out_dtype)``
    (float8 operands with ``scales``) or ``("recipe", recipe, out_dtype)`` (``fp8=``)."""
    na, nb = names
    da, db = np.dtype(a.dtype), np.dtype(b.dtype)
    got = f"got {na} {da.name}, {nb} {db.name}"
    if recipe is not None and not isinstance(recipe, FP8Recipe):
        raise TypeError(f"{fn}: `fp8` must be a jax_ub.FP8Recipe or None; got {type(recipe).__name__}")
    if scales is not None and recipe is not None:
        raise TypeError(
            f"{fn}: pass either `scales` (float8 {na} and {nb} with their scales) or `fp8` (a recipe "
            f"that quantizes higher-precision {na} and {nb}), not both; got both"
        )
    if scales is None and recipe is None:
        if is_fp8(da) or is_fp8(db):
            raise TypeError(
                f"{fn}: float8 operands need their dequantization scales: scales=({na}_scale, "
                f"{nb}_scale), float32 of shape (); {got} and no scales"
            )
        if preferred_element_type is not None and np.dtype(preferred_element_type) != da:
            raise TypeError(
                f"{fn}: `preferred_element_type` applies to FP8 calls (scales= or fp8=); a {da.name} "
                f"call outputs {da.name}; got {np.dtype(preferred_element_type).name}"
            )
        return None
    if recipe is not None:
        if is_fp8(da) or is_fp8(db) or da != db:
            raise TypeError(
                f"{fn}: `fp8=FP8Recipe(...)` quantizes `{na}` and `{nb}` of one dtype of "
                f"{', '.join(d.name for d in HIGH_DTYPES)}; {got} (float8 operands: pass "
                f"scales=({na}_scale, {nb}_scale) instead)"
            )
        if (
            preferred_element_type is not None
            and recipe.out_dtype is not None
            and np.dtype(preferred_element_type) != recipe.out_dtype
        ):
            raise TypeError(
                f"{fn}: `preferred_element_type` and the recipe's out_dtype differ; got "
                f"{np.dtype(preferred_element_type).name} and {recipe.out_dtype.name}"
            )
        default = recipe.out_dtype if recipe.out_dtype is not None else da
        return "recipe", recipe, out_dtype(fn, preferred_element_type, default)
    check_pair(fn, da, db, names)
    pair = check_scales(fn, scales, (f"{na}_scale", f"{nb}_scale"))
    return "scaled", pair, out_dtype(fn, preferred_element_type, np.dtype(jnp.bfloat16))


def kernel_out(dtype: Any) -> np.dtype:
    """The dtype an FP8 GEMM writes for a result wanted in ``dtype``: itself where the GEMM can
    write it (bfloat16, float32), else float32 (then cast)."""
    d = np.dtype(dtype)
    return d if d in OUT_DTYPES else np.dtype(np.float32)


# ----------------------------------------------------------------------------------------------
# The reference (the oracle): dequantize, float32 dot at HIGHEST precision, collective, cast.


def scaled_matmul(
    a: jax.Array, b: jax.Array, a_scale: jax.Array, b_scale: jax.Array, out_dtype: Any = jnp.bfloat16
) -> jax.Array:
    """``(dequantize(a) @ dequantize(b))`` in float32, cast to ``out_dtype``: ``a[..., m, k]``,
    ``b[k, n]``."""
    y = reference.matmul(dequantize(a, a_scale), dequantize(b, b_scale), precision=lax.Precision.HIGHEST)
    return y.astype(out_dtype)


def scaled_dot(
    a: jax.Array, b: jax.Array, a_scale: jax.Array, b_scale: jax.Array, out_dtype: Any = jnp.bfloat16
) -> jax.Array:
    """:func:`scaled_matmul`'s product as XLA's own FP8 GEMM: ``lax.dot_general`` of the float8
    ``a[..., m, k]`` and ``b[k, n]`` with a float32 result, times ``a_scale * b_scale``, cast to
    ``out_dtype``. XLA's GPU backend rewrites a float8 dot with a float32 result into cuBLASLt's
    FP8 GEMM (with the precision it gets here, DEFAULT, its plan enables fast accumulation:
    ``docs/fp8.md``); its CPU backend converts the operands to float32 and runs a float32 dot (every
    pair, e5m2 x e5m2 included, which the checks refuse before).

    Against :func:`scaled_matmul` only the float32 rounding differs: here the products ``qa * qb``
    are exact in float32 and the sum is rounded, then scaled; there the operands are dequantized
    (rounded) first. With ``u = eps(float32) / 2`` each result is within ``(k - 1) u + 3 u`` of the
    exact ``a_scale * b_scale * sum(qa * qb)``, relative to ``T = a_scale * b_scale * sum |qa qb|``,
    for any order of the sum, so the two differ by at most ``(k + 2) eps(float32) T`` before the
    cast to ``out_dtype`` (one unit in its last place more after it)."""
    dims = (((a.ndim - 1,), (0,)), ((), ()))
    dot = functools.partial(lax.dot_general, dimension_numbers=dims, preferred_element_type=jnp.float32)
    acc = reference._product(dot, a, b)
    return (acc * (a_scale * b_scale)).astype(out_dtype)


# An FP8 GEMM of the collectives below: ``dot(a8, b8, a_scale, b_scale, out_dtype)``.
Dot = Callable[..., jax.Array]


def all_gather_matmul(
    x: jax.Array,
    w: jax.Array,
    x_scale: jax.Array,
    w_scale: jax.Array,
    axis_name: Any,
    *,
    gather_axis: int = 0,
    out_dtype: Any = jnp.bfloat16,
    dot: Dot = scaled_matmul,
) -> tuple[jax.Array, jax.Array]:
    """``(y, x_gathered)``: the FP8 x gathered (FP8 bytes) along ``gather_axis``, then ``dot``
    (:func:`scaled_matmul`, the reference; :func:`scaled_dot`, XLA's FP8 GEMM). ``x_scale`` must be
    the same on every rank of the axis."""
    x_full = lax.all_gather(x, axis_name, axis=gather_axis % x.ndim, tiled=True)
    return dot(x_full, w, x_scale, w_scale, out_dtype), x_full


def matmul_reduce_scatter(
    x: jax.Array,
    w: jax.Array,
    x_scale: jax.Array,
    w_scale: jax.Array,
    axis_name: Any,
    *,
    scatter_axis: int = 0,
    out_dtype: Any = jnp.bfloat16,
    dot: Dot = scaled_matmul,
) -> jax.Array:
    """Each rank's float32 partial product (its own scales; ``dot`` as in
    :func:`all_gather_matmul`), reduce-scattered in float32 along ``scatter_axis``, cast to
    ``out_dtype``."""
    partial = dot(x, w, x_scale, w_scale, jnp.float32)
    y = lax.psum_scatter(partial, axis_name, scatter_dimension=scatter_axis % x.ndim, tiled=True)
    return y.astype(out_dtype)
