"""``jax_ub.matmul``: the cuBLASLt GEMM custom call (``csrc/ffi/gemm.cc``), building block of the
overlap kernels, with ``jnp.matmul`` as the reference path off-GPU; and its FP8 form
:func:`fp8_matmul` (float8 operands, per-tensor scales; off-GPU XLA's FP8 dot,
:func:`jax_ub.fp8.scaled_dot`)."""

from __future__ import annotations

import logging
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jax_ub import _ext, _ffi, _validate, reference
from jax_ub import fp8 as fp8_lib

_log = logging.getLogger("jax_ub")

_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
TARGET = "jax_ub_gemm"
# ``matmul``'s output, for jax.checkpoint policies: on the CUDA path it is a custom call, which
# dot-based policies do not keep (one of ``jax_ub.CHECKPOINT_NAMES``).
OUT_NAME = "jax_ub_matmul_out"


def _check(x: jax.Array, w: jax.Array) -> None:
    _validate.check_array("matmul", "x", x)
    _validate.check_array("matmul", "w", w)
    if x.ndim < 2 or w.ndim != 2:
        raise ValueError(
            f"matmul: x must be `[..., m, k]` (>= 2-D) and w `[k, n]` (2-D); got x "
            f"{_validate.shape_str(x.shape)}, w {_validate.shape_str(w.shape)}"
        )
    if x.dtype != w.dtype:
        raise TypeError(f"matmul: x and w must share a dtype; got x {x.dtype}, w {w.dtype}")
    if x.dtype not in [jnp.dtype(d) for d in _DTYPES]:
        raise TypeError(f"matmul: dtype must be bfloat16, float16 or float32; got {x.dtype}")
    if x.shape[-1] != w.shape[0]:
        raise ValueError(
            f"matmul: contracting dims differ: x is {_validate.shape_str(x.shape)} (k={x.shape[-1]}), "
            f"w is {_validate.shape_str(w.shape)} (k={w.shape[0]})"
        )


_warmed: dict[tuple, dict] = {}


