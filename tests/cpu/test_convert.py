"""CPU tier: separate Hugging Face / MaxText matrices ↔ the layers' kernels (jax_ub.layers.convert).

Round trips are bit-exact (random data, every element); a QKV layer loaded with packed Hugging Face
matrices gives, every element, the separate q, k, v projections of those matrices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _layer_helpers import HIGHEST, data, on_cpu  # noqa: F401  (autouse fixture)
from flax import nnx

from jax_ub import linen as ubl
from jax_ub import nn as ubnn

HIDDEN, NQ, NKV, HD, FFN = 16, 8, 4, 4, 24


def rand(*shape, seed=0, dtype=jnp.float32):
    """Random normal NumPy data (on the host: no compilation per shape)."""
    return np.random.default_rng(seed).standard_normal(shape, np.float32).astype(dtype)


def hf_qkv(lead=(), dtype=jnp.float32):
    return (
        rand(*lead, NQ * HD, HIDDEN, seed=1, dtype=dtype),
        rand(*lead, NKV * HD, HIDDEN, seed=2, dtype=dtype),
        rand(*lead, NKV * HD, HIDDEN, seed=3, dtype=dtype),
    )


def maxtext_qkv(lead=()):
    return (
        rand(*lead, HIDDEN, NQ, HD, seed=4),
        rand(*lead, HIDDEN, NKV, HD, seed=5),
        rand(*lead, HIDDEN, NKV, HD, seed=6),
    )


def same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("lead", [(), (3,)], ids=["one", "stacked"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_qkv_round_trip_hf_is_bit_exact(tp, lead, dtype):
    q, k, v = hf_qkv(lead, dtype)
    kw = dict(num_heads=NQ, num_kv_heads=NKV, tp=tp, layout="hf")
    fused = ubnn.pack_qkv(q, k, v, **kw, bias=False)
    assert fused.shape == (*lead, HIDDEN, (NQ + 2 * NKV) * HD) and fused.dtype == dtype
    assert isinstance(fused, np.ndarray)  # NumPy in, NumPy out: converted on the host
    for a, b in zip(ubnn.unpack_qkv(fused, **kw), (q, k, v), strict=True):
        same(a, b)


@pytest.mark.parametrize("tp", [2, 4])
def test_qkv_round_trip_maxtext_and_biases(tp):
    q, k, v = (jnp.asarray(a) for a in maxtext_qkv((2,)))  # jax arrays: the jax.numpy path
    kw = dict(num_heads=NQ, num_kv_heads=NKV, tp=tp)
    fused = ubl.pack_qkv(q, k, v, layout="maxtext", bias=False, **kw)
    for a, b in zip(ubl.unpack_qkv(fused, layout="maxtext", **kw), (q, k, v), strict=True):
        same(a, b)
    # the same heads through the hf layout pack to the same kernel
    assert isinstance(fused, jax.Array)
    hf = [np.swapaxes(np.asarray(a).reshape(*a.shape[:-2], -1), -1, -2) for a in (q, k, v)]
    same(ubnn.pack_qkv(*hf, layout="hf", bias=False, **kw), fused)
    # biases: hf [heads * head_dim], maxtext [heads, head_dim]
    bq, bk, bv = rand(NQ * HD, seed=7), rand(NKV * HD, seed=8), rand(NKV * HD, seed=9)
    fb = ubnn.pack_qkv(bq, bk, bv, layout="hf", **kw)
    assert fb.shape == ((NQ + 2 * NKV) * HD,)
    for a, b in zip(ubnn.unpack_qkv(fb, layout="hf", bias=True, **kw), (bq, bk, bv), strict=True):
        same(a, b)
    mb = [a.reshape(-1, HD) for a in (bq, bk, bv)]
    same(ubnn.pack_qkv(*mb, layout="maxtext", **kw), fb)
    for a, b in zip(ubnn.unpack_qkv(fb, layout="maxtext", bias=True, **kw), mb, strict=True):
        same(a, b)


def test_qkv_layout_depends_on_tp_as_documented():
    """Device r's column block is [its q heads | its k heads | its v heads]: for tp=2, q head 0..3,
    kv heads 0..1 first, then the rest."""
    q, k, v = (np.swapaxes(a, 0, 1) for a in hf_qkv())  # plain kernels [hidden, heads * hd]
    fused = np.asarray(ubnn.pack_qkv(q, k, v, num_heads=NQ, num_kv_heads=NKV, tp=2, layout="kernel"))
    nq, nkv = NQ // 2 * HD, NKV // 2 * HD
    want = np.concatenate([q[:, :nq], k[:, :nkv], v[:, :nkv], q[:, nq:], k[:, nkv:], v[:, nkv:]], axis=1)
    np.testing.assert_array_equal(fused, want)
    np.testing.assert_array_equal(
        np.asarray(ubnn.pack_qkv(q, k, v, num_heads=NQ, num_kv_heads=NKV, tp=1, layout="kernel")),
        np.concatenate([q, k, v], axis=1),
    )


@pytest.mark.parametrize("layout", ["hf", "maxtext", "kernel"])
def test_mlp_and_out_round_trips_are_bit_exact(layout):
    if layout == "hf":
        gate, up, down = (
            rand(2, FFN, HIDDEN, seed=1),
            rand(2, FFN, HIDDEN, seed=2),
            rand(2, HIDDEN, FFN, seed=3),
        )
        o = rand(2, HIDDEN, NQ * HD, seed=4)
    else:
        gate, up, down = (
            rand(2, HIDDEN, FFN, seed=1),
            rand(2, HIDDEN, FFN, seed=2),
            rand(2, FFN, HIDDEN, seed=3),
        )
        o = rand(2, NQ, HD, HIDDEN, seed=4) if layout == "maxtext" else rand(2, NQ * HD, HIDDEN, seed=4)
    up_k, down_k = ubnn.pack_mlp(gate, up, down, layout=layout)
    assert up_k.shape == (2, HIDDEN, 2 * FFN) and down_k.shape == (2, FFN, HIDDEN)
    g, u, d = ubnn.unpack_mlp(up_k, down_k, layout=layout)
    same(g, gate), same(u, up), same(d, down)
    # interleaved: unit j's gate at column 2j, its linear part at 2j + 1
    plain_gate = np.swapaxes(gate, -1, -2) if layout == "hf" else gate
    np.testing.assert_array_equal(np.asarray(up_k)[..., 0::2], plain_gate)
    ok = ubnn.pack_out(o, layout=layout)
    assert ok.shape == (2, NQ * HD, HIDDEN)
    same(ubnn.unpack_out(ok, layout=layout, head_dim=HD), o)


def test_packed_hf_qkv_layer_equals_separate_projections(cpu_mesh):
    """HF q_proj, k_proj, v_proj packed for tp=4 and loaded into the layer: its q, k, v are
    ``x @ W.T`` of each matrix, every element."""
    q, k, v = hf_qkv()
    fused = ubnn.pack_qkv(q, k, v, num_heads=NQ, num_kv_heads=NKV, tp=4)
    x = data(2, 8, HIDDEN)
    with jax.set_mesh(cpu_mesh(4, dp=2)):
        layer = ubnn.QKVParallelDense(HIDDEN, NQ, NKV, HD, precision=HIGHEST, rngs=nnx.Rngs(0))
        layer.kernel[...] = jax.device_put(fused, layer.kernel[...].sharding)
        got = nnx.jit(lambda m, x: m(x))(layer, x)
    for g, w, n in zip(got, (q, k, v), (NQ, NKV, NKV), strict=True):
        want = jnp.einsum("bsh,oh->bso", x, w, precision=HIGHEST).reshape(2, 8, n, HD)
        np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "call, fragment",
    [
        (
            lambda: ubnn.pack_qkv(*hf_qkv(), num_heads=NQ, num_kv_heads=NKV, tp=4, layout="torch"),
            "`layout` must be",
        ),
        (
            lambda: ubnn.pack_qkv(*hf_qkv(), num_heads=NQ, num_kv_heads=2, tp=4),
            "`num_kv_heads` must be divisible by the size of mesh axis 'tp' (4)",
        ),
        (
            lambda: ubnn.pack_qkv(
                hf_qkv()[0], hf_qkv()[0], hf_qkv()[2], num_heads=NQ, num_kv_heads=NKV, tp=2
            ),
            "`k` must hold num_kv_heads (4) heads of head_dim 4",
        ),
        (
            lambda: ubnn.unpack_qkv(np.zeros((HIDDEN, 33)), num_heads=NQ, num_kv_heads=NKV, tp=2),
            "must be (num_heads + 2 * num_kv_heads) = 16 times head_dim",
        ),
        (
            lambda: ubnn.pack_mlp(rand(FFN, HIDDEN), rand(FFN + 1, HIDDEN)),
            "`gate` and `up` must have the same shape",
        ),
        (lambda: ubnn.unpack_out(rand(NQ * HD, HIDDEN), layout="maxtext", head_dim=5), "needs `head_dim`"),
    ],
)
def test_bad_arguments_name_what_was_expected(call, fragment):
    with pytest.raises(ValueError) as e:
        call()
    assert fragment in str(e.value)
