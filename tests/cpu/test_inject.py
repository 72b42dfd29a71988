"""``jax_ub.tp_dot_general``: Flax's dense layers given it as ``dot_general=`` compute what they
compute without it, values and gradients (random inputs, every element), on a MaxText-style mesh
``(data, fsdp, tensor)`` with ``"tensor"`` the TP axis; the entry point refuses what it cannot map.

On the host devices jax_ub's ops run their reference path; that they ran (an all-gather-matmul
for the column product, a matmul-reduce-scatter for the row product) is seen in
``jax_ub.summary()``.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub import _usage

TP = 4
RTOL = ATOL = 2e-5  # float32: the sums run in another order over the shards


@pytest.fixture(autouse=True)
def _fresh_usage():
    _usage.reset()
    yield
    _usage.reset()


def maxtext_mesh(data: int = 1, fsdp: int = 2, tensor: int = TP, types: AxisType = AxisType.Auto):
    return jax.make_mesh((data, fsdp, tensor), ("data", "fsdp", "tensor"), axis_types=(types,) * 3)


def rand(seed: int, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def close(got, want, rtol=RTOL, atol=ATOL):
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=rtol, atol=atol)


def spec(a) -> tuple:
    """``a``'s PartitionSpec, one entry per dim (jax drops trailing Nones)."""
    entries = tuple(a.sharding.spec)
    return entries + (None,) * (a.ndim - len(entries))


def ran(op: str) -> int:
    return sum(n for (o, path, _), n in jax_ub.summary().ops.items() if o == op and path == "reference")


def col(**kw):
    return jax_ub.tp_dot_general("column", axis="tensor", **kw)


def row(**kw):
    return jax_ub.tp_dot_general("row", axis="tensor", **kw)


# ------------------------------------------------------------------------------------------------
# Flax NNX


class NnxMLP(nnx.Module):
    def __init__(self, h: int, f: int, rngs: nnx.Rngs, up_dg=None, down_dg=None):
        kw_up = {} if up_dg is None else {"dot_general": up_dg}
        kw_down = {} if down_dg is None else {"dot_general": down_dg}
        init = nnx.initializers.normal(1.0)
        self.up = nnx.Linear(h, f, kernel_init=init, bias_init=init, rngs=rngs, **kw_up)
        self.down = nnx.Linear(f, h, kernel_init=init, bias_init=init, rngs=rngs, **kw_down)

    def __call__(self, x):
        return self.down(jnp.tanh(self.up(x)))


def _nnx_pair(h, f, **kw):
    """The same MLP (same parameters) without and with the injected dot_generals."""
    plain = NnxMLP(h, f, nnx.Rngs(0))
    tp = NnxMLP(h, f, nnx.Rngs(0), up_dg=col(**kw), down_dg=row(**kw))
    return plain, tp


def _nnx_value_and_grads(model, x, proj):
    def loss(m, x):
        return jnp.sum(m(x) * proj)

    @nnx.jit
    def run(m, x):
        y = m(x)
        gm, gx = nnx.grad(loss, argnums=(0, 1))(m, x)
        return y, nnx.state(gm, nnx.Param), gx

    return run(model, x)


@pytest.mark.parametrize("shape", [(1, 2), (2, 1)], ids=["fsdp2", "data2"])
def test_nnx_linear_values_and_grads(shape):
    mesh = maxtext_mesh(*shape)
    x, proj = rand(1, (4, 8, 16)), rand(2, (4, 8, 16))
    with jax.set_mesh(mesh):
        plain, tp = _nnx_pair(16, 32)
        want = _nnx_value_and_grads(plain, x, proj)
        got = _nnx_value_and_grads(tp, x, proj)
    close(got, want)
    # the ops ran: the forward's AG and RS, and their duals in the backward
    assert ran("ag") >= 2 and ran("rs") >= 2


def test_nnx_linear_output_sharding():
    """The column product's output is split over 'tensor' on its features, its batch over the
    other axes of size > 1; the row product's output over 'tensor' on the sequence."""
    mesh = maxtext_mesh(1, 2)
    x = rand(3, (4, 8, 16))
    with jax.set_mesh(mesh):
        _, tp = _nnx_pair(16, 32)
        h = jax.jit(lambda x: tp.up(x))(x)
        y = jax.jit(lambda h: tp.down(h))(h)
    assert spec(h) == ("fsdp", None, "tensor")
    assert spec(y) == ("fsdp", "tensor", None)