def warm(
    devices: Any,
    m: int,
    n: int,
    k: int,
    dtype: Any,
    precision: Any,
    *,
    workspace_bytes: int | None = None,
    accumulate: bool = False,
    reserve_sms: int = 0,
    ld: int = 0,
    row_offsets: bool = True,
    trans_a: bool = False,
    trans_b: bool = False,
    b_dtype: Any = None,
    out_dtype: Any = None,
    fast_accum: bool = False,
) -> list[dict]:
    """Prepares the row-major GEMM ``[m, k] @ [k, n]`` on each CUDA ordinal in ``devices`` at trace
    time: builds the cuBLASLt plan, loads its kernel (lazy loading at execute time can synchronize
    a GPU while its peers wait on it) and, with ``JAX_UB_GEMM_TUNE`` > 1, times that many of
    cuBLASLt's candidate algorithms and keeps the fastest for every later call of that shape.

    ``accumulate``: the GEMM with an addend (``y = x @ w + c``, the chain GEMM->RS), whose kernel
    may differ from the plain one's. ``reserve_sms``: SMs the GEMM leaves free (the bulk
    reduce-scatter's ``JAX_UB_BULK_REDUCE_SMS``). ``ld`` > ``n``: ``w`` and ``y`` are column
    blocks of matrices with that row stride (the chain GEMM->RS's column pieces).
    ``row_offsets``: the op runs this GEMM on row blocks of larger matrices (chunks, pieces), so
    where a row of ``x`` (``k``) or of ``y`` (``ld`` or ``n``) is not a multiple of 16 bytes it also
    meets pointers short of 16-byte alignment, whose plans (another kernel) are prepared too.
    ``trans_a`` / ``trans_b``: ``x`` stored ``[k, m]`` / ``w`` stored ``[n, k]`` (the backward GEMMs
    of :func:`jax_ub.matmul`; whole buffers, so with ``row_offsets=False``).
    ``b_dtype`` / ``out_dtype``: ``w``'s and ``y``'s dtypes where they are not ``dtype``'s (the FP8
    GEMMs: float8 ``dtype`` and ``b_dtype``, ``w`` stored ``[n, k]``, a bfloat16 or float32 result);
    ``fast_accum``: an FP8 GEMM with cuBLASLt's fast accumulation (another kernel, its own plan).
    ``workspace_bytes``: as the call will pass (default: ``JAX_UB_GEMM_WORKSPACE_MIB``). Returns
    one ``{tuned, candidates, chosen, heuristic_ms, best_ms}`` per device (cached per shape).
    """
    from jax_ub import config

    cfg = config.get()
    tf32 = bool(_ffi.tf32_allowed(precision))
    ws = workspace_bytes if workspace_bytes is not None else _ffi.workspace_bytes()
    name = jnp.dtype(dtype).name
    b_name = jnp.dtype(dtype if b_dtype is None else b_dtype).name
    out_name = jnp.dtype(dtype if out_dtype is None else out_dtype).name
    if fp8_lib.is_fp8(name):
        trans_b = True  # an FP8 GEMM's w is stored [n, k]
    es = jnp.dtype(dtype).itemsize
    unaligned_a = bool(row_offsets and (k * es) % 16)
    unaligned_c = bool(row_offsets and (max(ld, n) * jnp.dtype(out_name).itemsize) % 16)
    mod = _ext.loaded_extension()
    out = []
    for dev in devices:
        key = (
            int(dev),
            int(m),
            int(n),
            int(k),
            name,
            tf32,
            int(ws),
            int(cfg.gemm_tune),
            bool(accumulate),
            int(reserve_sms),
            int(ld),
            row_offsets,
            bool(trans_a),
            bool(trans_b),
            b_name,
            out_name,
            bool(fast_accum),
        )
        if key not in _warmed:
            r = _warmed[key] = dict(
                mod.gemm_warmup(
                    int(dev),
                    int(m),
                    int(n),
                    int(k),
                    _ffi.gemm_types_code(name, b_name, out_name, bool(fast_accum)),
                    tf32,
                    int(ws),
                    tune_candidates=int(cfg.gemm_tune),
                    accumulate=bool(accumulate),
                    reserve_sms=int(reserve_sms),
                    ld=int(ld),
                    unaligned_a=unaligned_a,
                    unaligned_c=unaligned_c,
                    trans_a=bool(trans_a),
                    trans_b=bool(trans_b),
                )
            )
            if r["candidates"]:
                _log.debug(
                    "GEMM [%d, %d] @ [%d, %d] %s on GPU %d: tuning kept candidate %d of %d "
                    "(%.3f ms; the heuristic's first %.3f ms)",
                    m,
                    k,
                    k,
                    n,
                    name,
                    dev,
                    r["chosen"],
                    r["candidates"],
                    r["best_ms"],
                    r["heuristic_ms"],
                )
        out.append(_warmed[key])
    return out


def _local_cuda_ordinals() -> list[int]:
    try:
        devs = jax.local_devices(backend="cuda")
    except RuntimeError:
        return []
    return [d.local_hardware_id if d.local_hardware_id is not None else d.id for d in devs]


def gemm_ffi(
    a: jax.Array, b: jax.Array, *, trans_a: bool = False, trans_b: bool = False, precision: Any = None
) -> jax.Array:
    """Row-major ``op(a) @ op(b)`` through cuBLASLt (CUDA only; callers check availability).

    a: `[..., m, k]` (`[k, m]` 2-D when ``trans_a``), b: `[k, n]` (`[n, k]` when ``trans_b``).
    """
    _ext.ensure_registered()
    if trans_a:
        shape: tuple[int, ...] = (a.shape[1], b.shape[0] if trans_b else b.shape[1])
    else:
        shape = (*a.shape[:-1], b.shape[0] if trans_b else b.shape[1])
    out_type = _ffi.result_type(shape, a.dtype, a, b)
    # Every GEMM (the forward's and the backward's transposed ones) gets its plan built and kernel
    # loaded here, at trace time, not lazily inside the call; tuned like the overlap kernels' chunks.
    m = shape[0] if trans_a else math.prod(int(d) for d in a.shape[:-1])
    k = a.shape[0] if trans_a else a.shape[-1]
    n = shape[-1]
    if m > 0 and n > 0 and k > 0:
        warm(
            _local_cuda_ordinals(),
            m,
            n,
            k,
            a.dtype,
            precision,
            row_offsets=False,  # whole buffers
            trans_a=bool(trans_a),
            trans_b=bool(trans_b),
        )
    call = _ffi.call(TARGET, (out_type, _ffi.workspace_type(a, b)))
    out, _ = call(
        a,
        b,
        trans_a=bool(trans_a),
        trans_b=bool(trans_b),
        tf32=bool(_ffi.tf32_allowed(precision)),
        fast_accum=False,
    )
    return out


