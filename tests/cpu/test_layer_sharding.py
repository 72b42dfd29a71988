"""The mesh axes the TP layers keep on the batch of their activations (``batch_axes``).

On a ``(data, stage, tp)`` mesh (a pipeline axis the layers must not split the batch over) and a
MaxText ``(data, fsdp, tensor)`` mesh (MaxText's ``activation_batch`` name through the logical
axis rules), the layers' outputs keep the caller's axes, and their values and gradients equal the
plain float32 computation on random inputs, every element. The default (``"auto"``) splits the
batch over every other axis as before, or keeps the axes x comes sharded with where that is known;
an x whose known layout differs from the layer's is refused, not re-sharded; every invalid option
is refused with a message. 8 host devices.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _layer_helpers import (
    HIGHEST,
    IN,
    NORMAL,
    OUT,
    PLAIN,
    B,
    S,
    assert_close,
    data,
    nnx_fn,
    nnx_layer,
    on_cpu,  # noqa: F401  (autouse fixture)
    pure,
    value_and_grads,
)
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_ub import linen as ubl
from jax_ub import nn as ubnn

# MaxText's name for the batch of the activations, with the names the layers' parameters take.
RULES = (("activation_batch", ("data", "fsdp")), ("embed", "fsdp"), ("mlp", "tensor"))


def mesh_of(explicit=False, **sizes) -> Mesh:
    devices = np.array(jax.devices("cpu")[: int(np.prod(list(sizes.values())))])
    kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
    return Mesh(devices.reshape(tuple(sizes.values())), tuple(sizes), axis_types=(kind,) * len(sizes))


def stage_mesh(explicit=False):
    return mesh_of(explicit, data=2, stage=2, tp=2)


def maxtext_mesh():
    return mesh_of(data=2, fsdp=2, tensor=2)


def out_spec(kind, batch, tp):
    """The global output layout: the column layer's features split over ``tp``, the others' sequence."""
    return P(batch, None, tp) if kind == "column" else P(batch, tp, None)


def spec(y):
    """``y``'s global layout, one entry per dim (jax drops trailing Nones)."""
    entries = tuple(y.sharding.spec)
    return P(*entries, *(None,) * (y.ndim - len(entries)))


def linen_layer(kind, **kw):
    return {
        "column": lambda: ubl.ColumnParallelDense(OUT["column"], **kw),
        "row": lambda: ubl.RowParallelDense(OUT["row"], **kw),
        "mlp": lambda: ubl.ParallelMLP(IN["mlp"] * 2, **kw),
    }[kind]()


def plain(kind):
    return PLAIN[kind]


def run(framework, kind, mesh, tp, x, rules=(), **kw):
    """The layer's output and gradients (w.r.t. parameters and x) under ``mesh`` and ``rules``,
    and the same of the plain computation on its parameters."""
    ct = data(*x.shape[:-1], OUT[kind], seed=3)
    kw = dict(axis_name=tp, precision=HIGHEST, bias_init=NORMAL, **kw)
    if kind == "mlp":
        kw["ffn_features"] = IN["mlp"] * 2
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        if framework == "nnx":
            if kind == "mlp":
                kw.pop("ffn_features")
                module = ubnn.ParallelMLP(IN["mlp"], IN["mlp"] * 2, rngs=nnx.Rngs(0), **kw)
            else:
                module = nnx_layer(kind, **kw)
            params, fn = pure(module), nnx_fn(module)
        else:
            if kind == "mlp":
                kw.pop("ffn_features")
            model = linen_layer(kind, **kw)
            params = nn.unbox(jax.jit(model.init)(jax.random.key(0), x))["params"]
            fn = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
        got, got_g = value_and_grads(fn, params, x, ct)
    oracle = plain(kind)
    if kind == "mlp":
        oracle = lambda p, x: PLAIN["mlp"](p, x)  # noqa: E731
    want, want_g = value_and_grads(oracle, jax.device_get(params), jax.device_get(x), ct)
    assert_close(got, want)
    assert_close(got_g, want_g)
    return got, got_g[1]


FRAMEWORKS = ["nnx", "linen"]


# linen's ParallelMLP runs linen's column and row layers; the linen wrappers pass the same options.
@pytest.mark.parametrize(
    "framework, kind", [("nnx", "column"), ("nnx", "row"), ("nnx", "mlp"), ("linen", "mlp")]
)
def test_the_batch_keeps_the_callers_axes_on_a_stage_mesh(framework, kind):
    """batch_axes="data" on (data, stage, tp): the batch is not split over the pipeline axis."""
    x = data(B, S, IN[kind])
    y, dx = run(framework, kind, stage_mesh(), "tp", x, batch_axes="data")
    assert spec(y) == out_spec(kind, "data", "tp")
    assert dx.shape == x.shape


