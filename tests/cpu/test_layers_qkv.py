"""CPU tier: the fused QKV layer of grouped-query attention (NNX and linen), and ``fp8=`` on the
layers.

The layer's q, k, v (and gradients) are compared, every element, with separate q, k, v
projections computed in float32 from the matrices :func:`jax_ub.nn.unpack_qkv` takes out of its
kernel; the FP8 layers with an oracle that quantizes with current scaling itself.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _layer_helpers import (
    HIGHEST,
    NORMAL,
    assert_close,
    data,
    on_cpu,  # noqa: F401  (autouse fixture)
    value_and_grads,
)
from flax import nnx
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub import linen as ubl
from jax_ub import nn as ubnn
from jax_ub.layers import qkv as qkv_core

B, S, H = 2, 8, 16
HEADS = [(8, 4, 4), (4, 4, 6), (8, 8, 2)]  # (num_heads, num_kv_heads, head_dim): GQA, MHA


def separate(x, kernel, bias, nq, nkv, tp):
    """The oracle: q, k, v projections from the unpacked matrices, `[b, s, heads, head_dim]`."""
    q, k, v = ubnn.unpack_qkv(kernel, num_heads=nq, num_kv_heads=nkv, tp=tp, layout="kernel")
    out = []
    for w, n, part in zip((q, k, v), (nq, nkv, nkv), range(3), strict=True):
        y = jnp.dot(x, w, precision=HIGHEST)
        if bias is not None:
            y = (
                y
                + ubnn.unpack_qkv(bias, num_heads=nq, num_kv_heads=nkv, tp=tp, layout="kernel", bias=True)[
                    part
                ]
            )
        out.append(y.reshape(*y.shape[:-1], n, -1))
    return tuple(out)


def cotangents(nq, nkv, hd):
    return (data(B, S, nq, hd, seed=3), data(B, S, nkv, hd, seed=4), data(B, S, nkv, hd, seed=5))


def loss_parts(fn):
    """fn(params, x) → (q, k, v) as one array, so the helpers' value_and_grads can take it."""
    return lambda p, x: jnp.concatenate([t.reshape(*t.shape[:2], -1) for t in fn(p, x)], axis=-1)


def flat_ct(ct):
    return jnp.concatenate([t.reshape(*t.shape[:2], -1) for t in ct], axis=-1)


@pytest.mark.parametrize(
    "heads, use_bias",
    [(HEADS[0], False), (HEADS[1], True), (HEADS[2], False)],
    ids=["gqa", "mha-bias", "gqa-hd2"],
)
def test_nnx_qkv_equals_separate_projections(cpu_mesh, heads, use_bias):
    nq, nkv, hd = heads
    mesh = cpu_mesh(4, dp=2)
    x = data(B, S, H)
    ct = flat_ct(cotangents(nq, nkv, hd))
    with jax.set_mesh(mesh):
        layer = ubnn.QKVParallelDense(
            H, nq, nkv, hd, use_bias=use_bias, bias_init=NORMAL, precision=HIGHEST, rngs=nnx.Rngs(0)
        )
        q, k, v = nnx.jit(lambda m, x: m(x))(layer, x)
        assert (q.shape, k.shape, v.shape) == ((B, S, nq, hd), (B, S, nkv, hd), (B, S, nkv, hd))
        assert q.sharding.spec == P("dp", None, "tp") and k.sharding.spec == P("dp", None, "tp")
        spec = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(layer, nnx.Param)))
        assert spec["kernel"] == P(None, "tp")
        graphdef, params = nnx.split(layer, nnx.Param)
        params = nnx.to_pure_dict(params)
        fn = loss_parts(lambda p, x: nnx.merge(graphdef, p)(x))
        got, got_g = value_and_grads(fn, params, x, ct)
    whole = jax.device_get(params)
    want_fn = loss_parts(lambda p, x: separate(x, p["kernel"], p.get("bias"), nq, nkv, 4))
    want, want_g = value_and_grads(want_fn, whole, x, ct)
    assert_close(got, want)
    assert_close(got_g, want_g)
    # the per-device layout: device r's column block is [its q heads | its k heads | its v heads]
    kernel = np.asarray(whole["kernel"])
    qm, km, vm = (
        np.asarray(a) for a in ubnn.unpack_qkv(kernel, num_heads=nq, num_kv_heads=nkv, tp=4, layout="kernel")
    )
    block = kernel.shape[1] // 4
    r = 2
    local = kernel[:, r * block : (r + 1) * block]
    nql, nkl = nq // 4 * hd, nkv // 4 * hd
    np.testing.assert_array_equal(local[:, :nql], qm[:, r * nql : (r + 1) * nql])
    np.testing.assert_array_equal(local[:, nql : nql + nkl], km[:, r * nkl : (r + 1) * nkl])
    np.testing.assert_array_equal(local[:, nql + nkl :], vm[:, r * nkl : (r + 1) * nkl])