def _ref(a, b, trans_a, trans_b, precision):
    a2 = a.T if trans_a else a
    b2 = b.T if trans_b else b
    return reference.matmul(a2, b2, precision=precision)


def _gemm(a, b, trans_a, trans_b, precision, use_cuda):
    if not use_cuda:
        return _ref(a, b, trans_a, trans_b, precision)
    # Chosen per platform at lowering time: the same jitted function also runs on CPU.
    return lax.platform_dependent(
        a,
        b,
        cuda=lambda a, b: gemm_ffi(a, b, trans_a=trans_a, trans_b=trans_b, precision=precision),
        default=lambda a, b: _ref(a, b, trans_a, trans_b, precision),
    )


def _use_cuda(method: str | None, fn: str = "matmul") -> bool:
    method = "auto" if method is None else method
    if isinstance(method, str):  # any case, as the ops take theirs
        method = method.strip().lower()
    if method not in ("auto", "xla", "cublaslt"):
        raise ValueError(f"{fn}: method must be 'auto', 'xla' or 'cublaslt'; got {method!r}")
    if method == "xla":
        return False
    ok, reason = _ext.cuda_path_available()
    if method == "cublaslt" and not ok:
        raise ValueError(f"{fn}: method='cublaslt' is unavailable: {reason}")
    return ok


def matmul(x: jax.Array, w: jax.Array, *, precision: Any = None, method: str | None = None) -> jax.Array:
    """``x @ w`` through cuBLASLt on NVIDIA GPUs (``jnp.matmul`` elsewhere), differentiable.

    Args:
      x: `[..., m, k]` with `bfloat16`, `float16` or `float32`; leading dims are folded into m.
      w: `[k, n]`, same dtype as x.
      precision: as XLA on GPUs: ``None``/``DEFAULT``/``HIGH`` let float32 use TF32; ``HIGHEST`` forbids it
        (:func:`jax_ub._ffi.tf32_allowed`).
      method: ``"auto"`` (cuBLASLt when available), ``"xla"`` (``jnp.matmul``) or ``"cublaslt"``.

    Returns:
      `[..., m, n]` with x's dtype (float32 accumulation), named ``"jax_ub_matmul_out"`` for
      ``jax.checkpoint`` policies (kept by :func:`jax_ub.checkpoint_policy`).

    Example::

      y = jax_ub.matmul(jnp.ones((128, 64), jnp.bfloat16), jnp.ones((64, 32), jnp.bfloat16))
    """
    _check(x, w)
    use_cuda = _use_cuda(method)
    precision = _validate.static_precision(precision, "matmul")
    if not use_cuda:  # plain jnp.matmul: forward-mode autodiff works too (no custom_vjp)
        return checkpoint_name(_gemm(x, w, False, False, precision, False), OUT_NAME)
    return checkpoint_name(_matmul_vjp(x, w, precision, use_cuda), OUT_NAME)


def _matmul_fwd(x, w, precision, use_cuda):
    return _gemm(x, w, False, False, precision, use_cuda), (x, w)


def _matmul_bwd(precision, use_cuda, res, dy):
    x, w = res
    dx = _gemm(dy, w, False, True, precision, use_cuda)  # dy @ wᵀ
    rows = math.prod(x.shape[:-1])  # explicit: reshape(-1, 0) cannot infer it (k or n of 0)
    x2 = x.reshape(rows, x.shape[-1])
    dy2 = dy.reshape(rows, dy.shape[-1])
    dw = _gemm(x2, dy2, True, False, precision, use_cuda)  # xᵀ @ dy over all rows
    return dx, dw


