"""MaxText's conventions on the TP layers: a mesh ``(data, fsdp, tensor)`` whose TP axis is called
``tensor``, MaxText's logical names (``embed``, ``mlp``, ``vocab``, ``norm``), and rules that map one
name to several mesh axes, as MaxText's ``("mlp", ("fsdp_transpose", "tensor"))``.

The axes of size 1 in such a rule are ignored; FSDP-like axes go on the dims the layer keeps whole;
an axis of size > 1 beside the TP axis on the dim the layer splits is refused, with the reason. The
model (an embedding, two MLP blocks on the TP layers, a head) is checked against the plain float32
computation on its parameters, output and gradients, on 8 host devices.
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
    dot,
    on_cpu,  # noqa: F401  (autouse fixture)
    plain_mlp,
    pure,
    value_and_grads,
)
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_ub import linen as ubl
from jax_ub import nn as ubnn

B, S, H, F, V = 2, 8, 16, 32, 24  # batch, sequence, embed, mlp, vocab
LECUN = nnx.initializers.lecun_normal()

# MaxText's names; its mesh has every axis, those it does not use of size 1. (A mesh axis may
# appear on one dim of an array only: jax refuses P(("fsdp", "fsdp_transpose"), ("fsdp_transpose",
# "tensor")) for the ("embed", "mlp") kernel, whatever the sizes, so "embed" is FSDP's alone here.)
RULES = (
    ("activation_batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", ("fsdp_transpose", "tensor")),
    ("norm", None),
)


def mesh_of(**sizes) -> Mesh:
    devices = np.array(jax.devices("cpu")[: int(np.prod(list(sizes.values())))])
    kind = jax.sharding.AxisType.Auto
    return Mesh(devices.reshape(tuple(sizes.values())), tuple(sizes), axis_types=(kind,) * len(sizes))


def maxtext_mesh(fsdp_transpose=1):
    """(data, fsdp, fsdp_transpose, tensor) of 8 devices: (1, 2, 1, 4), or (1, 2, 2, 2)."""
    return mesh_of(data=1, fsdp=2, fsdp_transpose=fsdp_transpose, tensor=8 // (2 * fsdp_transpose))


def three_axis_mesh():
    """The (data, fsdp, tensor) mesh of the issue: 2 x 2 x 2."""
    return mesh_of(data=2, fsdp=2, tensor=2)


class Model(nnx.Module):
    """Embedding ("vocab", "embed"), two MLP blocks (TP layers over ``tensor``), a head."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(
            V, H, embedding_init=nnx.with_partitioning(NORMAL, ("vocab", "embed")), rngs=rngs
        )
        self.blocks = nnx.List(
            [
                ubnn.ParallelMLP(
                    H,
                    F,
                    axis_name="tensor",
                    precision=HIGHEST,
                    bias_init=NORMAL,
                    up_kernel_init=nnx.with_partitioning(LECUN, ("embed", "mlp")),
                    down_kernel_init=nnx.with_partitioning(LECUN, ("mlp", "embed")),
                    rngs=rngs,
                )
                for _ in range(2)
            ]
        )
        self.head = nnx.Param(nnx.with_partitioning(LECUN, ("embed", "vocab"))(rngs.params(), (H, V)))

    def __call__(self, x):
        for block in self.blocks:
            x = x + block(x)
        return jnp.dot(x, self.head[...], precision=HIGHEST)


def plain_model(p, x):
    for i in range(2):
        x = x + plain_mlp(p["blocks"][i], x)
    return dot(x, p["head"])


def _run_nnx(mesh, rules):
    tokens = jax.random.randint(jax.random.key(7), (B, S), 0, V)
    ct = data(B, S, V, seed=3)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        model = Model(nnx.Rngs(0))
        x = model.embed(tokens)  # the model body from the embedded tokens
        graphdef, rest = nnx.graphdef(model), nnx.state(model, nnx.Not(nnx.Param))
        params = pure(model)
        fn = lambda p, x: nnx.merge(graphdef, p, rest)(x)  # noqa: E731
        got, got_g = value_and_grads(fn, params, x, ct)
        specs = jax.tree.map(lambda a: a.sharding.spec, params)
    want, want_g = value_and_grads(plain_model, jax.device_get(params), jax.device_get(x), ct)
    assert_close(got, want)
    assert_close(got_g, want_g)
    return specs


def test_nnx_model_with_several_axes_per_name():
    """mlp -> (fsdp_transpose, tensor) with fsdp_transpose of size 1: the layers split over tensor,
    the size-1 axis ignored; embed -> fsdp on the dims they keep whole."""
    specs = _run_nnx(maxtext_mesh(), RULES)
    up, down = specs["blocks"][0]["up"], specs["blocks"][1]["down"]
    # NNX places each parameter as the rules map its logical names (the size-1 axis included: the
    # same devices as "tensor" alone)
    mlp = ("fsdp_transpose", "tensor")
    assert up["kernel"] == P("fsdp", mlp) and up["bias"] == P(mlp)
    assert down["kernel"] == P(mlp, "fsdp") and down["bias"] == P("fsdp")


