"""CPU tier: the Llama-style decoder of jax_ub.models.llama against a plain float32 Hugging Face-style
implementation (separate q/k/v/o/gate/up/down matrices taken out of the layer with the unpack
helpers, ``repeat_kv``, rotate-half RoPE, an explicit causal softmax), outputs and gradients, on a
("dp", "tp") mesh of 2 x 4 host devices; the stack under nnx.scan and remat; the no-communication
forward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _layer_helpers import HIGHEST, assert_close, data, on_cpu, randomized, value_and_grads  # noqa: F401
from flax import nnx

from jax_ub import nn as ubnn
from jax_ub.models import llama

CFG = llama.preset("tiny", dtype=jnp.float32, num_layers=2)  # hidden 64, 8 heads, 4 kv heads, hd 8
B, T = 2, 16
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")


def dot(a, b):
    return jnp.dot(a, b, precision=HIGHEST)


def rms(x, scale, eps):
    return x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * scale


def hf_layer(p, x, cfg, positions, tp):
    """Hugging Face's LlamaDecoderLayer, written out in float32 from separate matrices."""
    nq, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    wq, wk, wv = ubnn.unpack_qkv(p["attn"]["qkv"]["kernel"], num_heads=nq, num_kv_heads=nkv, tp=tp)
    wo = ubnn.unpack_out(p["attn"]["o"]["kernel"])
    gate, up, down = ubnn.unpack_mlp(p["mlp"]["up"]["kernel"], p["mlp"]["down"]["kernel"])
    b, t, _ = x.shape
    h = rms(x, p["input_norm"]["scale"], cfg.norm_eps)
    q = dot(h, wq.T).reshape(b, t, nq, hd)
    k = dot(h, wk.T).reshape(b, t, nkv, hd)
    v = dot(h, wv.T).reshape(b, t, nkv, hd)
    inv_freq = 1.0 / cfg.rope_theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)
    freqs = positions[..., None].astype(jnp.float32) * inv_freq
    emb = jnp.concatenate([freqs, freqs], -1)[:, :, None, :]
    cos, sin = jnp.cos(emb), jnp.sin(emb)

    def rotate_half(u):
        return jnp.concatenate([-u[..., hd // 2 :], u[..., : hd // 2]], -1)

    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    k, v = jnp.repeat(k, nq // nkv, axis=2), jnp.repeat(v, nq // nkv, axis=2)  # repeat_kv
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=HIGHEST) / np.sqrt(hd)
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -jnp.inf)
    attn = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v, precision=HIGHEST)
    x = x + dot(attn.reshape(b, t, nq * hd), wo.T)
    h = rms(x, p["mlp"]["norm"]["scale"], cfg.norm_eps)
    return x + dot(jax.nn.silu(dot(h, gate.T)) * dot(h, up.T), down.T)


def positions_for(offset):
    return jnp.broadcast_to(jnp.arange(T) + offset, (B, T))


@pytest.mark.parametrize("with_positions", [False, True], ids=["default-positions", "offset-positions"])
def test_layer_equals_hugging_face_layer(cpu_mesh, with_positions):
    mesh = cpu_mesh(4, dp=2)
    x, ct = data(B, T, CFG.hidden), data(B, T, CFG.hidden, seed=2)
    pos = positions_for(5) if with_positions else None
    with jax.set_mesh(mesh):
        layer = llama.LlamaLayer(CFG, rngs=nnx.Rngs(0))
        graphdef, params = nnx.split(layer, nnx.Param)
        params = randomized(nnx.to_pure_dict(params))  # norm scales other than ones
        got, got_g = value_and_grads(lambda p, x: nnx.merge(graphdef, p)(x, pos), params, x, ct)
    whole = jax.device_get(params)
    want, want_g = value_and_grads(
        lambda p, x: hf_layer(p, x, CFG, positions_for(5 if with_positions else 0), 4), whole, x, ct
    )
    assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert_close(got_g, want_g, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("remat", ["dots"])
def test_stack_scan_remat_equals_a_loop_of_layers(cpu_mesh, remat):
    cfg = CFG.replace(remat=remat)
    mesh = cpu_mesh(4, dp=2)
    x, ct = data(B, T, cfg.hidden), data(B, T, cfg.hidden, seed=2)
    with jax.set_mesh(mesh):
        stack = llama.LlamaStack(cfg, rngs=nnx.Rngs(0))
        graphdef, params = nnx.split(stack, nnx.Param)
        params = nnx.to_pure_dict(params)
        assert params["layers"]["attn"]["qkv"]["kernel"].shape == (2, cfg.hidden, 128)
        got, got_g = value_and_grads(lambda p, x: nnx.merge(graphdef, p)(x), params, x, ct)
    whole = jax.device_get(params)

    def loop(p, x):
        for i in range(cfg.num_layers):
            x = hf_layer(jax.tree.map(lambda a, i=i: a[i], p["layers"]), x, cfg, positions_for(0), 4)
        return x

    want, want_g = value_and_grads(loop, whole, x, ct)
    assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert_close(got_g, want_g, rtol=1e-4, atol=1e-4)


def test_model_trains_a_step_and_the_loss_is_finite(cpu_mesh):
    with jax.set_mesh(cpu_mesh(4, dp=2)):
        model = llama.LlamaModel(CFG, rngs=nnx.Rngs(0))
        tokens = jax.random.randint(jax.random.key(1), (B, T), 0, CFG.vocab)
        logits = nnx.jit(lambda m, t: m(t))(model, tokens)
        assert logits.shape == (B, T, CFG.vocab) and logits.dtype == jnp.float32
        assert np.isfinite(np.asarray(logits)).all()


def _hlo(fn, *args):
    return jax.jit(fn).lower(*args).compile().as_text()


def test_forward_no_comm_has_the_shapes_and_no_collective(cpu_mesh):
    """The floor: the same output shape and sharding, no collective in the compiled forward (the
    real forward has them: the check can fail)."""
    x = data(B, T, CFG.hidden)
    with jax.set_mesh(cpu_mesh(4, dp=2)):
        layer = llama.LlamaLayer(CFG, rngs=nnx.Rngs(0))
        graphdef, params = nnx.split(layer, nnx.Param)
        real = lambda p, x: nnx.merge(graphdef, p)(x)  # noqa: E731
        floor = lambda p, x: llama.forward_no_comm(nnx.merge(graphdef, p), x)  # noqa: E731
        y, y0 = jax.jit(real)(params, x), jax.jit(floor)(params, x)
        assert y.shape == y0.shape and y.sharding.spec == y0.sharding.spec
        real_hlo, floor_hlo = _hlo(real, params, x), _hlo(floor, params, x)
    assert any(c in real_hlo for c in COLLECTIVES)
    found = [c for c in COLLECTIVES if c in floor_hlo]
    assert not found, found


def test_presets_and_config_errors():
    c8, c70 = llama.preset("8b"), llama.preset("70b", num_layers=1)
    assert (c8.hidden, c8.num_heads, c8.num_kv_heads, c8.head_dim, c8.ffn) == (4096, 32, 8, 128, 14336)
    assert (c70.hidden, c70.num_heads, c70.num_kv_heads, c70.head_dim, c70.ffn) == (8192, 64, 8, 128, 28672)
    assert c70.num_layers == 1
    # 8B forward per token: 2 * (4096 * (6144 + 4096 + 3 * 14336)) + causal attention
    assert llama.layer_flops(c8, 1, 1, causal_half=False) == 2 * 4096 * (6144 + 4096 + 3 * 14336) + 4 * 4096
    with pytest.raises(ValueError, match="`num_heads` must be a multiple of `num_kv_heads`"):
        llama.LlamaConfig(num_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match="`remat` must be one of"):
        llama.LlamaConfig(remat="some")
    with pytest.raises(ValueError, match="unknown preset"):
        llama.preset("405b")


def test_layer_inside_shard_map_equals_global_mode(cpu_mesh):
    """Local mode: the layer called inside the user's shard_map on its parameters' shards gives the
    global mode's result."""
    from jax.sharding import PartitionSpec as P

    x = data(B, T, CFG.hidden)
    with jax.set_mesh(cpu_mesh(4, dp=2)):
        layer = llama.LlamaLayer(CFG, rngs=nnx.Rngs(0))
        graphdef, params = nnx.split(layer, nnx.Param)
        fn = lambda p, x: nnx.merge(graphdef, p)(x)  # noqa: E731
        spec = P("dp", "tp")
        local = jax.shard_map(fn, in_specs=(nnx.get_partition_spec(params), spec), out_specs=spec)
        np.testing.assert_array_equal(
            np.asarray(jax.jit(local)(params, x)), np.asarray(jax.jit(fn)(params, x))
        )


def test_hugging_face_weights_load_through_from_hf_layer(cpu_mesh):
    """Random weights named as a Hugging Face LlamaDecoderLayer's state dict (NumPy, torch's
    `[out, in]`), loaded with from_hf_layer for tp=4: the layer's output is the Hugging Face-style
    layer's on those very matrices."""
    rng = np.random.default_rng(0)
    nq, nkv, hd, h, f = CFG.num_heads, CFG.num_kv_heads, CFG.head_dim, CFG.hidden, CFG.ffn
    shapes = {
        "input_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (nq * hd, h),
        "self_attn.k_proj.weight": (nkv * hd, h),
        "self_attn.v_proj.weight": (nkv * hd, h),
        "self_attn.o_proj.weight": (h, nq * hd),
        "post_attention_layernorm.weight": (h,),
        "mlp.gate_proj.weight": (f, h),
        "mlp.up_proj.weight": (f, h),
        "mlp.down_proj.weight": (h, f),
    }
    hf = {
        k: (rng.standard_normal(s) / np.sqrt(s[-1]) + (1.0 if len(s) == 1 else 0)).astype(np.float32)
        for k, s in shapes.items()
    }
    x = data(B, T, h)
    with jax.set_mesh(cpu_mesh(4, dp=2)):
        layer = llama.LlamaLayer(CFG, rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(layer, nnx.Param)
        nnx.replace_by_pure_dict(state, llama.from_hf_layer(hf, CFG, tp=4))
        got = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, x)
    # the oracle on the Hugging Face matrices themselves (hf_layer takes the layer's packed tree)
    p = {
        "input_norm": {"scale": hf["input_layernorm.weight"]},
        "attn": {
            "qkv": {"kernel": np.concatenate([hf[f"self_attn.{n}_proj.weight"].T for n in "qkv"], axis=1)},
            "o": {"kernel": hf["self_attn.o_proj.weight"].T},
        },
        "mlp": {
            "norm": {"scale": hf["post_attention_layernorm.weight"]},
            "up": {"kernel": ubnn.pack_gated(hf["mlp.gate_proj.weight"].T, hf["mlp.up_proj.weight"].T)},
            "down": {"kernel": hf["mlp.down_proj.weight"].T},
        },
    }
    want = hf_layer(p, x, CFG, positions_for(0), 1)  # tp=1: the plain [q | k | v] concatenation
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"missing \['mlp.down_proj.weight'\]"):
        llama.from_hf_layer({k: v for k, v in hf.items() if k != "mlp.down_proj.weight"}, CFG, tp=4)


def test_batch_axes_reach_the_projections_and_the_attention(cpu_mesh):
    """LlamaConfig.batch_axes goes to every projection and to the attention's shard_map: with the
    default the batch is split over "dp", with None it stays whole on every device; the values are
    the same either way (a projection or the attention left on the other layout would re-shard or
    refuse)."""
    import dataclasses

    x = data(B, T, CFG.hidden)
    ys = {}
    with jax.set_mesh(cpu_mesh(4, dp=2)):
        for axes in ("auto", None):
            layer = llama.LlamaLayer(dataclasses.replace(CFG, batch_axes=axes), rngs=nnx.Rngs(0))
            graphdef, params = nnx.split(layer, nnx.Param)
            ys[axes] = jax.jit(lambda p, x, g=graphdef: nnx.merge(g, p)(x))(params, x)
            hlo = _hlo(lambda p, x, g=graphdef: nnx.merge(g, p)(x), params, x)
            assert "all-gather" in hlo  # the TP collectives are there either way
    assert ys["auto"].sharding.spec[0] in ("dp", ("dp",)), ys["auto"].sharding.spec
    assert ys[None].sharding.spec[0] is None, ys[None].sharding.spec
    np.testing.assert_allclose(np.asarray(ys["auto"]), np.asarray(ys[None]), rtol=1e-5, atol=1e-6)