def _primal(x, w, precision, use_cuda):
    return _gemm(x, w, False, False, precision, use_cuda)


_matmul_vjp = jax.custom_vjp(_primal, nondiff_argnums=(2, 3))
_matmul_vjp.defvjp(_matmul_fwd, _matmul_bwd)


# ------------------------------------------------------------------------------------------------
# FP8: float8 operands with per-tensor float32 dequantization scales (jax_ub.fp8's conventions).

# cuBLASLt's FP8 kernels take rows of 16-byte multiples (a: k, b stored [n, k]: k, the result: n):
# other k and n are zero-padded to a multiple of this (zeros add nothing to the product).
_FP8_PAD = 16


def _check_fp8(a8: jax.Array, b8: jax.Array, a_scale: Any, b_scale: Any, out_dtype: Any) -> tuple:
    fn = "fp8_matmul"
    _validate.check_array(fn, "a8", a8)
    _validate.check_array(fn, "b8", b8)
    if a8.ndim < 2 or b8.ndim != 2:
        raise ValueError(
            f"{fn}: a8 must be `[..., m, k]` (>= 2-D) and b8 `[k, n]` (2-D); got a8 "
            f"{_validate.shape_str(a8.shape)}, b8 {_validate.shape_str(b8.shape)}"
        )
    da, db = jnp.dtype(a8.dtype), jnp.dtype(b8.dtype)
    pairs = "float8_e4m3fn x float8_e4m3fn, float8_e4m3fn x float8_e5m2 or float8_e5m2 x float8_e4m3fn"
    if not (fp8_lib.is_fp8(da) and fp8_lib.is_fp8(db)) or da == db == fp8_lib.E5M2:
        raise TypeError(
            f"{fn}: a8 and b8 must be {pairs} (no float8_e5m2 x float8_e5m2 GEMM exists; for "
            f"other dtypes use jax_ub.matmul); got a8 {da.name}, b8 {db.name}"
        )
    if a8.shape[-1] != b8.shape[0]:
        raise ValueError(
            f"{fn}: contracting dims differ: a8 is {_validate.shape_str(a8.shape)} "
            f"(k={a8.shape[-1]}), b8 is {_validate.shape_str(b8.shape)} (k={b8.shape[0]})"
        )
    for name, sc in (("a_scale", a_scale), ("b_scale", b_scale)):
        shape = getattr(sc, "shape", None)
        dtype = getattr(sc, "dtype", None)
        if shape is None or dtype is None or tuple(shape) != () or jnp.dtype(dtype) != jnp.float32:
            got = (
                f"{jnp.dtype(dtype).name} of shape {tuple(shape)}" if shape is not None else type(sc).__name__
            )
            raise TypeError(
                f"{fn}: {name} must be a float32 array of shape () (a per-tensor dequantization "
                f"scale); got {got}"
            )
    try:
        out = jnp.dtype(out_dtype)
    except TypeError:
        out = None
    if out not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise TypeError(f"{fn}: out_dtype must be bfloat16 or float32; got {out_dtype!r}")
    return a_scale, b_scale, out


