"""Multi-GPU tier: the Flax layers (jax_ub.nn, jax_ub.linen) on the CUDA path.

The layers run in global mode on a GPU mesh with a CUDA method and are compared, forward and
gradients, with the same parameters through ``method="xla"`` in float32 (the reference). The
lowered program must contain both overlap custom calls, so the CUDA path is what ran. Skips
without >= 2 CUDA GPUs.
"""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
flax = pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from tests.multigpu.test_overlap import HP, MAX_TP, _mesh, _n_gpus, _rel  # noqa: E402

pytestmark = pytest.mark.multigpu  # tests/conftest.py skips it without 2 GPUs

TOL = {jnp.bfloat16: 2e-2, jnp.float32: 1e-4}
B, H, F = 2, 512, 1024  # batch, hidden, ffn (the sequence is 128 rows per device)
CUDA_METHOD = "ring"  # valid for both ops: the column layer's AG and the row layer's RS


@pytest.fixture(scope="module")
def ub():
    import jax_ub

    yield jax_ub
    jax_ub.shutdown()


def _value_and_grads(fn, params, x, ct):
    loss = lambda p, x: jnp.sum(fn(p, x).astype(jnp.float32) * ct)  # noqa: E731
    return jax.jit(fn)(params, x), jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)


def _check(got, want, dtype):
    (y, g), (y_ref, g_ref) = got, want
    assert _rel(y, y_ref) <= TOL[dtype], _rel(y, y_ref)
    assert jax.tree.structure(g) == jax.tree.structure(g_ref)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g), jax.tree.leaves(g_ref), strict=True):
        assert _rel(a, b) <= TOL[dtype], (jax.tree_util.keystr(path), _rel(a, b))


def _assert_cuda_path(fn, params, x):
    hlo = jax.jit(fn).lower(params, x).as_text()
    assert "jax_ub_ag_gemm" in hlo and "jax_ub_gemm_rs" in hlo


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("kind", ["mlp", "swiglu"])
def test_nnx_parallel_mlp_on_the_cuda_path(ub, kind, dtype):
    from jax_ub import nn as ubnn

    mesh = _mesh(min(_n_gpus(), MAX_TP))
    tp = mesh.shape["tp"]
    ub.initialize(mesh, "tp")
    gated = dict(gated=True, activation=jax.nn.silu, use_bias=False) if kind == "swiglu" else {}

    def make(method, compute):
        return ubnn.ParallelMLP(
            H,
            F,
            dtype=compute,
            param_dtype=jnp.float32,
            method=method,
            precision=HP,
            rngs=nnx.Rngs(0),
            **gated,
        )

    def fn_of(module):
        graphdef, rest = nnx.graphdef(module), nnx.state(module, nnx.Not(nnx.Param))
        return lambda p, x: nnx.merge(graphdef, p, rest)(x)

    x = jax.random.normal(jax.random.key(1), (B, 128 * tp, H), jnp.float32)
    ct = jax.random.normal(jax.random.key(2), (B, 128 * tp, H), jnp.float32)
    with jax.set_mesh(mesh):
        cuda, ref = make(CUDA_METHOD, dtype), make("xla", jnp.float32)
        params = nnx.to_pure_dict(nnx.state(cuda, nnx.Param))
        if gated:
            assert params["up"]["kernel"].shape == (H, 2 * F)
        got = _value_and_grads(fn_of(cuda), params, x.astype(dtype), ct)
        want = _value_and_grads(fn_of(ref), params, x, ct)
        _assert_cuda_path(fn_of(cuda), params, x.astype(dtype))
    assert got[0].dtype == dtype
    _check(got, want, dtype)


def test_linen_gated_mlp_on_the_cuda_path(ub):
    from jax_ub import linen as ubl

    mesh = _mesh(min(_n_gpus(), MAX_TP))
    tp = mesh.shape["tp"]
    ub.initialize(mesh, "tp")
    x = jax.random.normal(jax.random.key(3), (B, 128 * tp, H), jnp.float32)
    ct = jax.random.normal(jax.random.key(4), (B, 128 * tp, H), jnp.float32)

    def model(method, dtype):
        return ubl.ParallelMLP(
            F, gated=True, activation=jax.nn.silu, dtype=dtype, method=method, precision=HP
        )

    with jax.set_mesh(mesh):
        params = nn.unbox(jax.jit(model("xla", jnp.float32).init)(jax.random.key(0), x))["params"]
        cuda = lambda p, x: model(CUDA_METHOD, jnp.bfloat16).apply({"params": p}, x)  # noqa: E731
        ref = lambda p, x: model("xla", jnp.float32).apply({"params": p}, x)  # noqa: E731
        got = _value_and_grads(cuda, params, x.astype(jnp.bfloat16), ct)
        want = _value_and_grads(ref, params, x, ct)
        _assert_cuda_path(cuda, params, x.astype(jnp.bfloat16))
    _check(got, want, jnp.bfloat16)
