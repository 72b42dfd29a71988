"""``jax_ub.overlap_tp``: a function whose shard_map body all-gathers then multiplies, or multiplies
then psum-scatters, gets jax_ub's ops at those sites, with the values and gradients of the original
(random inputs, every element compared), and a report of what was replaced and left alone, and why.

On the host devices jax_ub's ops run their reference path; that they ran is seen in the rewritten
jaxpr (the checkpoint names jax_ub gives its outputs) and in ``jax_ub.summary()``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub import _usage

TP = 4


@pytest.fixture(autouse=True)
def _fresh_usage():
    _usage.reset()
    yield
    _usage.reset()


def rand(seed: int, *shapes, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return [jax.random.normal(k, s, jnp.float32).astype(dtype) for k, s in zip(keys, shapes, strict=True)]


def assert_same(f, g, args, *, rtol=1e-6, atol=1e-6, grad=True):
    """Values, and gradients of a random projection w.r.t. every argument, agree."""
    want, got = f(*args), g(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=rtol, atol=atol)
    if not grad:
        return
    proj = [jax.random.normal(jax.random.key(99 + i), o.shape) for i, o in enumerate(jax.tree.leaves(want))]

    def loss(fn):
        return lambda *a: sum(
            (o.astype(jnp.float32) * p).sum() for o, p in zip(jax.tree.leaves(fn(*a)), proj, strict=True)
        )

    argnums = tuple(range(len(args)))
    grads = [jax.jit(jax.grad(loss(fn), argnums))(*args) for fn in (g, f)]
    for a, b in zip(*grads, strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=rtol, atol=atol)


def jaxpr_text(fn, *args) -> str:
    return str(jax.make_jaxpr(fn)(*args))


def smap(mesh, body, in_specs, out_specs, **kw):
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **kw))


# ------------------------------------------------------------------------------------------------
# Replaced


def _mlp_body(x, w1, w2):
    """Sequence-parallel MLP: einsum form in, matmul form out."""
    h = jnp.einsum("bsh,hf->bsf", lax.all_gather(x, "tp", axis=1, tiled=True), w1)
    return lax.psum_scatter(jax.nn.gelu(h) @ w2, "tp", scatter_dimension=1, tiled=True)


def test_mlp_replaced_same_values_and_gradients(cpu_mesh):
    mesh = cpu_mesh(TP)
    f = smap(mesh, _mlp_body, (P(None, "tp"), P(None, "tp"), P("tp")), P(None, "tp"))
    x, w1, w2 = rand(0, (2, 8, 16), (16, 32), (32, 16))
    g = jax_ub.overlap_tp(f)
    assert_same(f, g, (x, w1, w2))
    r = g.report(x, w1, w2)
    assert [(s.op, s.axis_name, s.why) for s in r.replaced] == [
        ("ag", "tp", "all_gather_matmul(gather_axis=1)"),
        ("rs", "tp", "matmul_reduce_scatter(scatter_axis=1)"),
    ]
    assert r.left_alone == [] and g.last_report is r
    assert r.replaced[0].shapes == "x float32[2,2,16] @ w float32[16,8]"
    assert r.replaced[0].where == "jit > shard_map" and "test_overlap_tp.py" in r.replaced[0].source
    text = jaxpr_text(g, x, w1, w2)
    assert (
        "jax_ub_ag_out" in text
        and "jax_ub_rs_out" in text
        and "jax_ub_ag_out" not in jaxpr_text(f, x, w1, w2)
    )
    assert str(r).splitlines()[0] == "overlap_tp: 2 replaced, 0 left alone"
    # The forward traced its two ops (and grad's trace them again, with their duals).
    assert jax_ub.summary().ops[("ag", "reference", "xla")] >= 1


def test_dot_general_with_transposed_weight_and_bf16(cpu_mesh):
    """lax.dot_general contracting the weight's dim 1 (a [n, k] weight), in bfloat16."""
    mesh = cpu_mesh(TP)

    def body(x, wt):
        g = lax.all_gather(x, "tp", axis=0, tiled=True)
        return lax.dot_general(g, wt, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16)

    f = smap(mesh, body, (P("tp"), P("tp")), P(None, "tp"))
    x, wt = rand(1, (16, 12), (8, 12), dtype=jnp.bfloat16)
    g = jax_ub.overlap_tp(f)
    assert_same(f, g, (x, wt), rtol=2e-2, atol=2e-2)
    (site,) = g.report(x, wt).replaced
    assert site.shapes == "x bfloat16[4,12] @ w bfloat16[2,12]ᵀ"


def test_scan_and_checkpoint_bodies(cpu_mesh):
    """Layers stacked with lax.scan under jax.checkpoint, inside the shard_map."""
    mesh = cpu_mesh(TP)

    def body(x, w1s, w2s):
        @jax.checkpoint
        def layer(x, ws):
            w1, w2 = ws
            h = lax.all_gather(x, "tp", axis=0, tiled=True) @ w1
            return x + lax.psum_scatter(jnp.tanh(h) @ w2, "tp", scatter_dimension=0, tiled=True), None

        return lax.scan(layer, x, (w1s, w2s))[0]

    f = smap(mesh, body, (P("tp"), P(None, None, "tp"), P(None, "tp")), P("tp"))
    x, w1s, w2s = rand(2, (16, 8), (3, 8, 24), (3, 24, 8))
    g = jax_ub.overlap_tp(f)
    assert_same(f, g, (x, w1s, w2s), rtol=1e-5, atol=1e-5)
    r = g.report(x, w1s, w2s)
    assert [s.op for s in r.replaced] == ["ag", "rs"] and not r.left_alone
    # jax.checkpoint's primitive: remat2 in jax 0.10, checkpoint in others
    assert r.replaced[0].where.rsplit(" > ", 1)[0] == "jit > shard_map > scan"


