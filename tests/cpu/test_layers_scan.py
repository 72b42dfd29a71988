"""CPU tier: the TP layers in a Llama/MaxText-style stack: layers stacked on a leading axis
(``nnx.vmap`` / ``nn.scan`` with a ``"layers"`` partition name), run with ``nnx.scan`` /
``nn.scan`` under ``nnx.remat`` / ``nn.remat`` (jax_ub's checkpoint policy), with logical names
and per-projection initializers.

Each stack is compared, output and gradients, against a plain unsharded float32 loop over its
layers, on a ("fsdp", "tp") mesh of 2 x 4 host devices.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import pytest
from _layer_helpers import (
    HIGHEST,
    NORMAL,
    B,
    F,
    H,
    S,
    assert_close,
    data,
    fsdp_mesh,
    on_cpu,  # noqa: F401  (autouse fixture)
    plain_mlp,
    value_and_grads,
)
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub import linen as ubl
from jax_ub import nn as ubnn

L = 3  # layers
LECUN = nnx.initializers.lecun_normal()
RULES = (("layers", None), ("embed", "fsdp"), ("mlp", "tp"))
POLICY = jax_ub.checkpoint_policy(jax.checkpoint_policies.dots_saveable)
STACKED_SPECS = {
    "up": {"kernel": P(None, "fsdp", "tp"), "bias": P(None, "tp")},
    "down": {"kernel": P(None, "tp", "fsdp"), "bias": P(None, "fsdp")},
}


def plain_stack(params, x):
    """The oracle: ``x + mlp_i(x)`` for each layer ``i`` of the stacked plain parameters."""
    for i in range(L):
        x = x + plain_mlp(jax.tree.map(lambda a, i=i: a[i], params), x)
    return x


def carry(mesh, explicit):
    """x, and on Explicit axes given the sharding the layers return (`[batch, seq/tp, hidden]`):
    jax requires a ``lax.scan`` carry under ``jax.checkpoint`` to keep its sharding on Explicit
    meshes (an AssertionError in its backward otherwise, with plain jax ops too)."""
    x = data(B, S, H)
    return jax.device_put(x, NamedSharding(mesh, P("fsdp", "tp"))) if explicit else x


class Block(nnx.Module):
    def __init__(self, rngs):
        self.mlp = ubnn.ParallelMLP(
            H,
            F,
            precision=HIGHEST,
            bias_init=NORMAL,
            up_kernel_init=nnx.with_partitioning(LECUN, ("embed", "mlp")),
            down_kernel_init=nnx.with_partitioning(lambda *a: 0.5 * LECUN(*a), ("mlp", "embed")),
            rngs=rngs,
        )

    def __call__(self, x):
        return x + self.mlp(x)


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
def test_nnx_scan_remat_over_stacked_layers(cpu_mesh, explicit):
    mesh = fsdp_mesh(cpu_mesh, tp=4, explicit=explicit)
    x, ct = carry(mesh, explicit), data(B, S, H, seed=2)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(RULES):

        @nnx.split_rngs(splits=L)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def create(rngs):
            return Block(rngs)

        blocks = create(nnx.Rngs(0))
        state = nnx.state(blocks, nnx.Param)
        specs = nnx.to_pure_dict(nnx.get_partition_spec(state))["mlp"]
        assert {k: specs[k] for k in STACKED_SPECS} == STACKED_SPECS
        assert blocks.mlp.up.kernel.get_metadata()["out_sharding"] == ("layers", "embed", "mlp")
        graphdef, rest = nnx.graphdef(blocks), nnx.state(blocks, nnx.Not(nnx.Param))

        def stack(params, x):
            @nnx.scan(
                in_axes=(0, nnx.Carry), out_axes=nnx.Carry, transform_metadata={nnx.PARTITION_NAME: "layers"}
            )
            @nnx.remat(policy=POLICY)
            def step(block, x):
                return block(x)

            return step(nnx.merge(graphdef, params, rest), x)

        params = nnx.to_pure_dict(state)
        got, got_g = value_and_grads(stack, params, x, ct)
    stacked = jax.device_get(params)["mlp"]
    assert stacked["up"]["kernel"].shape == (L, H, F)
    want, want_g = value_and_grads(
        lambda p, x: plain_stack(p["mlp"], x), jax.device_get(params), jax.device_get(x), ct
    )
    assert_close(got, want)
    assert_close(got_g, want_g)


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        mlp = ubl.ParallelMLP(
            F,
            precision=HIGHEST,
            bias_init=NORMAL,
            up_kernel_init=nn.with_logical_partitioning(LECUN, ("embed", "mlp")),
            down_kernel_init=nn.with_logical_partitioning(lambda *a: 0.5 * LECUN(*a), ("mlp", "embed")),
            name="mlp",
        )
        return x + mlp(x), None


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
def test_linen_scan_remat_over_stacked_layers(cpu_mesh, explicit):
    mesh = fsdp_mesh(cpu_mesh, tp=4, explicit=explicit)
    x, ct = carry(mesh, explicit), data(B, S, H, seed=2)
    model = nn.scan(
        nn.remat(LinenBlock, policy=POLICY),
        variable_axes={"params": 0},
        split_rngs={"params": True},
        length=L,
        metadata_params={nn.PARTITION_NAME: "layers"},
    )()
    apply = lambda p, x: model.apply({"params": p}, x, None)[0]  # noqa: E731
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        init = lambda k, x: model.init(k, x, None)  # noqa: E731
        abstract = jax.eval_shape(init, jax.random.key(0), x)
        logical = nn.get_partition_spec(abstract)["params"]["mlp"]
        assert logical["up"]["kernel"] == P("layers", "embed", "mlp")
        shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, RULES)
        params = nn.unbox(jax.jit(init, out_shardings=shardings)(jax.random.key(0), x))["params"]
        mesh_specs = jax.tree.map(lambda a: a.sharding.spec, params["mlp"])
        assert {k: mesh_specs[k] for k in STACKED_SPECS} == STACKED_SPECS
        got, got_g = value_and_grads(apply, params, x, ct)
    want, want_g = value_and_grads(
        lambda p, x: plain_stack(p["mlp"], x), jax.device_get(params), jax.device_get(x), ct
    )
    assert_close(got, want)
    assert_close(got_g, want_g)


def test_nnx_remat_alone_matches(cpu_mesh):
    """``nnx.remat`` on one layer (no scan), jax_ub's policy: the same numbers as the plain MLP."""
    mesh = fsdp_mesh(cpu_mesh, tp=4)
    x, ct = data(B, S, H), data(B, S, H, seed=2)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(RULES):
        block = Block(nnx.Rngs(0))
        graphdef, params = nnx.split(block, nnx.Param)
        f = nnx.remat(lambda m, x: m(x), policy=POLICY)
        got, got_g = value_and_grads(
            lambda p, x: f(nnx.merge(graphdef, p), x), nnx.to_pure_dict(params), x, ct
        )
    want, want_g = value_and_grads(
        lambda p, x: x + plain_mlp(p["mlp"], x), jax.device_get(nnx.to_pure_dict(params)), x, ct
    )
    assert_close(got, want)
    assert_close(got_g, want_g)
