"""The FP8 entry points of the CUDA layer on CPU: ``jax_ub.gemm.fp8_matmul`` (its reference path,
checked element by element against float64 numpy, and its argument checks), the checks that
``jax_ub.overlap.ag_gemm`` / ``gemm_rs`` make of FP8 operands before they need a communicator,
and the GEMM type code that names an FP8 GEMM to the extension's warm-up."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ub import _ffi, gemm, overlap

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def _fp8(rng, shape, dtype):
    """Random float8 values (normal, spread over the format's range) and a float32 scale."""
    x = rng.standard_normal(shape).astype(np.float32) * 4.0
    return jnp.asarray(x).astype(dtype), jnp.float32(rng.uniform(0.01, 2.0))


def _expected(a8, b8, sa, sb):
    a = np.asarray(a8.astype(jnp.float32), np.float64) * float(sa)
    b = np.asarray(b8.astype(jnp.float32), np.float64) * float(sb)
    return a @ b


@pytest.mark.parametrize(
    "da,db,out",
    [
        (E4M3, E4M3, jnp.bfloat16),
        (E4M3, E5M2, jnp.float32),
        (E5M2, E4M3, jnp.bfloat16),
        (E4M3, E4M3, jnp.float32),
    ],
)
@pytest.mark.parametrize("shape", [(64, 48, 32), (17, 33, 5), (2, 9, 24, 40)])
def test_fp8_matmul_reference_path(da, db, out, shape):
    """Off-GPU fp8_matmul is the dequantized float32 product, cast: every element against float64
    numpy within the output's rounding (plus float32 accumulation over k)."""
    rng = np.random.default_rng(hash((str(da), str(db), shape)) % 2**32)
    *lead, k, n = shape
    a8, sa = _fp8(rng, (*lead, k), da)
    b8, sb = _fp8(rng, (k, n), db)
    y = jax.jit(lambda a, b, x, z: gemm.fp8_matmul(a, b, x, z, out_dtype=out))(a8, b8, sa, sb)
    assert y.dtype == jnp.dtype(out)
    want = _expected(a8, b8, sa, sb)
    got = np.asarray(y.astype(jnp.float32), np.float64)
    assert got.shape == want.shape
    rel = 2.0**-7 if out == jnp.bfloat16 else 1e-5
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=rel, atol=rel * scale)


def test_fp8_matmul_xla_method_is_the_reference():
    rng = np.random.default_rng(3)
    a8, sa = _fp8(rng, (32, 64), E4M3)
    b8, sb = _fp8(rng, (64, 16), E5M2)
    y = gemm.fp8_matmul(a8, b8, sa, sb, out_dtype=jnp.float32, method="XLA")
    np.testing.assert_allclose(np.asarray(y, np.float64), _expected(a8, b8, sa, sb), rtol=1e-5, atol=1e-4)


def _args(rng=None):
    rng = rng or np.random.default_rng(0)
    a8, sa = _fp8(rng, (8, 32), E4M3)
    b8, sb = _fp8(rng, (32, 16), E4M3)
    return a8, b8, sa, sb


@pytest.mark.parametrize(
    "change,exc,match",
    [
        (
            dict(a8=jnp.zeros((8, 32), E5M2), b8=jnp.zeros((32, 16), E5M2)),
            TypeError,
            r"fp8_matmul: a8 and b8 must be .*no float8_e5m2 x float8_e5m2.*"
            r"got a8 float8_e5m2, b8 float8_e5m2",
        ),
        (
            dict(a8=jnp.zeros((8, 32), jnp.bfloat16)),
            TypeError,
            r"fp8_matmul: a8 and b8 must be .*got a8 bfloat16, b8 float8_e4m3fn",
        ),
        (
            dict(b8=jnp.zeros((31, 16), E4M3)),
            ValueError,
            r"fp8_matmul: contracting dims differ: a8 is \[8, 32\] \(k=32\), b8 is \[31, 16\] \(k=31\)",
        ),
        (
            dict(b8=jnp.zeros((2, 32, 16), E4M3)),
            ValueError,
            r"fp8_matmul: a8 must be `\[\.\.\., m, k\]` .* got a8 \[8, 32\], b8 \[2, 32, 16\]",
        ),
        (
            dict(sa=jnp.ones((1,), jnp.float32)),
            TypeError,
            r"fp8_matmul: a_scale must be a float32 array of shape \(\) .*got float32 of shape \(1,\)",
        ),
        (
            dict(sb=jnp.ones((), jnp.bfloat16)),
            TypeError,
            r"fp8_matmul: b_scale must be a float32 array of shape \(\) .*got bfloat16 of shape \(\)",
        ),
        (dict(sb=1.0), TypeError, r"fp8_matmul: b_scale must be .*got float"),
    ],
)
def test_fp8_matmul_refuses_bad_arguments(change, exc, match):
    a8, b8, sa, sb = _args()
    kw = dict(a8=a8, b8=b8, sa=sa, sb=sb)
    kw.update(change)
    with pytest.raises(exc, match=match):
        gemm.fp8_matmul(kw["a8"], kw["b8"], kw["sa"], kw["sb"])


