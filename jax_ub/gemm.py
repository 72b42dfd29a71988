"""``jax_ub.matmul``: the cuBLASLt GEMM custom call (``csrc/ffi/gemm.cc``), building block of the
overlap kernels, with ``jnp.matmul`` as the reference path off-GPU."""

from __future__ import annotations

import logging
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jax_ub import _ext, _ffi, _validate, reference

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
    ``workspace_bytes``: as the call will pass (default: ``JAX_UB_GEMM_WORKSPACE_MIB``). Returns
    one ``{tuned, candidates, chosen, heuristic_ms, best_ms}`` per device (cached per shape).
    """
    from jax_ub import config

    cfg = config.get()
    tf32 = bool(_ffi.tf32_allowed(precision))
    ws = workspace_bytes if workspace_bytes is not None else _ffi.workspace_bytes()
    name = jnp.dtype(dtype).name
    es = jnp.dtype(dtype).itemsize
    unaligned_a = bool(row_offsets and (k * es) % 16)
    unaligned_c = bool(row_offsets and (max(ld, n) * es) % 16)
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
        )
        if key not in _warmed:
            r = _warmed[key] = dict(
                mod.gemm_warmup(
                    int(dev),
                    int(m),
                    int(n),
                    int(k),
                    _ffi.dtype_code(name),
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
    out, _ = call(a, b, trans_a=bool(trans_a), trans_b=bool(trans_b), tf32=bool(_ffi.tf32_allowed(precision)))
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


def _use_cuda(method: str | None) -> bool:
    method = "auto" if method is None else method
    if isinstance(method, str):  # any case, as the ops take theirs
        method = method.strip().lower()
    if method not in ("auto", "xla", "cublaslt"):
        raise ValueError(f"matmul: method must be 'auto', 'xla' or 'cublaslt'; got {method!r}")
    if method == "xla":
        return False
    ok, reason = _ext.cuda_path_available()
    if method == "cublaslt" and not ok:
        raise ValueError(f"matmul: method='cublaslt' is unavailable: {reason}")
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