def _pad_to(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def fp8_gemm_ffi(
    a8: jax.Array,
    b8_t: jax.Array,
    a_scale: jax.Array,
    b_scale: jax.Array,
    out_dtype: Any,
    fast_accum: bool = False,
):
    """``a_scale * b_scale * (a8 @ b8_tᵀ)`` through cuBLASLt's FP8 GEMM (CUDA only; callers check
    availability): ``a8[..., m, k]`` and ``b8_t[n, k]`` (both K-contiguous, the layout FP8 needs),
    k and n multiples of 16 (:func:`fp8_matmul` pads), result ``[..., m, n]`` in ``out_dtype``;
    ``fast_accum``: cuBLASLt's fast accumulation (see :func:`fp8_matmul`)."""
    _ext.ensure_registered()
    n, k = b8_t.shape
    m = math.prod(int(d) for d in a8.shape[:-1])
    if m > 0 and n > 0 and k > 0:
        warm(
            _local_cuda_ordinals(),
            m,
            n,
            k,
            a8.dtype,
            None,
            row_offsets=False,  # whole buffers
            b_dtype=b8_t.dtype,
            out_dtype=out_dtype,
            fast_accum=fast_accum,
        )
    out_type = _ffi.result_type((*a8.shape[:-1], n), out_dtype, a8, b8_t)
    call = _ffi.call(TARGET, (out_type, _ffi.workspace_type(a8, b8_t)))
    out, _ = call(
        a8, b8_t, a_scale, b_scale, trans_a=False, trans_b=True, tf32=False, fast_accum=bool(fast_accum)
    )
    return out


def _fp8_cuda(a8, b8, a_scale, b_scale, out_dtype, fast_accum=False):
    n = b8.shape[1]
    a8p = _pad_to(a8, a8.ndim - 1, _FP8_PAD)
    b8_t = _pad_to(_pad_to(b8.T, 1, _FP8_PAD), 0, _FP8_PAD)  # [n', k']
    y = fp8_gemm_ffi(a8p, b8_t, a_scale, b_scale, out_dtype, fast_accum)
    return y if b8_t.shape[0] == n else y[..., :n]


def fp8_matmul(
    a8: jax.Array,
    b8: jax.Array,
    a_scale: jax.Array,
    b_scale: jax.Array,
    *,
    out_dtype: Any = jnp.bfloat16,
    method: str | None = None,
    fast_accum: bool = False,
) -> jax.Array:
    """Row-major ``a8 @ b8`` of float8 operands, dequantized: ``a_scale * b_scale * (a8 @ b8)``
    accumulated in float32 (:func:`jax_ub.fp8.scaled_matmul` defines the result).

    Args:
      a8: `[..., m, k]` float8 (e4m3fn or e5m2); leading dims fold into m.
      b8: `[k, n]` float8; not e5m2 together with an e5m2 ``a8`` (no such GEMM).
      a_scale, b_scale: float32 dequantization scales of shape ``()``.
      out_dtype: ``bfloat16`` (default) or ``float32``.
      method: ``"auto"`` (cuBLASLt's FP8 GEMM where the CUDA path is available), ``"xla"``
        (XLA's FP8 dot, :func:`jax_ub.fp8.scaled_dot`) or ``"cublaslt"``.
      fast_accum: cuBLASLt's fast accumulation (``CUBLASLT_MATMUL_DESC_FAST_ACCUM``): Hopper's
        FP8 tensor cores keep their reduced-precision accumulator along all of k instead of
        promoting partial sums to float32 at intervals. Faster; the result stays the reference's
        within an error that grows with k (``docs/fp8.md``). Off the CUDA path it is ignored.

    On the CUDA path ``b8`` is passed to cuBLASLt as ``[n, k]`` (a transpose here: the layout its
    FP8 kernels need), and a k or n that is not a multiple of 16 is zero-padded. Not
    differentiable (the FP8 recipes of :mod:`jax_ub.ops` define their own backward).
    """
    sa, sb, out = _check_fp8(a8, b8, a_scale, b_scale, out_dtype)
    if not isinstance(fast_accum, bool):
        raise TypeError(f"fp8_matmul: fast_accum must be a bool; got {fast_accum!r}")
    fast = bool(fast_accum)
    use_cuda = _use_cuda(method, "fp8_matmul")
    if not use_cuda:  # XLA's own FP8 dot (jax_ub.fp8.scaled_dot), as every FP8 GEMM through XLA
        return fp8_lib.scaled_dot(a8, b8, sa, sb, out)
    # Chosen per platform at lowering time: the same jitted function also runs on CPU.
    return lax.platform_dependent(
        a8,
        b8,
        sa,
        sb,
        cuda=lambda a, b, x, y: _fp8_cuda(a, b, x, y, out, fast),
        default=lambda a, b, x, y: fp8_lib.scaled_dot(a, b, x, y, out),
    )