def test_report_from_shapes_and_under_jit(cpu_mesh):
    mesh = cpu_mesh(TP)
    f = jax.shard_map(
        _mlp_body, mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp"), P("tp")), out_specs=P(None, "tp")
    )
    g = jax_ub.overlap_tp(f)
    x, w1, w2 = rand(3, (2, 8, 16), (16, 32), (32, 16))
    r = g.report(*(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, w1, w2)))
    assert len(r.replaced) == 2 and r.replaced[0].where == "shard_map"
    assert_same(f, jax.jit(g), (x, w1, w2), rtol=1e-4, atol=1e-4, grad=False)  # f runs eagerly


# ------------------------------------------------------------------------------------------------
# Left alone, with the reason; the values stay the original's


def _left_alone(mesh, body, in_specs, out_specs, args, **kw):
    f = smap(mesh, body, in_specs, out_specs, **kw)
    g = jax_ub.overlap_tp(f)
    assert_same(f, g, args, rtol=1e-5, atol=1e-5, grad=False)  # bound as traced: the same gradients
    return g.report(*args)


def test_gather_not_tiled(cpu_mesh):
    def body(x, w):
        g = lax.all_gather(x, "tp", axis=0, tiled=False)  # [tp, m, k]
        return g.reshape(-1, g.shape[-1]) @ w

    r = _left_alone(cpu_mesh(TP), body, (P("tp"), P(None, "tp")), P(None, "tp"), rand(4, (16, 8), (8, 12)))
    (s,) = r.left_alone
    assert not r.replaced and s.op == "ag" and "not tiled" in s.why


def test_gathered_value_used_elsewhere(cpu_mesh):
    def body(x, w):
        g = lax.all_gather(x, "tp", axis=0, tiled=True)
        return g @ w, jnp.sin(g)

    r = _left_alone(
        cpu_mesh(TP),
        body,
        (P("tp"), P(None, "tp")),
        (P(None, "tp"), P()),
        rand(5, (16, 8), (8, 12)),
        check_vma=False,
    )
    (s,) = r.left_alone
    assert "has 2 uses" in s.why


def test_contraction_over_the_gathered_dim(cpu_mesh):
    def body(x, w):
        return lax.all_gather(x, "tp", axis=1, tiled=True) @ w

    r = _left_alone(cpu_mesh(TP), body, (P(None, "tp"), P()), P(), rand(6, (8, 16), (16, 5)), check_vma=False)
    (s,) = r.left_alone
    assert "gathers the last dim" in s.why


def test_weight_not_2d_and_batch_dims(cpu_mesh):
    def body(x, w3, wb):
        g = lax.all_gather(x, "tp", axis=1, tiled=True)  # [b, s, h]
        y = jnp.einsum("bsh,hkd->bskd", g, w3)
        g2 = lax.all_gather(x, "tp", axis=1, tiled=True)
        z = jnp.einsum("bsh,bhf->bsf", g2, wb)  # a batched dot
        return y, z

    r = _left_alone(
        cpu_mesh(TP),
        body,
        (P(None, "tp"), P(None, None, "tp"), P()),
        (P(None, None, None, "tp"), P()),
        rand(7, (2, 8, 6), (6, 3, 8), (2, 6, 5)),
        check_vma=False,
    )
    whys = sorted(s.why for s in r.left_alone)
    assert len(whys) == 2 and not r.replaced
    assert "batch dimensions" in whys[0] and "not 2-D (float32[6,3,2])" in whys[1]


def test_scatter_cases(cpu_mesh):
    """A scatter of something other than a dot, and of the weight's output dim."""

    def body(x, w):
        a = lax.psum_scatter(x * 2.0, "tp", scatter_dimension=0, tiled=True)
        b = lax.psum_scatter(x @ w, "tp", scatter_dimension=1, tiled=True)
        return a, b

    r = _left_alone(
        cpu_mesh(TP),
        body,
        (P(None, "tp"), P("tp")),
        (P("tp"), P(None, "tp")),
        rand(8, (8, 16), (16, 8)),
    )
    whys = [s.why for s in r.left_alone]
    assert any("scatters mul" in w for w in whys) and any("output dim (columns)" in w for w in whys)


def test_inside_cond_and_weight_gather_and_two_axes(cpu_mesh):
    mesh = cpu_mesh(TP, dp=2)

    def body(p, x, w):
        y = lax.cond(
            p[0] > 0, lambda: lax.all_gather(x, "tp", axis=0, tiled=True) @ w, lambda: jnp.zeros((16, 3))
        )
        # a weight gather (FSDP's): the gathered value is the dot's right operand
        fsdp = lax.dot_general(x, lax.all_gather(w.T, "tp", axis=0, tiled=True), (((1,), (1,)), ((), ())))
        both = lax.all_gather(x, ("dp", "tp"), axis=0, tiled=True) @ w
        return y, fsdp, both

    p = jnp.ones((2,))
    x, w = rand(9, (32, 6), (6, 3))
    r = _left_alone(mesh, body, (P(), P(("dp", "tp")), P()), (P(), P(), P()), (p, x, w), check_vma=False)
    whys = {s.why for s in r.left_alone}
    assert not r.replaced and len(whys) == 3, whys
    assert "inside cond, which overlap_tp does not rewrite" in whys
    assert any("right-hand operand" in w for w in whys)
    assert any("spans several mesh axes" in w for w in whys)


def test_not_a_function():
    with pytest.raises(TypeError, match="overlap_tp: f must be a function"):
        jax_ub.overlap_tp(3)