def test_nnx_linear_without_sequence_parallel():
    """A sequence that does not divide by TP (a decode step): the column product is a local GEMM,
    the row product a GEMM and a psum; same values and gradients."""
    mesh = maxtext_mesh(1, 2)
    x, proj = rand(4, (2, 3, 16)), rand(5, (2, 3, 16))
    with jax.set_mesh(mesh):
        plain, tp = _nnx_pair(16, 32, sequence_parallel=False)
        want = _nnx_value_and_grads(plain, x, proj)
        got = _nnx_value_and_grads(tp, x, proj)
    close(got, want)


def test_nnx_linear_general_heads():
    """nnx.LinearGeneral into heads (a rank-3 kernel, flattened) and out of them (two contracted
    dims), as an attention block's projections are."""
    mesh = maxtext_mesh(1, 2)
    x, proj = rand(6, (4, 8, 16)), rand(7, (4, 8, 16))
    init = nnx.initializers.normal(1.0)

    def build(dg_in, dg_out):
        kin = {} if dg_in is None else {"dot_general": dg_in}
        kout = {} if dg_out is None else {"dot_general": dg_out}
        q = nnx.LinearGeneral(16, (4, 8), kernel_init=init, bias_init=init, rngs=nnx.Rngs(0), **kin)
        o = nnx.LinearGeneral(
            (4, 8), 16, axis=(-2, -1), kernel_init=init, bias_init=init, rngs=nnx.Rngs(1), **kout
        )
        return q, o

    def run(q, o, x):
        def loss(q, o, x):
            return jnp.sum(o(jnp.tanh(q(x))) * proj)

        return nnx.jit(lambda q, o, x: (o(jnp.tanh(q(x))), nnx.grad(loss, argnums=(0, 1, 2))(q, o, x)))(
            q, o, x
        )

    with jax.set_mesh(mesh):
        want = run(*build(None, None), x)
        got = run(*build(col(), row()), x)
    close(got, want)
    assert ran("ag") >= 1 and ran("rs") >= 1


# ------------------------------------------------------------------------------------------------
# Flax linen


class LinenMLP(nn.Module):
    up_dg: object = None
    down_dg: object = None

    @nn.compact
    def __call__(self, x):
        kw_up = {} if self.up_dg is None else {"dot_general": self.up_dg}
        kw_down = {} if self.down_dg is None else {"dot_general": self.down_dg}
        init = nn.initializers.normal(1.0)
        h = nn.Dense(32, kernel_init=init, bias_init=init, name="up", **kw_up)(x)
        return nn.Dense(16, kernel_init=init, bias_init=init, name="down", **kw_down)(jnp.tanh(h))


class LinenAttn(nn.Module):
    """An attention block's value and output projections (rank-3 kernels)."""

    dg_in: object = None
    dg_out: object = None

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.normal(1.0)
        kin = {} if self.dg_in is None else {"dot_general": self.dg_in}
        kout = {} if self.dg_out is None else {"dot_general": self.dg_out}
        v = nn.DenseGeneral((4, 8), kernel_init=init, name="v", **kin)(x)
        return nn.DenseGeneral(16, axis=(-2, -1), kernel_init=init, name="o", **kout)(jnp.tanh(v))


def _linen_value_and_grads(model, params, x, proj):
    def loss(p, x):
        return jnp.sum(model.apply(p, x) * proj)

    return jax.jit(lambda p, x: (model.apply(p, x), jax.grad(loss, argnums=(0, 1))(p, x)))(params, x)


@pytest.mark.parametrize("seq_axis", [-2, 0], ids=["bsh", "sbh"])
def test_linen_dense_values_and_grads(seq_axis):
    mesh = maxtext_mesh(2, 1)
    x, proj = rand(8, (8, 4, 16)), rand(9, (8, 4, 16))
    plain = LinenMLP()
    tp = LinenMLP(col(seq_axis=seq_axis), row(seq_axis=seq_axis))
    params = plain.init(jax.random.key(10), x)
    with jax.set_mesh(mesh):
        want = _linen_value_and_grads(plain, params, x, proj)
        got = _linen_value_and_grads(tp, params, x, proj)
    close(got, want)
    assert ran("ag") >= 2 and ran("rs") >= 2