@pytest.mark.parametrize("framework, kind", [("nnx", "mlp"), ("linen", "mlp"), ("linen", "column")])
def test_maxtext_activation_batch_through_the_rules(framework, kind):
    """batch_axes="activation_batch" on (data, fsdp, tensor): the rules map it to (data, fsdp)."""
    x = data(B, S, IN[kind])
    y, _ = run(framework, kind, maxtext_mesh(), "tensor", x, rules=RULES, batch_axes="activation_batch")
    assert spec(y) == out_spec(kind, ("data", "fsdp"), "tensor")


def test_mesh_axes_given_directly_on_the_maxtext_mesh():
    x = data(B, S, IN["row"])
    y, _ = run("linen", "row", maxtext_mesh(), "tensor", x, batch_axes=("fsdp", "data"))
    assert spec(y) == out_spec("row", ("fsdp", "data"), "tensor")


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_qkv_keeps_the_callers_axes(framework):
    """q, k, v `[batch, seq, heads, head_dim]` keep the batch on 'data', the heads on 'tp'."""
    nq, nkv, hd, hidden = 4, 2, 4, IN["column"]
    mesh = stage_mesh()
    x = data(B, S, hidden)
    with jax.set_mesh(mesh):
        if framework == "nnx":
            layer = ubnn.QKVParallelDense(
                hidden, nq, nkv, hd, batch_axes="data", precision=HIGHEST, rngs=nnx.Rngs(0)
            )
            q, k, v = nnx.jit(lambda m, x: m(x))(layer, x)
            kernel = layer.kernel[...]
        else:
            model = ubl.QKVParallelDense(nq, nkv, hd, batch_axes="data", precision=HIGHEST)
            params = jax.jit(model.init)(jax.random.key(0), x)
            q, k, v = jax.jit(model.apply)(params, x)
            kernel = nn.unbox(params)["params"]["kernel"]
    separate = ubnn.unpack_qkv(jax.device_get(kernel), num_heads=nq, num_kv_heads=nkv, tp=2, layout="kernel")
    for got, w, n in zip((q, k, v), separate, (nq, nkv, nkv), strict=True):
        assert spec(got) == P("data", None, "tp", None)
        assert_close(got, jnp.dot(x, w, precision=HIGHEST).reshape(B, S, n, hd))


def test_batch_axes_none_keeps_the_batch_whole():
    x = data(B, S, IN["column"])
    y, _ = run("nnx", "column", stage_mesh(), "tp", x, batch_axes=None)
    assert spec(y) == out_spec("column", None, "tp")


def test_the_default_is_unchanged():
    """ "auto" with an x of unknown layout: the batch over every other axis of size > 1, as before."""
    x = data(B, S, IN["mlp"])
    y, _ = run("nnx", "mlp", stage_mesh(), "tp", x)
    assert spec(y) == out_spec("mlp", ("data", "stage"), "tp")
    odd = data(3, S, IN["column"])  # a batch of 3 splits over none of them: kept whole, as before
    y, _ = run("linen", "column", stage_mesh(), "tp", odd)
    assert spec(y) == out_spec("column", None, "tp")


def test_the_default_keeps_the_axes_a_concrete_x_comes_with():
    mesh = stage_mesh()
    x = jax.device_put(data(B, S, IN["row"]), NamedSharding(mesh, P("data", None, "tp")))
    with jax.set_mesh(mesh):
        layer = nnx_layer("row", precision=HIGHEST, bias_init=NORMAL)
        y = layer(x)  # eager: x's sharding is known
        want = PLAIN["row"](jax.device_get(pure(layer)), jax.device_get(x))
    assert spec(y) == out_spec("row", "data", "tp")
    assert_close(y, want)


@pytest.mark.parametrize("kind", ["column", "mlp"])
def test_the_default_keeps_the_axes_of_an_explicit_type_under_jit(kind):
    mesh = stage_mesh(explicit=True)
    with jax.set_mesh(mesh):
        x = jax.device_put(data(B, S, IN[kind]), P("stage", "tp"))
        layer = (
            ubnn.ParallelMLP(IN["mlp"], IN["mlp"] * 2, precision=HIGHEST, bias_init=NORMAL, rngs=nnx.Rngs(0))
            if kind == "mlp"
            else nnx_layer(kind, precision=HIGHEST, bias_init=NORMAL)
        )
        y = nnx.jit(lambda m, x: m(x))(layer, x)
        params = jax.device_get(pure(layer))
    assert spec(y) == out_spec(kind, "stage", "tp")
    assert_close(y, PLAIN[kind](params, jax.device_get(x)))


# --------------------------------------------------------------------------------------------------
# Refusals


def _call_nnx(kind, mesh, x, rules=(), tp="tp", **kw):
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        layer = nnx_layer(kind, axis_name=tp, **kw)
        return layer(x)


def _call_linen(kind, mesh, x, rules=(), tp="tp", **kw):
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        return linen_layer(kind, axis_name=tp, **kw).init(jax.random.key(0), x)


CALL = {"nnx": _call_nnx, "linen": _call_linen}

