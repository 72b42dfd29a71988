"""CPU tier: the ``norm`` option of ParallelMLP (NNX and linen): ``"layernorm"`` (the default),
``"rmsnorm"`` (Llama, Mistral) and ``None``.

The oracle is written out by hand in float32 on unsharded arrays: RMSNorm as
``x / sqrt(mean(x**2) + eps) * w`` and Llama's MLP from *separate* gate, up and down matrices, as a
checkpoint stores them; the layer gets them through :func:`jax_ub.nn.pack_gated`.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _layer_helpers import (
    HIGHEST,
    assert_close,
    data,
    dot,
    layer_norm,
    nnx_fn,
    on_cpu,  # noqa: F401  (autouse fixture)
    param_specs,
    pure,
    value_and_grads,
)
from flax import nnx
from jax.sharding import PartitionSpec as P

from jax_ub import linen as ubl
from jax_ub import nn as ubnn

B, S, H, F = 2, 8, 16, 24
EPS = 1e-5  # Llama's rms_norm_eps; not the layer's default, so a dropped epsilon shows
# this file's tolerance (the shared default is 2e-5); a call may still pass its own
assert_close = functools.partial(assert_close, rtol=3e-5, atol=3e-5)


def rms_norm(x, w, eps=EPS):
    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def llama_mlp(w, x):
    """Hugging Face's ``LlamaMLP(LlamaRMSNorm(x))`` in float32, from separate matrices."""
    h = rms_norm(x, w["rms"])
    return dot(jax.nn.silu(dot(h, w["gate"])) * dot(h, w["up"]), w["down"])


def llama_weights(seed=10):
    k = jax.random.split(jax.random.key(seed), 4)
    return {
        "gate": 0.3 * jax.random.normal(k[0], (H, F)),
        "up": 0.3 * jax.random.normal(k[1], (H, F)),
        "down": 0.3 * jax.random.normal(k[2], (F, H)),
        "rms": 1.0 + 0.2 * jax.random.normal(k[3], (H,)),
    }


def to_layer(w):
    """The layer's parameter tree from the checkpoint's separate matrices."""
    return {
        "norm": {"scale": w["rms"]},
        "up": {"kernel": ubnn.pack_gated(w["gate"], w["up"])},
        "down": {"kernel": w["down"]},
    }


def from_layer_grads(g):
    gate, up = ubnn.unpack_gated(g["up"]["kernel"])
    return {"gate": gate, "up": up, "down": g["down"]["kernel"], "rms": g["norm"]["scale"]}


def llama_nnx(**kw):
    return ubnn.ParallelMLP(
        H,
        F,
        gated=True,
        activation=jax.nn.silu,
        use_bias=False,
        norm="rmsnorm",
        epsilon=EPS,
        precision=HIGHEST,
        rngs=nnx.Rngs(0),
        **kw,
    )


def llama_linen(**kw):
    return ubl.ParallelMLP(
        F,
        gated=True,
        activation=jax.nn.silu,
        use_bias=False,
        norm="rmsnorm",
        epsilon=EPS,
        precision=HIGHEST,
        **kw,
    )


# ------------------------------------------------------------------------------------------------
# Llama's MLP: RMSNorm + SwiGLU from a checkpoint's separate matrices.


@pytest.mark.parametrize("mode", ["global", "shard_map"])
@pytest.mark.parametrize("tp", [2, 4], ids=lambda t: f"tp{t}")
def test_nnx_llama_mlp_matches_hand_written_oracle(cpu_mesh, tp, mode):
    mesh = cpu_mesh(tp)
    w = llama_weights()
    x, ct = data(B, S, H, mean=1.0), data(B, S, H, seed=2)  # a nonzero mean, as residual streams have
    if mode == "global":
        with jax.set_mesh(mesh):
            mlp = llama_nnx()
            fn = nnx_fn(mlp)
    else:
        mlp = llama_nnx()  # whole parameters, split by the shard_map below
        specs = param_specs(mlp)
        fn = jax.shard_map(nnx_fn(mlp), mesh=mesh, in_specs=(specs, P(None, "tp")), out_specs=P(None, "tp"))
    assert jax.tree.map(jnp.shape, pure(mlp)) == {
        "norm": {"scale": (H,)},
        "up": {"kernel": (H, 2 * F)},
        "down": {"kernel": (F, H)},
    }
    with jax.set_mesh(mesh):
        got, (gp, gx) = value_and_grads(fn, to_layer(w), x, ct)
    want, (wp, wx) = value_and_grads(llama_mlp, w, x, ct)
    assert float(jnp.abs(want).max()) > 0.5  # the comparison below is not between near-zeros
    assert_close(got, want)
    assert_close(gx, wx)
    assert_close(from_layer_grads(gp), wp)


def test_linen_llama_mlp_matches_hand_written_oracle(cpu_mesh):
    w = llama_weights()
    x, ct = data(B, S, H, mean=1.0), data(B, S, H, seed=2)
    model = llama_linen()
    with jax.set_mesh(cpu_mesh(4)):
        init = nn.unbox(jax.jit(model.init)(jax.random.key(0), x))["params"]
        assert jax.tree.map(jnp.shape, init) == {
            "norm": {"scale": (H,)},
            "up": {"kernel": (H, 2 * F)},
            "down": {"kernel": (F, H)},
        }
        np.testing.assert_array_equal(init["norm"]["scale"], np.ones(H))
        got, (gp, gx) = value_and_grads(lambda p, x: model.apply({"params": p}, x), to_layer(w), x, ct)
    want, (wp, wx) = value_and_grads(llama_mlp, w, x, ct)
    assert_close(got, want)
    assert_close(gx, wx)
    assert_close(from_layer_grads(gp), wp)