def test_linen_dense_general_and_mesh_argument():
    """nn.DenseGeneral with the mesh given as `mesh=` (no jax.set_mesh), called eagerly."""
    mesh = maxtext_mesh(1, 2)
    x, proj = rand(11, (4, 8, 16)), rand(12, (4, 8, 16))
    plain, tp = LinenAttn(), LinenAttn(col(mesh=mesh), row(mesh=mesh))
    params = plain.init(jax.random.key(13), x)

    def loss(m):
        return lambda p, x: jnp.sum(m.apply(p, x) * proj)

    close(tp.apply(params, x), plain.apply(params, x))
    close(jax.grad(loss(tp), argnums=(0, 1))(params, x), jax.grad(loss(plain), argnums=(0, 1))(params, x))


def test_explicit_mesh_dense_general():
    """nn.DenseGeneral into and out of heads on Explicit axes: the flattening reshapes of sharded
    dims go through."""
    mesh = maxtext_mesh(2, 1, types=AxisType.Explicit)
    x = rand(26, (4, 8, 16))
    plain, tp = LinenAttn(), LinenAttn(col(), row())
    params = plain.init(jax.random.key(27), x)

    def run(m, p, x):
        loss = lambda p, x: jnp.sum(jnp.sin(m.apply(p, x)))  # noqa: E731
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(p, x)

    with jax.set_mesh(mesh):
        xs = jax.device_put(x, P("data"))
        want, got = run(plain, params, xs), run(tp, params, xs)
    close(got[1], want[1])
    close(got[0], want[0], rtol=1e-5, atol=1e-4)  # a sum of 512 values


def test_explicit_mesh_keeps_the_batch_sharding():
    """On Explicit axes the activations' own sharding of their batch is kept."""
    mesh = maxtext_mesh(2, 1, types=AxisType.Explicit)
    x, proj = rand(14, (4, 8, 16)), rand(15, (4, 8, 16))
    plain, tp = LinenMLP(), LinenMLP(col(), row())
    params = plain.init(jax.random.key(16), x)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, P("data"))
        h = jax.jit(lambda x: nn.Dense(32, dot_general=col()).apply({"params": params["params"]["up"]}, x))(
            xs
        )
        assert spec(h) == ("data", None, "tensor")
        want = _linen_value_and_grads(plain, params, xs, proj)
        got = _linen_value_and_grads(tp, params, xs, proj)
    close(got, want)


# MaxText's logical names and rules (a subset): batch over (data, fsdp), the MLP dim over tensor,
# the embedding dim of the weights over fsdp (FSDP).
MAXTEXT_RULES = (
    ("activation_batch", ("data", "fsdp")),
    ("activation_length", None),
    ("activation_embed", None),
    ("activation_mlp", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
)


class MaxTextMLP(nn.Module):
    """MaxText's MLP block shape: DenseGeneral wi/wo with logically partitioned kernels and
    logical constraints on the activations; ``inject`` gives them jax_ub's dot_generals."""

    inject: bool = False

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.normal(1.0)
        up = {"dot_general": col()} if self.inject else {}
        down = {"dot_general": row()} if self.inject else {}
        x = nn.with_logical_constraint(x, ("activation_batch", "activation_length", "activation_embed"))
        h = nn.DenseGeneral(
            64, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")), name="wi", **up
        )(x)
        h = nn.with_logical_constraint(
            jax.nn.gelu(h), ("activation_batch", "activation_length", "activation_mlp")
        )
        y = nn.DenseGeneral(
            16, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")), name="wo", **down
        )(h)
        return nn.with_logical_constraint(y, ("activation_batch", "activation_length", "activation_embed"))


def test_maxtext_style_model():
    """A MaxText-style MLP on a (data, fsdp, tensor) mesh, its parameters placed by MaxText's rule
    names, with and without the injected dot_generals: same values and gradients."""
    mesh = maxtext_mesh(1, 2)
    x, proj = rand(30, (4, 8, 16)), rand(31, (4, 8, 16))
    plain, tp = MaxTextMLP(), MaxTextMLP(inject=True)
    boxed = plain.init(jax.random.key(32), x)
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, MAXTEXT_RULES)
    params = jax.device_put(nn.meta.unbox(boxed), nn.meta.unbox(shardings))
    assert spec(params["params"]["wi"]["kernel"]) == ("fsdp", "tensor")
    with jax.set_mesh(mesh), nn.logical_axis_rules(MAXTEXT_RULES):
        want = _linen_value_and_grads(plain, params, x, proj)
        got = _linen_value_and_grads(tp, params, x, proj)
    close(got, want)
    assert ran("ag") >= 2 and ran("rs") >= 2