REFUSED = [
    # (batch_axes, x shape, rules, exception, message)
    ("pipe", (B, S), (), ValueError, r"names 'pipe', which is neither an axis of the mesh \(its axes: "),
    ("tp", (B, S), (), ValueError, r"must name mesh axes other than the TP axis 'tp'.*got batch_axes='tp'"),
    (("data", "data"), (B, S), (), ValueError, r"names the mesh axis 'data' twice"),
    (
        ("activation_batch", "data"),
        (B, S),
        (("activation_batch", ("data", "stage")),),
        ValueError,
        r"\(which the logical axis rules map to \('data', 'stage', 'data'\)\) names the mesh axis "
        r"'data' twice",
    ),
    (
        "activation_batch",
        (B, S),
        (("mlp", "tp"), ("activation_batch", ("data", "tp"))),
        ValueError,
        r"\(which the logical axis rules map to \('data', 'tp'\)\) names the TP axis 'tp'",
    ),
    (
        ("data", "stage"),
        (6, S),
        (),
        ValueError,
        r"the batch \(x.shape=\[6, 8, 16\], dim 0\) must divide by the size 4 of `batch_axes` "
        r"\('data', 'stage'\) \('data': 2, 'stage': 2\); got a batch of 6",
    ),
    ("data", (S,), (), ValueError, r"x has no batch dim \(x.shape=\[8, 16\]"),
    (
        3,
        (B, S),
        (),
        TypeError,
        r"`batch_axes` must be 'auto', None, a mesh axis or logical name.*got 3 \(int\)",
    ),
    ([], (B, S), (), None, None),  # an empty list: the batch whole, as None
]


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("case", REFUSED, ids=lambda c: repr(c[0]) + "-" + "x".join(map(str, c[1])))
def test_invalid_batch_axes_are_refused(framework, case):
    batch_axes, lead, rules, exc, msg = case
    x = data(*lead, IN["column"])
    if exc is None:
        CALL[framework]("column", stage_mesh(), x, rules, batch_axes=batch_axes)
        return
    with pytest.raises(exc, match=f"ColumnParallelDense: .*{msg}"):
        CALL[framework]("column", stage_mesh(), x, rules, batch_axes=batch_axes)


def test_the_mlp_refuses_the_tp_axis_where_it_is_built():
    with (
        jax.set_mesh(stage_mesh()),
        pytest.raises(ValueError, match=r"ParallelMLP: `batch_axes` must name mesh axes other than"),
    ):
        ubnn.ParallelMLP(IN["mlp"], 32, batch_axes=("data", "tp"), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_an_x_sharded_otherwise_than_batch_axes_is_refused(framework):
    """x comes with its batch over 'stage'; the layer was told 'data': no silent re-shard."""
    mesh = stage_mesh()
    x = jax.device_put(data(B, S, IN["row"]), NamedSharding(mesh, P("stage", None, "tp")))
    msg = (
        r"RowParallelDense: x \(shape \[4, 8, 32\]\) comes sharded P\('stage', None, None\) over the "
        r"mesh axes other than the TP axis 'tp', but the layer's input layout is P\('data', None, 'tp'\) "
        r"\(batch_axes='data'\); dim 0 would be re-sharded from 'stage' to 'data'"
    )
    with pytest.raises(ValueError, match=msg):
        CALL[framework]("row", mesh, x, batch_axes="data")


def test_an_x_whose_sequence_is_split_over_another_axis_is_refused():
    """The default keeps a known batch layout; a non-TP axis on the sequence it cannot keep."""
    mesh = stage_mesh()
    x = jax.device_put(data(B, S, IN["column"]), NamedSharding(mesh, P(None, "stage")))
    with pytest.raises(ValueError, match=r"dim 1 would be re-sharded from 'stage' to None"):
        _call_nnx("column", mesh, x)


def test_an_explicit_x_sharded_otherwise_is_refused_under_jit():
    mesh = stage_mesh(explicit=True)
    with jax.set_mesh(mesh):
        x = jax.device_put(data(B, S, IN["column"]), P("stage", "tp"))
        layer = nnx_layer("column", batch_axes=("data", "stage"))
        with pytest.raises(
            ValueError, match=r"dim 0 would be re-sharded from 'stage' to \('data', 'stage'\)"
        ):
            nnx.jit(lambda m, x: m(x))(layer, x)


def test_a_matching_x_is_taken_as_it_comes():
    mesh = stage_mesh()
    x = jax.device_put(data(B, S, IN["column"]), NamedSharding(mesh, P(("data", "stage"), "tp")))
    with jax.set_mesh(mesh):
        layer = nnx_layer("column", precision=HIGHEST, bias_init=NORMAL, batch_axes=("data", "stage"))
        y = layer(x)
        want = PLAIN["column"](jax.device_get(pure(layer)), jax.device_get(x))
    assert spec(y) == out_spec("column", ("data", "stage"), "tp")
    assert_close(y, want)
    assert jnp.all(jnp.isfinite(y))
