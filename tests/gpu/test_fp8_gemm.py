"""Single-GPU tier: jax_ub.gemm.fp8_matmul (cuBLASLt's FP8 GEMM) against a float64 reference of
the dequantized operands, every element.

The operands are random float8 values with random scales (never zeros). The stated FP8 tolerance
of one element: ``(eps(out) + ACC) * (|a| @ |b|)`` (dequantized), where ``eps(out)`` is the final
rounding to the output dtype and ``ACC`` = 2**-9 covers the FP8 tensor cores' accumulation (Hopper
accumulates FP8 products in reduced precision between cuBLASLt's promotions to fp32). An element
computed from wrong operands is off by about its own size, far above that bound.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from tests import _checks  # noqa: E402

pytestmark = pytest.mark.gpu  # tests/conftest.py skips it without a GPU

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
ACC = 2.0**-9
PAIRS = [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3)]
SHAPES = [  # (batch dims, m, k, n)
    ((), 128, 256, 64),
    ((), 1024, 1024, 1024),
    ((), 257, 129, 65),  # odd everything: k and n padded, m as it is
    ((), 3, 5, 7),  # tiny
    ((2, 3), 40, 96, 24),  # leading batch dims fold into m
    ((), 1536, 5120, 3456),
]


@pytest.fixture(scope="module")
def jax_ub():
    import jax_ub as mod

    info = mod.build_info()
    if not info["cuda_path"]:
        pytest.fail(f"GPU present but jax_ub's CUDA path is inactive: {info['reason']}")
    return mod


def _fp8(key, shape, dtype):
    """Random float8 values spread over the format (normal * 8) and a random float32 scale."""
    k1, k2 = jax.random.split(key)
    q = (jax.random.normal(k1, shape, jnp.float32) * 8.0).astype(dtype)
    return q, jax.random.uniform(k2, (), jnp.float32, 0.01, 1.0)


def _dequant(q, s) -> np.ndarray:
    return np.asarray(q.astype(jnp.float32), np.float64) * float(s)


def _expected(a8, sa, b8, sb, out) -> _checks.Expected:
    a, b = _dequant(a8, sa), _dequant(b8, sb)
    scale = np.abs(a) @ np.abs(b)
    bound = (float(jnp.finfo(out).eps) + ACC + 2 * a.shape[-1] * float(np.finfo(np.float32).eps)) * scale
    return _checks.Expected(a @ b, bound + float(np.finfo(np.float32).tiny))


def _id(s):
    b, m, k, n = s
    return "x".join(map(str, (*b, m, k, n)))


@pytest.mark.parametrize("out", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{jnp.dtype(p[0]).name}x{jnp.dtype(p[1]).name}")
@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_fp8_matmul_matches_dequantized_reference(jax_ub, shape, pair, out):
    from jax_ub import gemm

    batch, m, k, n = shape
    ka, kb = jax.random.split(jax.random.key(m * 7 + k * 13 + n))
    a8, sa = _fp8(ka, (*batch, m, k), pair[0])
    b8, sb = _fp8(kb, (k, n), pair[1])
    f = jax.jit(lambda a, b, x, y: gemm.fp8_matmul(a, b, x, y, out_dtype=out, method="cublaslt"))
    _checks.poison((*batch, m, n), out)
    got = f(a8, b8, sa, sb)
    assert got.shape == (*batch, m, n) and got.dtype == jnp.dtype(out)
    _checks.assert_close(got, _expected(a8, sa, b8, sb, out), "FP8 GEMM")
    # The lowered program runs jax_ub's custom call (not a silent fallback to the reference).
    assert "jax_ub_gemm" in f.lower(a8, b8, sa, sb).as_text()


def test_scales_are_read_at_every_call(jax_ub):
    """The scale pointers are set on the cached plan at every run: one compiled function called
    with other scale values gives results scaled accordingly."""
    from jax_ub import gemm

    a8, _ = _fp8(jax.random.key(1), (256, 512), E4M3)
    b8, _ = _fp8(jax.random.key(2), (512, 128), E4M3)
    f = jax.jit(lambda a, b, x, y: gemm.fp8_matmul(a, b, x, y, out_dtype=jnp.float32, method="cublaslt"))
    for sa, sb in [(0.5, 0.25), (3.0, 0.125), (0.01, 7.0)]:
        sa, sb = jnp.float32(sa), jnp.float32(sb)
        _checks.assert_close(f(a8, b8, sa, sb), _expected(a8, sa, b8, sb, jnp.float32), f"scales {sa} {sb}")


def test_e5m2_pair_is_refused_in_python_and_in_the_handler(jax_ub):
    from jax_ub import gemm

    a8, sa = _fp8(jax.random.key(3), (64, 64), E5M2)
    b8, sb = _fp8(jax.random.key(4), (64, 64), E5M2)
    with pytest.raises(
        TypeError, match=r"no float8_e5m2 x float8_e5m2 GEMM.*got a8 float8_e5m2, b8 float8_e5m2"
    ):
        gemm.fp8_matmul(a8, b8, sa, sb, method="cublaslt")
    # The custom call itself, reached without the Python checks (and the warm-up), refuses it too.
    from jax_ub import _ext, _ffi

    _ext.ensure_registered()

    def raw(a, b, x, y):
        out_t = jax.ShapeDtypeStruct((64, 64), jnp.bfloat16)
        call = _ffi.call(gemm.TARGET, (out_t, jax.ShapeDtypeStruct((_ffi.workspace_bytes(),), jnp.uint8)))
        return call(a, b.T, x, y, trans_a=False, trans_b=True, tf32=False, fast_accum=False)[0]

    with pytest.raises(Exception, match=r"no e5m2 x e5m2 kernel.*float8_e5m2 x float8_e5m2 -> bfloat16"):
        jax.block_until_ready(jax.jit(raw)(a8, b8, sa, sb))


def test_fp8_plans_are_prepared_at_trace_time_and_tuned(jax_ub):
    """The FP8 GEMM's plan is built (and its candidates timed, JAX_UB_GEMM_TUNE) when the program
    is traced: executing it builds no plan."""
    from jax_ub import _ext, config, gemm

    a8, sa = _fp8(jax.random.key(5), (1024, 2048), E4M3)
    b8, sb = _fp8(jax.random.key(6), (2048, 1536), E4M3)
    with config.override(gemm_tune=8):
        f = jax.jit(lambda a, b, x, y: gemm.fp8_matmul(a, b, x, y, method="cublaslt")).lower(a8, b8, sa, sb)
        dev = gemm._local_cuda_ordinals()[0]
        r = gemm.warm(
            [dev], 1024, 1536, 2048, E4M3, None, row_offsets=False, b_dtype=E4M3, out_dtype=jnp.bfloat16
        )[0]
    assert r["tuned"], r
    step = f.compile()
    before = _ext.extension().gemm_plan_cache_size()
    got = step(a8, b8, sa, sb)
    assert _ext.extension().gemm_plan_cache_size() == before  # every plan existed already
    _checks.assert_close(got, _expected(a8, sa, b8, sb, jnp.bfloat16), "tuned FP8 GEMM")


# Fast accumulation (fast_accum=True): the tensor cores' reduced-precision accumulator is never
# promoted to fp32 along k. Stated tolerance of one element: (eps(out) + ACC + ceil(k / 32) *
# FAST_U) * (|a| @ |b|): one truncation of at most FAST_U (the accumulator keeps about 13
# mantissa bits) relative to the running |sum| per 32-deep tensor-core step, so it grows with k.
# And the whole result's relative Frobenius error stays under FAST_FRO (wrong operands give ~1).
FAST_U = 2.0**-13
FAST_FRO = 2.0**-6
FAST_SHAPES = [((), 128, 256, 64), ((), 257, 129, 65), ((), 1024, 1024, 1024), ((), 512, 4096, 256)]


def _expected_fast(a8, sa, b8, sb, out) -> _checks.Expected:
    a, b = _dequant(a8, sa), _dequant(b8, sb)
    k = a.shape[-1]
    scale = np.abs(a) @ np.abs(b)
    acc = ACC + -(-k // 32) * FAST_U + 2 * k * float(np.finfo(np.float32).eps)
    return _checks.Expected(
        a @ b, (float(jnp.finfo(out).eps) + acc) * scale + float(np.finfo(np.float32).tiny)
    )


@pytest.mark.parametrize("out", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize(
    "pair", [(E4M3, E4M3), (E5M2, E4M3)], ids=lambda p: f"{jnp.dtype(p[0]).name}x{jnp.dtype(p[1]).name}"
)
@pytest.mark.parametrize("shape", FAST_SHAPES, ids=_id)
def test_fp8_matmul_fast_accum_within_its_tolerance(jax_ub, shape, pair, out):
    from jax_ub import gemm

    batch, m, k, n = shape
    ka, kb = jax.random.split(jax.random.key(m * 5 + k * 11 + n))
    a8, sa = _fp8(ka, (*batch, m, k), pair[0])
    b8, sb = _fp8(kb, (k, n), pair[1])
    f = jax.jit(
        lambda a, b, x, y: gemm.fp8_matmul(a, b, x, y, out_dtype=out, method="cublaslt", fast_accum=True)
    )
    _checks.poison((*batch, m, n), out)
    got = f(a8, b8, sa, sb)
    assert got.shape == (*batch, m, n) and got.dtype == jnp.dtype(out)
    want = _expected_fast(a8, sa, b8, sb, out)
    _checks.assert_close(got, want, f"FP8 GEMM, fast accumulation, k={k}")
    g = np.asarray(got.astype(jnp.float32), np.float64)
    fro = np.linalg.norm(g - want.value) / np.linalg.norm(want.value)
    assert fro < FAST_FRO, f"relative Frobenius error {fro:.3e} >= {FAST_FRO:.3e} (k={k})"
    assert "fast_accum = true" in f.lower(a8, b8, sa, sb).as_text()


def test_fast_accum_has_its_own_plan(jax_ub):
    """fast_accum names another cuBLASLt plan (prepared at trace time beside the full one): the
    two variants of one shape are two cached plans, and each gives its own result."""
    from jax_ub import _ext, gemm

    a8, sa = _fp8(jax.random.key(7), (384, 768), E4M3)
    b8, sb = _fp8(jax.random.key(8), (768, 320), E4M3)
    full = jax.jit(lambda a, b, x, y: gemm.fp8_matmul(a, b, x, y, method="cublaslt"))
    fast = jax.jit(lambda a, b, x, y: gemm.fp8_matmul(a, b, x, y, method="cublaslt", fast_accum=True))
    ext = _ext.extension()
    full.lower(a8, b8, sa, sb)
    before = ext.gemm_plan_cache_size()
    fast.lower(a8, b8, sa, sb)
    assert ext.gemm_plan_cache_size() == before + 1
    _checks.assert_close(full(a8, b8, sa, sb), _expected(a8, sa, b8, sb, jnp.bfloat16), "full accumulation")
    _checks.assert_close(fast(a8, b8, sa, sb), _expected_fast(a8, sa, b8, sb, jnp.bfloat16), "fast")


def test_fast_accum_is_refused_for_other_dtypes(jax_ub):
    from jax_ub import overlap

    x = jnp.ones((16, 16), jnp.bfloat16)
    with pytest.raises(TypeError, match=r"fast_accum is for float8 operands.*got x bfloat16"):
        overlap._fp8_operands("all_gather_matmul", x, x, None, None, None, True)
