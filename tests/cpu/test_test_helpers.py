"""The checks the GPU tiers rely on (tests/_checks.py, tests/cpu/_ranks.py) catch what they must:
shown here on CPU with outputs broken on purpose."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).parents[1]))
import _checks
from _ranks import run_ranks


def _bf16_gemm(m=6144, k=512, n=1728, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (k, n), jnp.float32).astype(jnp.bfloat16)
    y = jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)  # a right GEMM
    return x, w, np.asarray(y)


def _frobenius(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def test_a_right_low_precision_gemm_passes():
    for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
        kx, kw = jax.random.split(jax.random.key(1))
        x = jax.random.normal(kx, (2, 96, 640), jnp.float32).astype(dtype)
        w = jax.random.normal(kw, (640, 200), jnp.float32).astype(dtype)
        y = jnp.matmul(x, w, preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)
        _checks.assert_close(y.astype(dtype), _checks.matmul_expected(x, w), str(dtype))


def test_wrong_elements_that_the_frobenius_norm_hides_are_found():
    x, w, y = _bf16_gemm()
    want = _checks.matmul_expected(x, w)
    _checks.assert_close(y, want)
    broken = y.copy()
    broken[-1, -600:] = 0  # the tail of one row never written (zero, not the NaN poison)
    assert _frobenius(broken, want.value) < 1e-2  # what the tiers' old bf16 check accepted
    with pytest.raises(AssertionError, match=r"elements beyond their bound; the worst at \(6143, "):
        _checks.assert_close(broken, want)
    swapped = y.copy()
    swapped[[0, 1]] = swapped[[1, 0]]  # two rows from the wrong place
    with pytest.raises(AssertionError, match="beyond their bound"):
        _checks.assert_close(swapped, want)


def test_a_stale_partial_in_a_sum_is_found():
    parts = jax.random.normal(jax.random.key(2), (4, 256, 300), jnp.float32).astype(jnp.bfloat16)
    want = _checks.sum_expected(parts, roundings=5)
    chain = parts[0]
    for p in parts[1:]:  # partial sums rounded to bf16 at every hop
        chain = (chain.astype(jnp.float32) + p.astype(jnp.float32)).astype(jnp.bfloat16)
    _checks.assert_close(np.asarray(chain), want)
    stale = np.asarray(chain).copy()
    stale[7] = np.asarray(parts[:3].astype(jnp.float32).sum(0)).astype(stale.dtype)[7]  # one partial short
    with pytest.raises(AssertionError, match="beyond their bound"):
        _checks.assert_close(stale, want)


def test_every_device_copy_of_a_replicated_output_is_read(cpu_mesh):
    mesh = cpu_mesh(4)
    x = jnp.arange(8.0)

    def f(x):  # a gather that only rank 0 gets right
        g = lax.all_gather(x, "tp", tiled=True)
        return jnp.where(lax.axis_index("tp") == 0, g, jnp.nan)

    out = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("tp"), out_specs=P(), check_vma=False))(x)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x))  # device 0's copy only
    with pytest.raises(AssertionError, match=r"output on \S*1\b"):
        _checks.assert_equal(out, x)
    with pytest.raises(AssertionError, match="NaN"):
        _checks.assert_close(out, _checks.sum_expected(x[None]))


def test_a_sharded_output_is_checked_shard_by_shard(cpu_mesh):
    mesh = cpu_mesh(4)
    x, w, _ = _bf16_gemm(64, 32, 48)
    f = jax.jit(
        jax.shard_map(
            lambda x, w: jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16),
            mesh=mesh,
            in_specs=(P("tp"), P()),
            out_specs=P("tp"),
            check_vma=False,
        )
    )
    _checks.assert_close(f(x, w), _checks.matmul_expected(x, w))
    wrong = jax.jit(
        jax.shard_map(
            lambda x, w: jnp.matmul(x[::-1], w).astype(jnp.bfloat16),  # rows reversed
            mesh=mesh,
            in_specs=(P("tp"), P()),
            out_specs=P("tp"),
            check_vma=False,
        )
    )
    with pytest.raises(AssertionError, match="beyond their bound"):
        _checks.assert_close(wrong(x, w), _checks.matmul_expected(x, w))


def test_run_ranks_reports_a_rank_whose_assertion_failed():
    def fn(r):
        with pytest.raises(ValueError):
            if r != 2:  # rank 2 does not raise: pytest.raises fails inside its thread
                raise ValueError("expected")
        return "ok"

    with pytest.raises(AssertionError, match="rank 2 failed"):
        run_ranks(4, fn)
    assert run_ranks(3, lambda r: r * 10) == {0: 0, 1: 10, 2: 20}