def test_linen_qkv_equals_separate_projections(cpu_mesh):
    nq, nkv, hd = HEADS[0]
    mesh = cpu_mesh(4, dp=2)
    x = data(B, S, H)
    ct = flat_ct(cotangents(nq, nkv, hd))
    model = ubl.QKVParallelDense(nq, nkv, hd, use_bias=True, bias_init=NORMAL, precision=HIGHEST)
    with jax.set_mesh(mesh):
        params = nn.unbox(jax.jit(model.init)(jax.random.key(0), x))["params"]
        assert params["kernel"].sharding.spec == P(None, "tp")
        fn = loss_parts(lambda p, x: model.apply({"params": p}, x))
        got, got_g = value_and_grads(fn, params, x, ct)
    whole = jax.device_get(params)
    want, want_g = value_and_grads(
        loss_parts(lambda p, x: separate(x, p["kernel"], p["bias"], nq, nkv, 4)), whole, x, ct
    )
    assert_close(got, want)
    assert_close(got_g, want_g)


def test_qkv_local_mode_inside_shard_map(cpu_mesh):
    """Inside the user's shard_map: local x `[b, s/tp, h]` → this device's heads."""
    nq, nkv, hd = HEADS[0]
    mesh = cpu_mesh(4)
    x = data(B, S, H)
    kernel = data(H, (nq + 2 * nkv) * hd, seed=7)
    layer_fn = lambda x, k: qkv_core.qkv_parallel_dense(  # noqa: E731
        x, k, None, num_heads=nq, num_kv_heads=nkv, head_dim=hd, precision=HIGHEST
    )
    spec = P(None, None, "tp")
    f = jax.jit(
        jax.shard_map(layer_fn, mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp")), out_specs=(spec,) * 3)
    )
    got = f(x, kernel)
    want = separate(x, kernel, None, nq, nkv, 4)
    assert_close(got, want)


@pytest.mark.parametrize(
    "nq, nkv, fragment",
    [
        (8, 2, "`num_kv_heads` must be divisible by the size of mesh axis 'tp' (4)"),
        (6, 6, "`num_heads` must be divisible by the size of mesh axis 'tp' (4)"),
        (8, 3, "`num_heads` must be a multiple of `num_kv_heads`"),
    ],
)
def test_heads_that_do_not_split_are_refused(cpu_mesh, nq, nkv, fragment):
    with jax.set_mesh(cpu_mesh(4)), pytest.raises(ValueError) as e:
        ubnn.QKVParallelDense(H, nq, nkv, 4, rngs=nnx.Rngs(0))
    assert fragment in str(e.value) and "QKVParallelDense" in str(e.value)
    with jax.set_mesh(cpu_mesh(4)), pytest.raises(ValueError) as e:
        ubl.QKVParallelDense(nq, nkv, 4).init(jax.random.key(0), data(B, S, H))
    assert fragment in str(e.value)


# --------------------------------------------------------------------------------------------------
# fp8= on the layers


def _fp8_round(t, axis_blocks=None):
    """``t`` quantized to e4m3 with current scaling and dequantized (float32), per block of columns
    (the kernel's per-device shards) where ``axis_blocks`` is given."""
    t = np.asarray(t, np.float32)
    if axis_blocks is not None:
        return np.concatenate([_fp8_round(b) for b in np.split(t, axis_blocks, axis=-1)], axis=-1)
    scale = max(np.abs(t).max() / float(jnp.finfo(jnp.float8_e4m3fn).max), np.finfo(np.float32).tiny)
    q = np.asarray(jnp.asarray(np.clip(t / scale, -448, 448)).astype(jnp.float8_e4m3fn))
    return q.astype(np.float32) * np.float32(scale)


@pytest.mark.parametrize("framework", ["nnx", "linen"])
def test_fp8_column_and_qkv_layers_quantize_with_current_scaling(cpu_mesh, framework):
    """x quantized with one scale over the TP axis (its amax over every shard), each device's kernel
    columns with their own: the layers' outputs equal that oracle, and differ from the high-precision
    ones by an FP8-sized error."""
    nq, nkv, hd = HEADS[0]
    mesh = cpu_mesh(4)
    x = data(B, S, H)
    recipe = jax_ub.FP8Recipe()
    with jax.set_mesh(mesh):
        if framework == "nnx":
            col = ubnn.ColumnParallelDense(H, 32, use_bias=False, fp8=recipe, rngs=nnx.Rngs(0))
            qkv = ubnn.QKVParallelDense(H, nq, nkv, hd, fp8=recipe, rngs=nnx.Rngs(1))
            y = nnx.jit(lambda m, x: m(x))(col, x)
            q, k, v = nnx.jit(lambda m, x: m(x))(qkv, x)
            ck, qk = col.kernel[...], qkv.kernel[...]
        else:
            cm = ubl.ColumnParallelDense(32, use_bias=False, fp8=recipe)
            qm = ubl.QKVParallelDense(nq, nkv, hd, fp8=recipe)
            cp = nn.unbox(jax.jit(cm.init)(jax.random.key(0), x))
            qp = nn.unbox(jax.jit(qm.init)(jax.random.key(1), x))
            y = jax.jit(cm.apply)(cp, x)
            q, k, v = jax.jit(qm.apply)(qp, x)
            ck, qk = cp["params"]["kernel"], qp["params"]["kernel"]
    xq = _fp8_round(x)
    want_y = np.dot(xq, _fp8_round(ck, 4))
    np.testing.assert_allclose(np.asarray(y), want_y, rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(y) - np.dot(np.asarray(x), np.asarray(ck))).max() > 1e-3  # FP8 ran
    fused = np.dot(xq, _fp8_round(qk, 4))  # [b, s, features] in the per-device order
    qs, ks, vs = ubnn.unpack_qkv(jnp.asarray(fused), num_heads=nq, num_kv_heads=nkv, tp=4, layout="kernel")
    for got, w, n in ((q, qs, nq), (k, ks, nkv), (v, vs, nkv)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(w).reshape(B, S, n, hd), rtol=1e-5, atol=1e-5)


def test_fp8_mlp_forwards_the_recipe_to_both_projections(cpu_mesh):
    """A ParallelMLP with ``fp8=`` equals the same MLP whose two projections are called through the
    ops with ``fp8=`` by hand (gradients too)."""
    mesh = cpu_mesh(4)
    x, ct = data(B, S, H), data(B, S, H, seed=2)
    recipe = jax_ub.FP8Recipe()
    with jax.set_mesh(mesh):
        mlp = ubnn.ParallelMLP(H, 32, fp8=recipe, norm=None, use_bias=False, rngs=nnx.Rngs(0))
        graphdef, params = nnx.split(mlp, nnx.Param)
        params = nnx.to_pure_dict(params)
        got, got_g = value_and_grads(lambda p, x: nnx.merge(graphdef, p)(x), params, x, ct)

        def by_hand(p, x):
            def body(x, w1, w2):
                h = jax_ub.all_gather_matmul(x, w1, "tp", gather_axis=1, fp8=recipe)
                return jax_ub.matmul_reduce_scatter(jax.nn.gelu(h), w2, "tp", scatter_axis=1, fp8=recipe)

            return jax.shard_map(
                body, in_specs=(P(None, "tp"), P(None, "tp"), P("tp", None)), out_specs=P(None, "tp")
            )(x, p["up"]["kernel"], p["down"]["kernel"])

        want, want_g = value_and_grads(by_hand, params, x, ct)
    assert_close(got, want, rtol=0, atol=0)
    assert_close(got_g, want_g, rtol=0, atol=0)