def test_fp8_matmul_refuses_bad_out_dtype_and_method():
    a8, b8, sa, sb = _args()
    with pytest.raises(TypeError, match=r"fp8_matmul: out_dtype must be bfloat16 or float32; got .*float16"):
        gemm.fp8_matmul(a8, b8, sa, sb, out_dtype=jnp.float16)
    with pytest.raises(
        ValueError, match=r"fp8_matmul: method must be 'auto', 'xla' or 'cublaslt'; got 'ring'"
    ):
        gemm.fp8_matmul(a8, b8, sa, sb, method="ring")
    with pytest.raises(ValueError, match=r"fp8_matmul: method='cublaslt' is unavailable"):
        gemm.fp8_matmul(a8, b8, sa, sb, method="cublaslt")


# The overlap ops check FP8 operands before they look for a communicator: these errors come first.
_OPS = [("all_gather_matmul", overlap.ag_gemm), ("matmul_reduce_scatter", overlap.gemm_rs)]


def _op(fn, x, w, **kw):
    return fn(x, w, axis_name="tp", axis=0, precision=None, method="ring", **kw)


@pytest.mark.parametrize("what,fn", _OPS)
def test_overlap_fp8_checks(what, fn):
    x8 = jnp.zeros((32, 64), E4M3)
    w8 = jnp.zeros((64, 48), E4M3)
    s = jnp.float32(1.0)
    with pytest.raises(
        TypeError, match=rf"{what}: .*no float8_e5m2 x float8_e5m2.*got x float8_e5m2, w float8_e5m2"
    ):
        _op(fn, x8.astype(E5M2), w8.astype(E5M2), x_scale=s, w_scale=s)
    with pytest.raises(TypeError, match=rf"{what}: float8 operands need x_scale and w_scale"):
        _op(fn, x8, w8, x_scale=s)
    with pytest.raises(TypeError, match=rf"{what}: `scales`' w_scale must be a float32 array of shape \(\)"):
        _op(fn, x8, w8, x_scale=s, w_scale=jnp.ones((2,), jnp.float32))
    with pytest.raises(TypeError, match=rf"{what}: `preferred_element_type` of an FP8 call must be one of"):
        _op(fn, x8, w8, x_scale=s, w_scale=s, out_dtype=jnp.float16)
    with pytest.raises(
        ValueError, match=rf"{what}: the FP8 CUDA path needs w's k and n to be multiples of 16.*\(64, 40\)"
    ):
        _op(fn, x8, jnp.zeros((64, 40), E4M3), x_scale=s, w_scale=s)
    with pytest.raises(TypeError, match=rf"{what}: x_scale, w_scale and out_dtype are for float8 operands"):
        _op(fn, x8.astype(jnp.bfloat16), w8.astype(jnp.bfloat16), x_scale=s, w_scale=s)


