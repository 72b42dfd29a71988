"""Shared by the CPU tests of the TP layers (test_layers*.py, test_gated_mlp.py).

The plain unsharded float32 oracles, the NNX and linen layer builders, and the value-and-gradient
comparison against an oracle. ``B, S, H, F`` are the sizes most of those files use (the builders
use them); a file with its own sizes (a gated FFN of 24, a smaller batch) defines them itself.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ub import linen as ubl
from jax_ub import nn as ubnn

B, S, H, F = 4, 8, 16, 32  # batch, sequence, hidden, ffn
HIGHEST = jax.lax.Precision.HIGHEST
TOL = dict(rtol=2e-5, atol=2e-5)
NORMAL = nnx.initializers.normal(1.0)  # non-zero biases, so a bias added twice or not at all shows


@pytest.fixture(autouse=True)
def on_cpu():
    """Fresh arrays live on the CPU devices the meshes are made of (matters on a GPU host).

    Autouse in each test module that imports it (``from _layer_helpers import on_cpu``).
    """
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def fsdp_mesh(cpu_mesh, tp=2, fsdp=2, explicit=False):
    """A ("fsdp", "tp") mesh of ``fsdp x tp`` (the conftest mesh, renamed)."""
    mesh = cpu_mesh(tp, dp=fsdp, explicit=explicit)
    return jax.sharding.Mesh(mesh.devices, ("fsdp", "tp"), axis_types=mesh.axis_types)


def data(*shape, seed=1, mean=0.0):
    x = jax.random.normal(jax.random.key(seed), shape, jnp.float32)
    return mean + x if mean else x


# ------------------------------------------------------------------------------------------------
# Plain (unsharded) models: the oracle.


def dot(a, b):
    return jnp.dot(a, b, precision=HIGHEST)


def plain_dense(p, x):
    return dot(x, p["kernel"]) + p["bias"]


def layer_norm(x, scale, bias, eps=1e-6):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps) * scale + bias


def plain_mlp(p, x, eps=1e-6, gated=False):
    """LayerNorm, ``up``, GELU, ``down``; ``gated``: SwiGLU, ``up``'s columns interleaved as
    (gate, linear) pairs."""
    h = plain_dense(p["up"], layer_norm(x, p["norm"]["scale"], p["norm"]["bias"], eps))
    h = jax.nn.silu(h[..., 0::2]) * h[..., 1::2] if gated else jax.nn.gelu(h)
    return plain_dense(p["down"], h)


PLAIN = {"column": plain_dense, "row": plain_dense, "mlp": plain_mlp}
IN = {"column": H, "row": F, "mlp": H}
OUT = {"column": F, "row": H, "mlp": H}


# ------------------------------------------------------------------------------------------------
# The layers, and their parameters as plain trees.


def nnx_layer(kind, **kw):
    """The NNX layer of ``kind`` ("column", "row" or "mlp") at the sizes above."""
    kw = dict(rngs=nnx.Rngs(0), **kw)
    if kind == "column":
        return ubnn.ColumnParallelDense(H, F, **kw)
    if kind == "row":
        return ubnn.RowParallelDense(F, H, **kw)
    return ubnn.ParallelMLP(H, F, **kw)


def linen_layer(kind, **kw):
    """The linen layer of ``kind`` ("column", "row" or "mlp") at the sizes above."""
    return {
        "column": lambda: ubl.ColumnParallelDense(F, **kw),
        "row": lambda: ubl.RowParallelDense(H, **kw),
        "mlp": lambda: ubl.ParallelMLP(F, **kw),
    }[kind]()


def pure(module):
    return nnx.to_pure_dict(nnx.state(module, nnx.Param))


def randomized(params, seed=5):
    """``params`` with every 1-D leaf (biases, norm scale and bias) moved by N(0, 1) noise, each
    keeping its sharding: with zero biases and an identity norm, a forward check cannot see a bias
    added twice or a norm parameter ignored (only the gradients would)."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    new = [
        jax.device_put(
            np.asarray(v) + np.asarray(jax.random.normal(k, v.shape, v.dtype)), getattr(v, "sharding", None)
        )
        if v.ndim == 1
        else v
        for v, k in zip(leaves, keys, strict=True)
    ]
    return jax.tree.unflatten(tree, new)


def param_specs(module):
    return nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(module, nnx.Param)))


def nnx_fn(module):
    """``module`` as a function of its parameters (a plain tree) and x."""
    graphdef, rest = nnx.graphdef(module), nnx.state(module, nnx.Not(nnx.Param))
    return lambda params, x: nnx.merge(graphdef, params, rest)(x)


# ------------------------------------------------------------------------------------------------
# Comparison.


def value_and_grads(fn, params, x, ct):
    """fn's output, and jit(grad) of sum(fn(params, x) * ct) w.r.t. params and x."""
    loss = lambda p, x: jnp.sum(fn(p, x) * ct)  # noqa: E731
    return jax.jit(fn)(params, x), jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)


def assert_close(a, b, **tol):
    """Every leaf of the trees ``a`` and ``b`` (of one structure) close: ``tol`` or :data:`TOL`."""
    jax.tree.map(lambda u, v: np.testing.assert_allclose(np.asarray(u), np.asarray(v), **(tol or TOL)), a, b)


def nnx_matches(mesh, build, oracle, x, ct):
    """The NNX layer ``build()``, built and called under ``mesh`` on global arrays, against
    ``oracle`` on its parameters gathered whole: output and gradients (w.r.t. parameters and x)
    close. Returns the layer's output."""
    with jax.set_mesh(mesh):
        module = build()
        params = pure(module)
        got, got_g = value_and_grads(nnx_fn(module), params, x, ct)
    want, want_g = value_and_grads(oracle, jax.device_get(params), x, ct)
    assert_close(got, want)
    assert_close(got_g, want_g)
    return got


def linen_matches(mesh, model, oracle, x, ct, perturb=False):
    """The linen ``model``, initialised and applied under ``mesh`` on global arrays, against
    ``oracle`` on its parameters gathered whole: output and gradients (w.r.t. parameters and x)
    close. ``perturb``: the 1-D parameters :func:`randomized` first. Returns the model's output."""
    with jax.set_mesh(mesh):
        params = nn.unbox(jax.jit(model.init)(jax.random.key(0), x))["params"]
        if perturb:
            params = randomized(params)
        got, got_g = value_and_grads(lambda p, x: model.apply({"params": p}, x), params, x, ct)
    want, want_g = value_and_grads(oracle, jax.device_get(params), x, ct)
    assert_close(got, want)
    assert_close(got_g, want_g)
    return got