def test_nnx_model_on_the_three_axis_mesh():
    """The (data, fsdp, tensor) mesh; rules with MaxText's names for its axes."""
    rules = (("vocab", "tensor"), ("embed", ("data", "fsdp")), ("mlp", "tensor"), ("norm", None))
    specs = _run_nnx(three_axis_mesh(), rules)
    assert specs["blocks"][0]["up"]["kernel"] == P(("data", "fsdp"), "tensor")
    assert specs["head"] == P(("data", "fsdp"), "tensor")


def test_linen_model_with_several_axes_per_name():
    mesh = maxtext_mesh()
    model = ubl.ParallelMLP(
        H,
        axis_name="tensor",
        precision=HIGHEST,
        bias_init=NORMAL,
        up_kernel_init=nn.with_logical_partitioning(LECUN, ("embed", "mlp")),
        down_kernel_init=nn.with_logical_partitioning(LECUN, ("mlp", "embed")),
    )
    x, ct = data(B, S, H), data(B, S, H, seed=2)
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        abstract = jax.eval_shape(model.init, jax.random.key(0), x)
        logical = nn.get_partition_spec(abstract)["params"]
        shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, RULES)
        params = nn.unbox(jax.jit(model.init, out_shardings=shardings)(jax.random.key(0), x))["params"]
        got, got_g = value_and_grads(lambda p, x: model.apply({"params": p}, x), params, x, ct)
    assert logical["up"]["kernel"] == P("embed", "mlp")
    want, want_g = value_and_grads(lambda p, x: plain_mlp(p, x), jax.device_get(params), x, ct)
    assert_close(got, want)
    assert_close(got_g, want_g)


def test_linen_fills_the_tp_dim_from_a_rule_of_several_axes():
    """No initializer names anything: the layer takes 'mlp' (-> (fsdp_transpose, tensor), the
    former of size 1) for its TP dims (a name mapped to 'tensor' alone, as 'vocab', would come
    first)."""
    model = ubl.ParallelMLP(H, axis_name="tensor", precision=HIGHEST, bias_init=NORMAL)
    x = data(B, S, H)
    rules = tuple(r for r in RULES if r[0] != "vocab")
    with jax.set_mesh(maxtext_mesh()), nn.logical_axis_rules(rules):
        logical = nn.get_partition_spec(jax.eval_shape(model.init, jax.random.key(0), x))["params"]
    assert logical["up"]["kernel"] == P(None, "mlp") and logical["down"]["kernel"] == P("mlp", None)


def _column(framework, x):
    if framework == "nnx":
        kernel_init = nnx.with_partitioning(LECUN, ("embed", "mlp"))
        return ubnn.ColumnParallelDense(H, F, axis_name="tensor", kernel_init=kernel_init, rngs=nnx.Rngs(0))
    kernel_init = nn.with_logical_partitioning(LECUN, ("embed", "mlp"))
    return ubl.ColumnParallelDense(F, axis_name="tensor", kernel_init=kernel_init).init(jax.random.key(0), x)


@pytest.mark.parametrize("framework", ["nnx", "linen"])
def test_a_second_axis_of_size_above_one_on_the_tp_dim_is_refused(framework):
    msg = (
        r"`kernel` dim 1 \(which the layer splits over 'tensor'.*names it 'mlp', which maps to "
        r"\('fsdp_transpose', 'tensor'\): besides 'tensor' that splits the dim over "
        r"\('fsdp_transpose',\) \(sizes 'fsdp_transpose': 2\).*Axes of size 1 there are ignored"
    )
    x = data(B, S, H)
    with (
        jax.set_mesh(maxtext_mesh(fsdp_transpose=2)),
        nn.logical_axis_rules(RULES),
        pytest.raises(ValueError, match=msg),
    ):
        _column(framework, x)


@pytest.mark.parametrize("framework", ["nnx", "linen"])
def test_tensor_on_a_whole_dim_is_refused(framework):
    """'embed' -> ('fsdp', 'tensor'): the layer keeps that dim whole over 'tensor'."""
    rules = (("embed", ("fsdp", "tensor")), ("mlp", "tensor"))
    msg = r"dim 0 \(which the layer keeps whole over 'tensor'.*other than 'tensor'"
    with jax.set_mesh(three_axis_mesh()), nn.logical_axis_rules(rules), pytest.raises(ValueError, match=msg):
        _column(framework, data(B, S, H))