def test_rmsnorm_differs_from_layernorm_on_the_same_weights(cpu_mesh):
    """The option changes the numbers (a LayerNorm in place of RMSNorm would pass otherwise)."""
    w = llama_weights()
    x = data(B, S, H, mean=1.0)
    with jax.set_mesh(cpu_mesh(2)):
        rms = llama_nnx()
        ln = ubnn.ParallelMLP(
            H,
            F,
            gated=True,
            activation=jax.nn.silu,
            use_bias=False,
            epsilon=EPS,
            precision=HIGHEST,
            rngs=nnx.Rngs(0),
        )
        params = to_layer(w)
        y_rms = jax.jit(nnx_fn(rms))(params, x)
        y_ln = jax.jit(nnx_fn(ln))({**params, "norm": {"scale": w["rms"], "bias": jnp.zeros(H)}}, x)
    assert_close(y_rms, llama_mlp(w, x))
    assert float(jnp.abs(y_ln - llama_mlp(w, x)).max()) > 0.1


def test_rmsnorm_keeps_a_low_precision_dtype(cpu_mesh):
    w = llama_weights()
    x = data(B, S, H, mean=1.0)
    with jax.set_mesh(cpu_mesh(2)):
        mlp = llama_nnx(dtype=jnp.bfloat16)
        y = jax.jit(nnx_fn(mlp))(to_layer(w), x)
    assert y.dtype == jnp.bfloat16
    want = llama_mlp(w, x)
    err = float(jnp.linalg.norm(y.astype(jnp.float32) - want) / jnp.linalg.norm(want))
    assert err < 2e-2, err


# ------------------------------------------------------------------------------------------------
# norm=None: no norm and no norm parameters.


def plain_mlp_no_norm(p, x):
    h = jax.nn.gelu(dot(x, p["up"]["kernel"]) + p["up"]["bias"])
    return dot(h, p["down"]["kernel"]) + p["down"]["bias"]


def test_no_norm_nnx_and_linen(cpu_mesh):
    x, ct = data(B, S, H, mean=1.0), data(B, S, H, seed=2)
    bias_init = nnx.initializers.normal(1.0)
    with jax.set_mesh(cpu_mesh(2)):
        mlp = ubnn.ParallelMLP(H, F, norm=None, bias_init=bias_init, precision=HIGHEST, rngs=nnx.Rngs(0))
        assert mlp.norm is None
        params = pure(mlp)
        assert set(params) == {"up", "down"}
        got, got_g = value_and_grads(nnx_fn(mlp), params, x, ct)
        model = ubl.ParallelMLP(F, norm=None, bias_init=bias_init, precision=HIGHEST)
        lparams = nn.unbox(jax.jit(model.init)(jax.random.key(0), x))["params"]
        assert set(lparams) == {"up", "down"}
        got_l, got_lg = value_and_grads(lambda p, x: model.apply({"params": p}, x), lparams, x, ct)
    want, want_g = value_and_grads(plain_mlp_no_norm, jax.device_get(params), x, ct)
    assert_close(got, want)
    assert_close(got_g, want_g)
    want_l, want_lg = value_and_grads(plain_mlp_no_norm, jax.device_get(lparams), x, ct)
    assert_close(got_l, want_l)
    assert_close(got_lg, want_lg)


# ------------------------------------------------------------------------------------------------
# The default is the LayerNorm of before, with the same parameters.


def test_layernorm_is_the_default_with_the_same_params(cpu_mesh):
    x = data(B, S, H, mean=1.0)
    with jax.set_mesh(cpu_mesh(2)):
        default = ubnn.ParallelMLP(H, F, precision=HIGHEST, rngs=nnx.Rngs(0))
        named = ubnn.ParallelMLP(H, F, norm="layernorm", precision=HIGHEST, rngs=nnx.Rngs(0))
        assert_close(pure(default), pure(named), rtol=0, atol=0)
        p = pure(default)
        y = nnx.jit(lambda m, x: m(x))(default, x)
        lp = nn.unbox(jax.jit(ubl.ParallelMLP(F).init)(jax.random.key(0), x))["params"]
    assert set(p["norm"]) == {"scale", "bias"} and set(lp["norm"]) == {"scale", "bias"}
    p = jax.device_get(p)
    h = layer_norm(x, p["norm"]["scale"], p["norm"]["bias"])
    want = (
        dot(jax.nn.gelu(dot(h, p["up"]["kernel"]) + p["up"]["bias"]), p["down"]["kernel"]) + p["down"]["bias"]
    )
    assert_close(y, want)


def test_error_unknown_norm(cpu_mesh):
    with jax.set_mesh(cpu_mesh(2)):
        with pytest.raises(
            ValueError,
            match=r"ParallelMLP: `norm` must be 'layernorm', 'rmsnorm' or "
            r"None \(no norm\); got 'RMSNorm'",
        ):
            ubnn.ParallelMLP(H, F, norm="RMSNorm", rngs=nnx.Rngs(0))
        with pytest.raises(ValueError, match=r"ParallelMLP: `norm` must be .*got 'batchnorm'"):
            ubl.ParallelMLP(F, norm="batchnorm").init(jax.random.key(0), data(B, S, H))
