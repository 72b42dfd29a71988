"""jax.checkpoint policies and jax_ub's named values (``jax_ub.checkpoint_policy``).

On the CUDA path each op is one opaque custom call. Here a CPU stand-in keeps that property: its
GEMM is a ``pure_callback`` (no dot_general for ``dots_saveable`` to see), dispatched through the
same custom_vjp as the CUDA algorithms. The number of callbacks in the value-and-grad program
counts the GEMMs that run, forward and recomputed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub import ops

TP = 4
CP = jax.checkpoint_policies


def _opaque_dot(a, b):
    out = jax.ShapeDtypeStruct((*a.shape[:-1], b.shape[-1]), a.dtype)
    return jax.pure_callback(lambda a, b: np.asarray(a) @ np.asarray(b), out, a, b)


def _opaque(op):
    def impl(x, w, *, axis_name, axis, precision, need_full=True):
        del precision, need_full
        if op == ops.AG:
            xg = lax.all_gather(x, axis_name, axis=axis, tiled=True)
            return _opaque_dot(xg, w), xg
        return lax.psum_scatter(_opaque_dot(x, w), axis_name, scatter_dimension=axis, tiled=True), x

    return impl


@pytest.fixture
def opaque_ops(monkeypatch):
    monkeypatch.setitem(ops._IMPLS, (ops.AG, "opaque"), _opaque(ops.AG))
    monkeypatch.setitem(ops._IMPLS, (ops.RS, "opaque"), _opaque(ops.RS))
    monkeypatch.setattr(ops, "_requested", lambda method, fn=None, **kw: method)
    monkeypatch.setattr(ops, "_resolve_for_size", lambda method, tp, *operands, fn=None: method)


def _model(cpu_mesh, method, policy):
    def layer(x, w1, w2):
        h = ops.all_gather_matmul(x, w1, "tp", method=method)
        return ops.matmul_reduce_scatter(jnp.tanh(h), w2, "tp", method=method)

    body = layer if policy is None else jax.checkpoint(layer, policy=policy)
    f = jax.shard_map(body, mesh=cpu_mesh(TP), in_specs=(P("tp"), P(None, "tp"), P("tp")), out_specs=P("tp"))
    return jax.value_and_grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2))


def _operands():
    k = jax.random.split(jax.random.key(3), 3)
    return (
        jax.random.normal(k[0], (8 * TP, 16)),
        jax.random.normal(k[1], (16, 8 * TP)),
        jax.random.normal(k[2], (8 * TP, 16)),
    )


def _gemms(fn, args) -> int:
    return str(jax.make_jaxpr(fn)(*args)).count("pure_callback[")


@pytest.mark.parametrize(
    "policy,recomputes",
    [
        (None, False),
        (CP.nothing_saveable, True),
        (CP.dots_saveable, True),  # a dot inside a custom call is invisible to it
        (jax_ub.checkpoint_policy(CP.dots_saveable), False),
        (jax_ub.checkpoint_policy(CP.nothing_saveable), False),
        (jax_ub.checkpoint_policy(), False),
    ],
    ids=["no-remat", "nothing", "dots", "ub(dots)", "ub(nothing)", "ub"],
)
def test_policy_decides_whether_the_backward_recomputes_the_op(opaque_ops, cpu_mesh, policy, recomputes):
    args = _operands()
    base = _gemms(_model(cpu_mesh, "opaque", None), args)
    got = _gemms(_model(cpu_mesh, "opaque", policy), args)
    assert (got > base) == recomputes, (got, base)
    (v, g), (v_ref, g_ref) = (_model(cpu_mesh, "opaque", policy)(*args), _model(cpu_mesh, "xla", None)(*args))
    np.testing.assert_allclose(v, v_ref, rtol=1e-5)
    for a, b in zip(g, g_ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method", ["opaque", "xla"])
def test_outputs_carry_their_names_on_every_path(opaque_ops, cpu_mesh, method):
    text = str(jax.make_jaxpr(_model(cpu_mesh, method, None))(*_operands()))
    assert "name=jax_ub_ag_out" in text and "name=jax_ub_rs_out" in text
    assert "name=jax_ub_gathered" in text
    assert set(jax_ub.CHECKPOINT_NAMES) == {
        "jax_ub_ag_out",
        "jax_ub_rs_out",
        "jax_ub_gathered",
        "jax_ub_matmul_out",
    }


def _gathers(fn, args) -> int:
    return str(jax.make_jaxpr(fn)(*args)).count("all_gather[")


@pytest.mark.parametrize(
    "policy,regathers",
    [
        (CP.nothing_saveable, True),
        (CP.dots_saveable, True),  # keeps the dot's output, not its gathered input
        (jax_ub.checkpoint_policy(CP.dots_saveable), False),
        (jax_ub.checkpoint_policy(), False),
    ],
    ids=["nothing", "dots", "ub(dots)", "ub"],
)
def test_reference_path_keeps_the_gathered_x_under_the_policy(cpu_mesh, policy, regathers):
    """On the reference path (XLA's own all-gather and dot) the gathered x is named before the dot
    uses it: a policy that keeps "jax_ub_gathered" spares the backward a second all-gather of x."""
    args = _operands()
    base = _gathers(_model(cpu_mesh, "xla", None), args)  # x's gather, and dy's for the RS's dgrad
    got = _gathers(_model(cpu_mesh, "xla", policy), args)
    assert base == 2, base
    assert (got > base) == regathers, (got, base)
    (v, g), (v_ref, g_ref) = (_model(cpu_mesh, "xla", policy)(*args), _model(cpu_mesh, "xla", None)(*args))
    np.testing.assert_allclose(v, v_ref, rtol=1e-6)
    for a, b in zip(g, g_ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)  # remat may fuse differently


@pytest.fixture
def opaque_matmul(monkeypatch):
    """``jax_ub.matmul`` as on the CUDA path: its GEMMs (forward and backward) are opaque."""
    from jax_ub import gemm

    def fake(a, b, trans_a, trans_b, precision, use_cuda):
        assert use_cuda
        return _opaque_dot(a.T if trans_a else a, b.T if trans_b else b)

    monkeypatch.setattr(gemm, "_gemm", fake)
    monkeypatch.setattr(gemm, "_use_cuda", lambda method: True)


def _matmul_model(policy):
    def layer(x, w1, w2):
        return jax_ub.matmul(jnp.tanh(jax_ub.matmul(x, w1)), w2)

    body = layer if policy is None else jax.checkpoint(layer, policy=policy)
    return jax.value_and_grad(lambda *a: jnp.sum(body(*a) ** 2), argnums=(0, 1, 2))


@pytest.mark.parametrize(
    "policy,recomputes",
    [
        (CP.dots_saveable, True),
        (jax_ub.checkpoint_policy(CP.dots_saveable), False),
        (jax_ub.checkpoint_policy(), False),
    ],
    ids=["dots", "ub(dots)", "ub"],
)
def test_matmul_output_is_kept_by_the_policy(opaque_matmul, policy, recomputes):
    args = _operands()
    base = _gemms(_matmul_model(None), args)
    got = _gemms(_matmul_model(policy), args)
    assert (got > base) == recomputes, (got, base)
    v, g = _matmul_model(policy)(*args)
    x, w1, _ = args
    v_ref, g_ref = jax.value_and_grad(
        lambda *a: jnp.sum((jnp.tanh(a[0] @ a[1]) @ a[2]) ** 2), argnums=(0, 1, 2)
    )(*args)
    np.testing.assert_allclose(v, v_ref, rtol=1e-5)
    for a, b in zip(g, g_ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    assert "name=jax_ub_matmul_out" in str(jax.make_jaxpr(lambda x, w: jax_ub.matmul(x, w))(x, w1))
