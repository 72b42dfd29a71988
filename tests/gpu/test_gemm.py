"""Single-GPU tier: jax_ub.matmul (cuBLASLt custom call) against a float32 reference.

Skipped without a GPU; fails where the GPU is there but jax or jax_ub cannot use it. Inputs are
random (never zeros); before each call the device allocator is filled with NaN-poisoned buffers of
the output's size and released, so an output element the kernel fails to write shows up as NaN.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from tests import _checks  # noqa: E402

pytestmark = pytest.mark.gpu  # tests/conftest.py skips it without a GPU

TOL = {jnp.bfloat16: 1e-2, jnp.float16: 5e-3, jnp.float32: 1e-5}
SHAPES = [  # (batch dims, m, k, n)
    ((), 128, 256, 64),
    ((), 1024, 1024, 1024),
    ((), 257, 129, 65),  # odd everything
    ((), 3, 5, 7),  # tiny
    ((2, 3), 40, 96, 24),  # leading batch dims fold into m
    ((), 6144 // 4, 5120, 13824 // 4),
]


def _rel_err(out, ref) -> float:
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


@pytest.fixture(scope="module")
def jax_ub():
    import jax_ub as mod

    info = mod.build_info()
    if not info["cuda_path"]:
        pytest.fail(f"GPU present but jax_ub's CUDA path is inactive: {info['reason']}")
    return mod


def _id(s):
    b, m, k, n = s
    return "x".join(map(str, (*b, m, k, n)))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_matmul_matches_float32_reference(jax_ub, shape, dtype):
    batch, m, k, n = shape
    kx, kw = jax.random.split(jax.random.key(m * 7 + k * 13 + n))
    x = jax.random.normal(kx, (*batch, m, k), jnp.float32).astype(dtype)
    w = jax.random.normal(kw, (k, n), jnp.float32).astype(dtype)
    ref = jnp.matmul(x.astype(jnp.float32), w.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    f = jax.jit(lambda x, w: jax_ub.matmul(x, w, precision=lax.Precision.HIGHEST, method="cublaslt"))
    _checks.poison((*batch, m, n), dtype)
    out = f(x, w)
    assert out.shape == (*batch, m, n) and out.dtype == dtype
    assert not bool(jnp.any(jnp.isnan(out))), "unwritten (NaN-poisoned) output elements"
    err = _rel_err(out, ref)
    assert err <= TOL[dtype], f"relative error {err:.3e} > {TOL[dtype]:.0e}"
    _checks.assert_close(out, _checks.matmul_expected(x, w), "cuBLASLt matmul")  # every element
    # The lowered program really contains the custom call (not a silent fallback).
    assert "jax_ub_gemm" in f.lower(x, w).as_text()


def test_matmul_tf32_default_is_close(jax_ub):
    x = jax.random.normal(jax.random.key(1), (512, 512), jnp.float32)
    w = jax.random.normal(jax.random.key(2), (512, 256), jnp.float32)
    ref = jnp.matmul(x, w, precision=lax.Precision.HIGHEST)
    out = jax.jit(lambda x, w: jax_ub.matmul(x, w, method="cublaslt"))(x, w)
    assert _rel_err(out, ref) < 5e-3  # TF32 allowed by default, like XLA


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
def test_matmul_gradients(jax_ub, dtype):
    x = jax.random.normal(jax.random.key(3), (4, 33, 48), jnp.float32).astype(dtype)
    w = jax.random.normal(jax.random.key(4), (48, 40), jnp.float32).astype(dtype)
    dy = jax.random.normal(jax.random.key(5), (4, 33, 40), jnp.float32).astype(dtype)
    hp = lax.Precision.HIGHEST

    def loss(fn):
        return lambda x, w: jnp.sum((fn(x, w).astype(jnp.float32)) * dy.astype(jnp.float32))

    grad = jax.jit(jax.grad(loss(lambda x, w: jax_ub.matmul(x, w, precision=hp, method="cublaslt")), (0, 1)))
    g = grad(x, w)
    x32, w32 = x.astype(jnp.float32), w.astype(jnp.float32)
    r = jax.grad(loss(lambda x, w: jnp.matmul(x, w, precision=hp)), (0, 1))(x32, w32)
    for got, want in zip(g, r, strict=True):
        assert _rel_err(got, want) <= TOL[dtype]
    # Element by element: dx = dy @ w^T, dw = x^T @ dy over every batch row.
    _checks.assert_close(g[0], _checks.matmul_expected(dy, w.T, dtype), "dx")
    _checks.assert_close(g[1], _checks.matmul_expected(x.reshape(-1, 48).T, dy.reshape(-1, 40), dtype), "dw")
    # Both backward GEMMs run through cuBLASLt too (dx and dw; grad alone drops the forward's).
    assert grad.lower(x, w).as_text().count("jax_ub_gemm") == 2


def test_backward_gemms_are_prepared_at_trace_time_not_inside_the_call(jax_ub):
    """The transposed GEMMs of the backward (dy @ w^T, x^T @ dy) get their cuBLASLt plans built
    (and kernels loaded) when the program is traced, like the forward's: a plan built inside an
    executing call loads its kernel lazily there, which can synchronize the GPU while peers wait."""
    from jax_ub import _ext

    x = jax.random.normal(jax.random.key(6), (2, 45, 72), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.key(7), (72, 56), jnp.float32).astype(jnp.bfloat16)

    def loss(x, w):
        return jnp.sum(jax_ub.matmul(x, w, method="cublaslt").astype(jnp.float32) ** 2)

    step = jax.jit(jax.grad(loss, (0, 1))).lower(x, w).compile()
    before = _ext.extension().gemm_plan_cache_size()
    jax.block_until_ready(step(x, w))
    assert _ext.extension().gemm_plan_cache_size() == before  # every plan existed already


def test_repeated_and_mixed_shapes_in_one_program(jax_ub):
    xs = [jax.random.normal(jax.random.key(i), (64 * (i + 1), 128), jnp.bfloat16) for i in range(3)]
    w = jax.random.normal(jax.random.key(9), (128, 96), jnp.bfloat16)

    @jax.jit
    def f(xs, w):
        return [jax_ub.matmul(x, w, method="cublaslt") for x in xs for _ in range(2)]

    outs = f(xs, w)
    for i, x in enumerate(xs):
        ref = jnp.matmul(x.astype(jnp.float32), w.astype(jnp.float32))
        for o in outs[2 * i : 2 * i + 2]:
            assert _rel_err(o, ref) <= 1e-2


@pytest.mark.parametrize("remat", ["dots", "ub_dots"])
def test_matmul_output_kept_by_checkpoint_policy(jax_ub, remat):
    """Under jax.checkpoint with dots_saveable the cuBLASLt call is opaque, so the backward runs it
    again; jax_ub.checkpoint_policy(dots_saveable) keeps its named output (jax_ub_matmul_out)."""
    x = jax.random.normal(jax.random.key(6), (256, 128), jnp.float32).astype(jnp.bfloat16)
    w1 = jax.random.normal(jax.random.key(7), (128, 192), jnp.float32).astype(jnp.bfloat16)
    w2 = jax.random.normal(jax.random.key(8), (192, 64), jnp.float32).astype(jnp.bfloat16)
    dots = jax.checkpoint_policies.dots_saveable
    policy = dots if remat == "dots" else jax_ub.checkpoint_policy(dots)

    def model(policy, mm):
        def f(x, w1, w2):
            return jnp.sum(mm(jnp.tanh(mm(x, w1)), w2).astype(jnp.float32) ** 2)

        return f if policy is None else jax.checkpoint(f, policy=policy)

    cub = lambda a, b: jax_ub.matmul(a, b, method="cublaslt")  # noqa: E731

    def calls(f):
        hlo = jax.jit(jax.value_and_grad(f, (0, 1, 2))).lower(x, w1, w2).as_text()
        return hlo.count("jax_ub_gemm")

    saved, got = calls(model(None, cub)), calls(model(policy, cub))
    assert saved >= 2
    assert (got > saved) if remat == "dots" else (got == saved), (got, saved)
    ref = jax.value_and_grad(model(None, jnp.matmul), (0, 1, 2))(
        *(a.astype(jnp.float32) for a in (x, w1, w2))
    )
    out = jax.jit(jax.value_and_grad(model(policy, cub), (0, 1, 2)))(x, w1, w2)
    assert abs(float(out[0]) - float(ref[0])) <= 2e-2 * abs(float(ref[0]))
    for got_g, want in zip(out[1], ref[1], strict=True):
        assert _rel_err(got_g, want) <= 3e-2


def test_gemm_tuning_times_the_candidates_and_keeps_a_right_one(jax_ub):
    """JAX_UB_GEMM_TUNE (default 8): the trace-time warm-up times cuBLASLt's candidates on random
    data and keeps another than the heuristic's first only for a > 3% gain; the C++ plan cache
    then answers without timing again, and the op computes the same product with the kept one."""
    from jax_ub import _ext, _ffi, config, gemm

    dev = gemm._local_cuda_ordinals()[0]
    m, k, n = 1024, 4096, 2816  # a shape no other test uses: tuned here for the first time
    with config.override(gemm_tune=8):
        r = gemm.warm([dev], m, n, k, jnp.bfloat16, None)[0]
        assert r["tuned"] and 1 <= r["candidates"] <= 8, r
        assert 0 <= r["chosen"] < r["candidates"], r
        assert r["heuristic_ms"] > 0 and r["best_ms"] > 0, r
        if r["chosen"] == 0:
            assert r["best_ms"] == r["heuristic_ms"], r
        else:
            assert r["best_ms"] < 0.97 * r["heuristic_ms"], r
        ws = config.get().gemm_workspace_mib << 20
        tf32 = bool(_ffi.tf32_allowed(None))  # part of the plan key, as warm() passes it
        again = dict(_ext.extension().gemm_warmup(dev, m, n, k, 2, tf32, ws, tune_candidates=8))
        assert again["tuned"] and again["candidates"] == 0, again  # cached: nothing timed
        x = jax.random.normal(jax.random.key(21), (m, k), jnp.float32).astype(jnp.bfloat16)
        w = jax.random.normal(jax.random.key(22), (k, n), jnp.float32).astype(jnp.bfloat16)
        f = jax.jit(lambda x, w: jax_ub.matmul(x, w, method="cublaslt"))
        _checks.poison((m, n), jnp.bfloat16)
        out = f(x, w)
    assert not bool(jnp.any(jnp.isnan(out)))
    ref = jnp.matmul(x.astype(jnp.float32), w.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    assert _rel_err(out, ref) <= TOL[jnp.bfloat16]


def test_gemm_tuning_off_keeps_the_heuristics_first(jax_ub):
    from jax_ub import config, gemm

    dev = gemm._local_cuda_ordinals()[0]
    with config.override(gemm_tune=0):
        r = gemm.warm([dev], 1024, 2304, 4096, jnp.bfloat16, None)[0]
    assert not r["tuned"] and r["candidates"] == 0, r


@pytest.mark.parametrize(
    "precision, tf32",
    [
        (lax.Precision.HIGH, True),
        ("high", True),
        ("tensorfloat32", True),
        (None, True),
        (lax.DotAlgorithmPreset.TF32_TF32_F32, True),
        (lax.Precision.HIGHEST, False),
        ("float32", False),
        ("F32_F32_F32", False),
    ],
    ids=str,
)
def test_float32_precision_follows_xla(jax_ub, precision, tf32):
    """The cuBLASLt GEMM uses TF32 exactly where XLA's dot does, whatever the spelling: its error
    against float64 is TF32's (well above 1e-5) or float32's (below), as XLA's is."""
    kx, kw = jax.random.split(jax.random.key(11))
    x = jax.random.normal(kx, (512, 1024), jnp.float32)
    w = jax.random.normal(kw, (1024, 256), jnp.float32)
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    ours = _rel_err(
        jax.jit(lambda x, w: jax_ub.matmul(x, w, precision=precision, method="cublaslt"))(x, w), ref
    )
    xla = _rel_err(jax.jit(lambda x, w: jnp.matmul(x, w, precision=precision))(x, w), ref)
    print(f"precision {precision}: jax_ub {ours:.2e}, XLA {xla:.2e}")
    assert (ours > 1e-5) == tf32 and (xla > 1e-5) == tf32, (ours, xla)


@pytest.mark.parametrize("k, n", [(0, 64), (64, 0)])
def test_matmul_gradient_with_an_empty_dim(jax_ub, k, n):
    """jax.grad through the cuBLASLt matmul with k or n of 0: zeros of the operands' shapes."""
    x = jax.random.normal(jax.random.key(1), (2, 32, k), jnp.float32)
    w = jax.random.normal(jax.random.key(2), (k, n), jnp.float32)
    dx, dw = jax.jit(jax.grad(lambda x, w: jax_ub.matmul(x, w, method="cublaslt").sum(), argnums=(0, 1)))(
        x, w
    )
    assert dx.shape == x.shape and dw.shape == w.shape
    assert not np.asarray(dx).any() and not np.asarray(dw).any()