def test_bfloat16_keeps_its_dtype():
    mesh = maxtext_mesh(1, 2)
    x = rand(17, (4, 8, 16), jnp.bfloat16)
    w = rand(18, (16, 32), jnp.bfloat16)
    with jax.set_mesh(mesh):
        y = jax.jit(lambda x, w: col()(x, w, (((2,), (0,)), ((), ()))))(x, w)
    assert y.dtype == jnp.bfloat16
    want = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
    np.testing.assert_allclose(np.asarray(y, np.float32), want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


def test_inside_a_shard_map_over_other_axes():
    """Called in a shard_map over 'data' only: the product maps the axes still free. (Values only:
    jax 0.10's own backward of a shard_map nested in one over other axes fails to lower, with
    plain lax.all_gather too: "operates on axis 'data' which is already bound".)"""
    mesh = maxtext_mesh(2, 1)
    x, w = rand(22, (4, 8, 16)), rand(23, (16, 32))
    for dg in (col(), col(sequence_parallel=False)):
        with jax.set_mesh(mesh):
            f = jax.shard_map(
                lambda x, w, dg=dg: dg(x, w, DN),
                in_specs=(P("data"), P()),
                out_specs=P("data"),
                axis_names={"data"},
            )
            got = jax.jit(f)(x, w)
        close(got, x @ w)
    assert ran("ag") >= 1


@pytest.mark.parametrize("kind", ["column", "row"])
def test_fp8_recipe_is_the_ops(kind):
    """With fp8=, the product and its gradients are those of jax_ub's op called with the recipe in
    the user's own shard_map (the quantized product, not the float32 dot)."""
    mesh = maxtext_mesh(2, 1)
    recipe = jax_ub.FP8Recipe()
    x, w = rand(24, (4, 8, 16)), rand(25, (16, 32))
    dg = jax_ub.tp_dot_general(kind, axis="tensor", fp8=recipe)
    if kind == "column":
        op = lambda x, w: jax_ub.all_gather_matmul(x, w, "tensor", gather_axis=1, fp8=recipe)  # noqa: E731
        specs = (P("data", "tensor"), P(None, "tensor")), P("data", None, "tensor")
    else:
        op = lambda x, w: jax_ub.matmul_reduce_scatter(  # noqa: E731
            x, w, "tensor", scatter_axis=1, fp8=recipe
        )
        specs = (P("data", None, "tensor"), P("tensor")), P("data", "tensor")
    with jax.set_mesh(mesh):
        direct = jax.shard_map(op, in_specs=specs[0], out_specs=specs[1])
        injected = lambda x, w: dg(x, w, DN)  # noqa: E731
        want, got = (jax.jit(fn)(x, w) for fn in (direct, injected))
        grads = [
            jax.jit(jax.grad(lambda x, w, fn=fn: jnp.sum(jnp.sin(fn(x, w))), argnums=(0, 1)))(x, w)
            for fn in (direct, injected)
        ]
    close(got, want, rtol=0, atol=0)
    close(grads[1], grads[0], rtol=0, atol=0)
    assert float(jnp.abs(got - x @ w).max()) > 0  # it is the FP8 product


# ------------------------------------------------------------------------------------------------
# Refusals

DN = (((2,), (0,)), ((), ()))


def _call(dg, x_shape, w_shape, dn=DN, mesh=None, **kw):
    x, w = rand(20, x_shape), rand(21, w_shape)
    with jax.set_mesh(mesh or maxtext_mesh(1, 2)):
        return dg(x, w, dn, **kw)


@pytest.mark.parametrize(
    ("dg", "x_shape", "w_shape", "dn", "match"),
    [
        (
            col(),
            (4, 8, 16),
            (4, 16, 32),
            (((2,), (1,)), ((0,), (0,))),
            r"no batch dims.*got batch dims lhs \(0,\), rhs \(0,\)",
        ),
        (col(), (4, 8, 16), (8, 32), (((1,), (0,)), ((), ())), r"contract the last dims.*got \(\(\(1,\)\)"),
        (col(), (4, 8, 16), (32, 16), (((2,), (1,)), ((), ())), r"first dims of the kernel.*rhs \(0,\)"),
        (row(), (4, 8, 4, 8), (8, 4, 16), (((3, 2), (0, 1)), ((), ())), r"in order.*got \(\(\(3, 2\)"),
        (col(), (4, 8, 16), (16,), (((2,), (0,)), ((), ())), r"leave kernel dims over"),
        (
            col(),
            (4, 8, 16),
            (16, 32),
            (((5,), (0,)), ((), ())),
            r"dims \(5,\) of lhs .* must be in \[-3, 3\)",
        ),
        (col(), (4, 6, 16), (16, 32), DN, r"the sequence .* must divide by the size 4 .*'tensor'; got 6"),
        (col(), (4, 8, 16), (16, 30), DN, r"output features .* must divide by the size 4.*got 30"),
        (row(), (4, 8, 30), (30, 16), DN, r"contracted features .* must divide by the size 4.*got 30"),
        (col(batch_axes="fsdp"), (3, 8, 16), (16, 32), DN, r"batch .* must divide by the size 2.*got 3"),
        (col(batch_axes="pipe"), (4, 8, 16), (16, 32), DN, r"names \['pipe'\], not free axes"),
        (jax_ub.tp_dot_general("column"), (4, 8, 16), (16, 32), DN, r"'tp' is not an axis.*'tensor'"),
        (col(), (8, 16), (16, 32), (((1,), (0,)), ((), ())), None),  # [tokens, h]: accepted
    ],
    ids=[
        "batch-dims",
        "contract-not-last",
        "kernel-transposed",
        "contract-out-of-order",
        "kernel-rank-1",
        "dim-out-of-range",
        "seq-not-divisible",
        "out-not-divisible",
        "in-not-divisible",
        "batch-not-divisible",
        "batch-axis-unknown",
        "tp-axis-missing",
        "tokens-accepted",
    ],
)
def test_refusals(dg, x_shape, w_shape, dn, match):
    if match is None:
        y = _call(dg, x_shape, w_shape, dn)
        want = np.asarray(rand(20, x_shape)) @ np.asarray(rand(21, w_shape))
        np.testing.assert_allclose(np.asarray(y), want, rtol=RTOL, atol=ATOL)
        return
    with pytest.raises(ValueError, match=match) as e:
        _call(dg, x_shape, w_shape, dn)
    assert "tp_dot_general" in str(e.value)


def test_refuses_without_a_mesh():
    with pytest.raises(ValueError, match=r"no mesh: pass `mesh=`.*jax.set_mesh"):
        col()(rand(0, (4, 8, 16)), rand(1, (16, 32)), DN)


def test_refuses_inside_shard_map_over_the_tp_axis():
    mesh = maxtext_mesh(1, 2)
    f = jax.shard_map(
        lambda x, w: col()(x, w, DN), mesh=mesh, in_specs=(P(None, "tensor"), P()), out_specs=P()
    )
    with pytest.raises(ValueError, match=r"already bound by an enclosing shard_map.*all_gather_matmul"):
        f(rand(0, (4, 8, 16)), rand(1, (16, 32)))


def test_refuses_other_dtypes_and_keywords():
    with pytest.raises(
        ValueError, match=r"preferred_element_type must be None or .* bfloat16 .*; got float32"
    ):
        x, w = rand(0, (4, 8, 16), jnp.bfloat16), rand(1, (16, 32), jnp.bfloat16)
        with jax.set_mesh(maxtext_mesh(1, 2)):
            col()(x, w, DN, preferred_element_type=jnp.float32)
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['bogus'\]"):
        _call(col(), (4, 8, 16), (16, 32), bogus=1)


@pytest.mark.parametrize(
    ("kw", "err", "match"),
    [
        ({"kind": "diag"}, ValueError, r"`kind` must be 'column' or 'row'; got 'diag'"),
        ({"axis": ("tensor",)}, TypeError, r"`axis` must be the name .*got \('tensor',\)"),
        ({"seq_axis": -1}, ValueError, r"`seq_axis` .*not -1.*got -1"),
        ({"batch_axes": "tensor", "axis": "tensor"}, ValueError, r"must not name the TP axis"),
        (
            {"fp8": jax_ub.FP8Recipe(), "sequence_parallel": False},
            ValueError,
            r"`fp8` needs sequence_parallel",
        ),
        ({"mesh": "mesh"}, TypeError, r"`mesh` must be a jax.sharding.Mesh.*got str"),
    ],
    ids=["kind", "axis", "seq-axis", "batch-tp", "fp8-no-sp", "mesh-type"],
)
def test_refuses_bad_options(kw, err, match):
    kw = {"kind": "column", **kw}
    with pytest.raises(err, match=match):
        jax_ub.tp_dot_general(kw.pop("kind"), **kw)