def test_gemm_types_code_matches_the_extension_encoding(monkeypatch):
    """One dtype: its DType code; an FP8 GEMM: a | (b + 1) << 8 | (out + 1) << 16 (the encoding
    GemmTypes::FromCode in csrc/gemm/cublaslt.cc decodes)."""
    from jax_ub import _ext

    table = {"float32": 0, "float16": 1, "bfloat16": 2, "float8_e4m3fn": 3, "float8_e5m2": 4}
    monkeypatch.setattr(_ext, "enums", lambda: {"dtype": table})
    assert _ffi.gemm_types_code(jnp.bfloat16) == 2
    assert _ffi.gemm_types_code(jnp.float32, jnp.float32, jnp.float32) == 0
    code = _ffi.gemm_types_code(E4M3, E5M2, jnp.bfloat16)
    assert code == 3 | (4 + 1) << 8 | (2 + 1) << 16
    assert (code & 0xFF, (code >> 8 & 0xFF) - 1, (code >> 16 & 0xFF) - 1) == (3, 4, 2)
    with pytest.raises(ValueError, match="no GEMM dtype code for int8"):
        _ffi.gemm_types_code(E4M3, jnp.int8, jnp.bfloat16)


def test_extension_dtype_table_has_the_fp8_types():
    """Where the extension is built, its DType table names both FP8 types."""
    from jax_ub import _ext

    try:
        table = _ext.enums()["dtype"]
    except RuntimeError as e:
        pytest.skip(str(e))
    assert table["float8_e4m3fn"] == 3 and table["float8_e5m2"] == 4


def test_fast_accum_checks_and_reference():
    """fast_accum: a bool, for float8 operands only; the reference path has no fast accumulation
    (the same result either way). The code of a fast-accumulation GEMM sets bit 24 (its own plan)."""
    rng = np.random.default_rng(11)
    a8, sa = _fp8(rng, (40, 64), E4M3)
    b8, sb = _fp8(rng, (64, 24), E4M3)
    full = gemm.fp8_matmul(a8, b8, sa, sb, out_dtype=jnp.float32)
    fast = gemm.fp8_matmul(a8, b8, sa, sb, out_dtype=jnp.float32, fast_accum=True)
    np.testing.assert_array_equal(np.asarray(fast), np.asarray(full))
    np.testing.assert_allclose(np.asarray(fast, np.float64), _expected(a8, b8, sa, sb), rtol=1e-5, atol=1e-3)
    with pytest.raises(TypeError, match=r"fp8_matmul: fast_accum must be a bool; got 'yes'"):
        gemm.fp8_matmul(a8, b8, sa, sb, fast_accum="yes")
    s = jnp.float32(1.0)
    for what, fn in _OPS:
        bf = jnp.ones((32, 64), jnp.bfloat16)
        with pytest.raises(TypeError, match=rf"{what}: fast_accum is for float8 operands.*got x bfloat16"):
            _op(fn, bf, bf.T, fast_accum=True)
        with pytest.raises(TypeError, match=rf"{what}: fast_accum must be a bool; got 1"):
            _op(fn, a8[:32], b8[:, :16], x_scale=s, w_scale=s, fast_accum=1)
    base = _ffi.gemm_types_code(E4M3, E4M3, jnp.bfloat16)
    assert _ffi.gemm_types_code(E4M3, E4M3, jnp.bfloat16, True) == base | 1 << 24


def test_recipe_fwd_fast_accum():
    import jax_ub

    assert jax_ub.FP8Recipe().fwd_fast_accum is False
    assert jax_ub.FP8Recipe(fwd_fast_accum=True).fwd_fast_accum is True
    with pytest.raises(TypeError, match=r"FP8Recipe: `fwd_fast_accum` must be a bool; got 'on'"):
        jax_ub.FP8Recipe(fwd_fast_accum="on")


def test_gemm_bench_shapes_option():
    """``python -m jax_ub.bench gemm --shapes M,N,K ...``: triples parsed, bad ones refused."""
    import argparse

    from jax_ub.bench import gemm as bench_gemm

    parser = argparse.ArgumentParser()
    bench_gemm.add_parser(parser.add_subparsers())
    a = parser.parse_args(["gemm", "--shapes", "2048,8192,7168", "8,16,32"])
    assert a.shapes == [(2048, 8192, 7168), (8, 16, 32)]
    assert "jax_ub_fp8_fast" in bench_gemm.IMPLS and "xla_fp8" in bench_gemm.IMPLS
    with pytest.raises(argparse.ArgumentTypeError, match=r"expected M,N,K .*got '1,2'"):
        bench_gemm._mnk("1,2")
    with pytest.raises(argparse.ArgumentTypeError, match=r"expected M,N,K"):
        bench_gemm._mnk("0,2,3")
