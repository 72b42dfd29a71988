"""CPU tier: the gated ParallelMLP (GLU family: SwiGLU, GeGLU) of jax_ub.nn and jax_ub.linen
(on dp x tp meshes, Auto and Explicit axes: ``test_layers.py::test_dp_tp_mesh``).

The oracle is a plain unsharded SwiGLU written with *separate* gate and linear kernels, as a Llama
checkpoint stores them; :func:`jax_ub.nn.unpack_gated` maps the layer's interleaved ``up`` onto it.
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
    nnx_fn,
    on_cpu,  # noqa: F401  (autouse fixture)
    param_specs,
    pure,
    value_and_grads,
)
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_ub import linen as ubl
from jax_ub import nn as ubnn

B, S, H, F = 2, 8, 16, 24  # F = 24: 48 packed columns, whole pairs for tp 1, 2, 4 (and 8)
# this file's tolerance (the shared default is 2e-5)
assert_close = functools.partial(assert_close, rtol=3e-5, atol=3e-5)


def plain_swiglu(p, x, act=jax.nn.silu, eps=1e-6):
    """Unsharded reference from separate halves (the layer's packed ``up`` split back)."""
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    h = (x - mean) / jnp.sqrt(var + eps) * p["norm"]["scale"] + p["norm"]["bias"]
    wg, wl = ubnn.unpack_gated(p["up"]["kernel"])
    gate = jnp.dot(h, wg, precision=HIGHEST)
    lin = jnp.dot(h, wl, precision=HIGHEST)
    if "bias" in p["up"]:
        bg, bl = ubnn.unpack_gated(p["up"]["bias"])
        gate, lin = gate + bg, lin + bl
    y = jnp.dot(act(gate) * lin, p["down"]["kernel"], precision=HIGHEST)
    return y + p["down"].get("bias", 0.0)


def test_pack_and_unpack():
    g, lin = data(H, F), data(H, F, seed=2)
    packed = ubnn.pack_gated(g, lin)
    assert packed.shape == (H, 2 * F)
    np.testing.assert_array_equal(packed[:, 0::2], g)
    np.testing.assert_array_equal(packed[:, 1::2], lin)
    back = ubnn.unpack_gated(packed)
    np.testing.assert_array_equal(back[0], g)
    np.testing.assert_array_equal(back[1], lin)
    # a device's contiguous shard of the packed columns holds the same units of both halves
    tp = 4
    shard = packed[:, : 2 * F // tp]
    np.testing.assert_array_equal(ubnn.unpack_gated(shard)[0], g[:, : F // tp])
    np.testing.assert_array_equal(ubnn.unpack_gated(shard)[1], lin[:, : F // tp])
    with pytest.raises(ValueError, match=r"same shape; got \[16, 24\] and \[16, 12\]"):
        ubnn.pack_gated(g, lin[:, :12])
    with pytest.raises(ValueError, match=r"even .*got \[16, 5\]"):
        ubnn.unpack_gated(data(H, 5))


@pytest.mark.parametrize("use_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("tp", [1, 2, 4], ids=lambda t: f"tp{t}")
def test_nnx_gated_global_mode_matches_plain(cpu_mesh, tp, use_bias):
    mesh = cpu_mesh(tp)
    with jax.set_mesh(mesh):
        mlp = ubnn.ParallelMLP(
            H,
            F,
            gated=True,
            activation=jax.nn.silu,
            use_bias=use_bias,
            bias_init=nnx.initializers.normal(1.0),
            precision=HIGHEST,
            rngs=nnx.Rngs(0),
        )
        params = pure(mlp)
        assert params["up"]["kernel"].shape == (H, 2 * F)
        assert params["down"]["kernel"].shape == (F, H)
        x, ct = data(B, S, H), data(B, S, H, seed=2)
        got, got_g = value_and_grads(nnx_fn(mlp), params, x, ct)
    want, want_g = value_and_grads(plain_swiglu, jax.device_get(params), x, ct)
    assert_close(got, want)
    assert_close(got_g, want_g)
    assert got.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "tp")), 3)


def test_gated_from_separate_halves(cpu_mesh):
    """A checkpoint's separate gate/linear kernels, packed, give the SwiGLU written out by hand."""
    wg, wl, wd = data(H, F, seed=3), data(H, F, seed=4), data(F, H, seed=5)
    x = data(B, S, H)
    with jax.set_mesh(cpu_mesh(4)):
        mlp = ubnn.ParallelMLP(
            H, F, gated=True, activation=jax.nn.silu, use_bias=False, precision=HIGHEST, rngs=nnx.Rngs(0)
        )
        mlp.up.kernel[...] = ubnn.pack_gated(wg, wl)
        mlp.down.kernel[...] = wd
        got = nnx.jit(lambda m, x: m(x))(mlp, x)
    mean = x.mean(-1, keepdims=True)
    h = (x - mean) / jnp.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-6)
    want = (jax.nn.silu(h @ wg) * (h @ wl)) @ wd
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


def test_linen_gated_matches_nnx_and_plain(cpu_mesh):
    x, ct = data(B, S, H), data(B, S, H, seed=2)
    model = ubl.ParallelMLP(F, gated=True, activation=jax.nn.gelu, precision=HIGHEST)
    with jax.set_mesh(cpu_mesh(2)):
        params = nn.unbox(jax.jit(model.init)(jax.random.key(0), x))["params"]
        assert params["up"]["kernel"].shape == (H, 2 * F)
        got, got_g = value_and_grads(lambda p, x: model.apply({"params": p}, x), params, x, ct)
        mlp = ubnn.ParallelMLP(H, F, gated=True, activation=jax.nn.gelu, rngs=nnx.Rngs(0))
        assert jax.tree.structure(pure(mlp)) == jax.tree.structure(params)
        y_nnx = nnx_fn(mlp)(params, x)
    want, want_g = value_and_grads(
        lambda p, x: plain_swiglu(p, x, act=jax.nn.gelu), jax.device_get(params), x, ct
    )
    assert_close(got, want)
    assert_close(got_g, want_g)
    np.testing.assert_allclose(np.asarray(y_nnx), np.asarray(got), rtol=1e-5, atol=1e-5)


def test_nnx_gated_inside_user_shard_map(cpu_mesh):
    mesh = cpu_mesh(4)
    mlp = ubnn.ParallelMLP(
        H, F, gated=True, activation=jax.nn.silu, precision=HIGHEST, rngs=nnx.Rngs(0)
    )  # built without a mesh: whole arrays
    params = pure(mlp)
    specs = param_specs(mlp)
    fn = jax.shard_map(nnx_fn(mlp), mesh=mesh, in_specs=(specs, P(None, "tp")), out_specs=P(None, "tp"))
    x, ct = data(B, S, H), data(B, S, H, seed=2)
    got, got_g = value_and_grads(fn, params, x, ct)
    want, want_g = value_and_grads(plain_swiglu, params, x, ct)
    assert_close(got, want)
    assert_close(got_g, want_g)


def test_gated_program_has_no_extra_collective(cpu_mesh):
    """The pair split runs where the units live: no collective beyond the reference path's own
    all-gather and reduce-scatter (forward), as for the ungated MLP."""
    x = data(B, S, H)
    with jax.set_mesh(cpu_mesh(4)):
        counts = []
        for gated in (False, True):
            mlp = ubnn.ParallelMLP(H, F, gated=gated, method="xla", rngs=nnx.Rngs(0))
            text = jax.jit(nnx_fn(mlp)).lower(pure(mlp), x).compile().as_text()
            counts.append(
                {
                    op: text.count(f" {op}(")
                    for op in (
                        "all-gather",
                        "reduce-scatter",
                        "all-reduce",
                        "all-to-all",
                        "collective-permute",
                    )
                }
            )
    assert counts[0] == counts[1], counts
    assert counts[1]["all-gather"] >= 1


def test_error_ffn_not_whole_pairs_per_device(cpu_mesh):
    # 2 * 6 = 12 packed columns divide by 4, but 6 units do not: a pair would straddle two devices
    with jax.set_mesh(cpu_mesh(4)):
        with pytest.raises(ValueError, match=r"ParallelMLP: ffn_features \(gated.*'tp' \(4\); got 6"):
            ubnn.ParallelMLP(H, 6, gated=True, rngs=nnx.Rngs(0))
        with pytest.raises(ValueError, match=r"ParallelMLP: ffn_features \(gated.*'tp' \(4\); got 6"):
            ubl.ParallelMLP(6, gated=True).init(jax.random.key(0), data(B, S, H))
    # built without a mesh, the check runs at the call
    mlp = ubnn.ParallelMLP(H, 6, gated=True, rngs=nnx.Rngs(0))
    with jax.set_mesh(cpu_mesh(4)), pytest.raises(ValueError, match=r"gate/linear pairs"):
        mlp(data(B, S, H))
