"""CPU tier: logical axis names on the TP layers' parameters (NNX and linen).

A Llama/MaxText-style model names parameter dims logically (``"embed"``, ``"mlp"``) and maps them
to mesh axes with rules. The layers keep the user's logical names in their boxes, the TP dim comes
out as the TP mesh axis, the other dims follow the rules (FSDP here), a bias with a plain
initializer takes its kernel's logical output name, and conflicts are refused with a message naming
the parameter, the dim, what was expected and what was received.

Numbers are checked against the plain unsharded float32 computation, on a ("fsdp", "tp") mesh of
2 x 4 host devices.
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
    nnx_fn,
    on_cpu,  # noqa: F401  (autouse fixture)
    plain_mlp,
    pure,
    value_and_grads,
)
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_ub import linen as ubl
from jax_ub import nn as ubnn

LECUN = nnx.initializers.lecun_normal()
RULES = (("batch", None), ("embed", "fsdp"), ("mlp", "tp"))
# What RULES make of each parameter of the MLP (the norm's, replicated, named by the layer).
MESH_SPECS = {
    "norm": {"scale": P(None), "bias": P(None)},
    "up": {"kernel": P("fsdp", "tp"), "bias": P("tp")},
    "down": {"kernel": P("tp", "fsdp"), "bias": P("fsdp")},
}


def specs_of(tree):
    return jax.tree.map(lambda a: a.sharding.spec, tree)


def linen_mlp(up=("embed", "mlp"), down=("mlp", "embed"), rules=None, **kw):
    return ubl.ParallelMLP(
        F,
        precision=HIGHEST,
        bias_init=NORMAL,
        up_kernel_init=nn.with_logical_partitioning(LECUN, up, rules=rules),
        down_kernel_init=nn.with_logical_partitioning(LECUN, down, rules=rules),
        **kw,
    )


def nnx_mlp(up=("embed", "mlp"), down=("mlp", "embed"), **box):
    return ubnn.ParallelMLP(
        H,
        F,
        precision=HIGHEST,
        bias_init=NORMAL,
        up_kernel_init=nnx.with_partitioning(LECUN, up, **box),
        down_kernel_init=nnx.with_partitioning(LECUN, down, **box),
        rngs=nnx.Rngs(0),
    )


def check_linen(mesh, model, x, ct, rules=RULES):
    """``model``'s logical specs translate to MESH_SPECS with ``rules``; initialised with those
    shardings (the linen recipe) and applied, it matches the plain MLP on its parameters."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        abstract = jax.eval_shape(model.init, jax.random.key(0), x)
        logical = nn.get_partition_spec(abstract)["params"]
        shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
        variables = jax.jit(model.init, out_shardings=shardings)(jax.random.key(0), x)
        params = nn.unbox(variables)["params"]
        assert specs_of(params) == MESH_SPECS
        got, got_g = value_and_grads(lambda p, x: model.apply({"params": p}, x), params, x, ct)
    want, want_g = value_and_grads(plain_mlp, jax.device_get(params), x, ct)
    assert_close(got, want)
    assert_close(got_g, want_g)
    return logical, variables


# ------------------------------------------------------------------------------------------------
# The names translate to the layer's TP axis and the user's FSDP axis, and the numbers are right.


def test_linen_logical_names_follow_the_rules(cpu_mesh):
    x, ct = data(B, S, H), data(B, S, H, seed=2)
    logical, variables = check_linen(fsdp_mesh(cpu_mesh, tp=4), linen_mlp(), x, ct)
    # the boxes keep the logical names (what nn.logical_to_mesh_sharding reads); the biases, whose
    # initializer names nothing, take their kernel's output name
    assert logical["up"] == {"kernel": P("embed", "mlp"), "bias": P("mlp")}
    assert logical["down"] == {"kernel": P("mlp", "embed"), "bias": P("embed")}
    assert isinstance(variables["params"]["up"]["kernel"], nn.LogicallyPartitioned)
    # the norm's boxes too (one tree of logical names): names None, replicated
    assert isinstance(variables["params"]["norm"]["scale"], nn.LogicallyPartitioned)


def test_linen_plain_inits_under_rules_are_boxed_logically(cpu_mesh):
    """No initializer names anything, rules in context: the layer names the TP dims with the
    rules' name for 'tp', so translating the whole tree keeps them split (not replicated)."""
    mesh = fsdp_mesh(cpu_mesh, tp=4)
    x, ct = data(B, S, H), data(B, S, H, seed=2)
    model = ubl.ParallelMLP(F, precision=HIGHEST, bias_init=NORMAL)
    rules = (("embed", "fsdp"), ("mlp", "tp"))
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        abstract = jax.eval_shape(model.init, jax.random.key(0), x)
        logical = nn.get_partition_spec(abstract)["params"]
        shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
        params = nn.unbox(jax.jit(model.init, out_shardings=shardings)(jax.random.key(0), x))["params"]
        got, got_g = value_and_grads(lambda p, x: model.apply({"params": p}, x), params, x, ct)
    assert logical["up"] == {"kernel": P(None, "mlp"), "bias": P("mlp")}
    assert logical["down"] == {"kernel": P("mlp", None), "bias": P(None)}
    assert specs_of(params)["up"] == {"kernel": P(None, "tp"), "bias": P("tp")}
    assert specs_of(params)["down"] == {"kernel": P("tp", None), "bias": P(None)}
    want, want_g = value_and_grads(plain_mlp, jax.device_get(params), x, ct)
    assert_close(got, want)
    assert_close(got_g, want_g)


def test_linen_rules_of_the_box(cpu_mesh):
    """Rules given to ``nn.with_logical_partitioning`` itself, none in context at init."""
    mesh = fsdp_mesh(cpu_mesh, tp=4)
    x, ct = data(B, S, H), data(B, S, H, seed=2)
    model = linen_mlp(rules=RULES)
    with jax.set_mesh(mesh):
        variables = jax.jit(model.init)(jax.random.key(0), x)
        params = nn.unbox(variables)["params"]
        assert specs_of(params) == MESH_SPECS  # created sharded as the rules say
        got, got_g = value_and_grads(lambda p, x: model.apply({"params": p}, x), params, x, ct)
    want, want_g = value_and_grads(plain_mlp, jax.device_get(params), x, ct)
    assert_close(got, want)
    assert_close(got_g, want_g)


def test_linen_tp_dim_left_none_takes_the_rules_name(cpu_mesh):
    x, ct = data(B, S, H), data(B, S, H, seed=2)
    logical, _ = check_linen(
        fsdp_mesh(cpu_mesh, tp=4), linen_mlp(up=("embed", None), down=(None, "embed")), x, ct
    )
    assert logical["up"]["kernel"] == P("embed", "mlp")
    assert logical["down"]["kernel"] == P("mlp", "embed")


@pytest.mark.parametrize("rules_from", ["context", "box"])
@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
def test_nnx_logical_names_follow_the_rules(cpu_mesh, rules_from, explicit):
    mesh = fsdp_mesh(cpu_mesh, tp=4, explicit=explicit)
    x, ct = data(B, S, H), data(B, S, H, seed=2)
    box = {"sharding_rules": RULES} if rules_from == "box" else {}
    context = nnx.logical_axis_rules(RULES if rules_from == "context" else ())
    with jax.set_mesh(mesh), context:
        mlp = nnx_mlp(**box)
        params = pure(mlp)
        assert specs_of(params) == MESH_SPECS  # created sharded as the rules say
        got, got_g = value_and_grads(nnx_fn(mlp), params, x, ct)
        state = nnx.state(mlp, nnx.Param)
        # the metadata keeps the logical names; Flax translates them with the same rules
        assert state["up"]["kernel"].get_metadata()["out_sharding"] == ("embed", "mlp")
        assert state["down"]["bias"].get_metadata()["out_sharding"] == ("embed",)
        assert nnx.to_pure_dict(nnx.get_partition_spec(state)) == MESH_SPECS
    want, want_g = value_and_grads(plain_mlp, jax.device_get(params), x, ct)
    assert_close(got, want)
    assert_close(got_g, want_g)


def test_nnx_tp_dim_left_none_is_the_tp_axis(cpu_mesh):
    with jax.set_mesh(fsdp_mesh(cpu_mesh, tp=4)), nnx.logical_axis_rules(RULES):
        mlp = nnx_mlp(up=("embed", None), down=(None, "embed"))
        assert mlp.up.kernel.get_metadata()["out_sharding"] == ("embed", "tp")
        assert specs_of(pure(mlp)) == MESH_SPECS


# ------------------------------------------------------------------------------------------------
# Conflicts: each error names the layer, the parameter, the dim, the expectation and what came.

CONFLICTS = {
    "whole-dim-on-tp": (
        (("embed", "tp"), ("mlp", "tp")),
        r"ColumnParallelDense: `kernel` dim 0 \(which the layer keeps whole over 'tp'.*expected a "
        r"logical name that the rules map to mesh axes other than 'tp'.*names it 'embed', which "
        r"maps to 'tp'",
    ),
    "tp-dim-elsewhere": (
        (("embed", None), ("mlp", "fsdp")),
        r"ColumnParallelDense: `kernel` dim 1 \(which the layer splits over 'tp'.*expected a logical "
        r"name that the rules map to 'tp'.*names it 'mlp', which maps to 'fsdp'",
    ),
    "axis-not-in-mesh": (
        (("embed", "data"), ("mlp", "tp")),
        r"ColumnParallelDense: `kernel` dim 0 .*names it 'embed', which maps to 'data', but the mesh "
        r"has no axis 'data'",
    ),
}


@pytest.mark.parametrize("case", list(CONFLICTS), ids=list(CONFLICTS))
def test_conflicting_rules_are_refused_by_both(cpu_mesh, case):
    rules, msg = CONFLICTS[case]
    x = data(B, S, H)
    with jax.set_mesh(fsdp_mesh(cpu_mesh, tp=4)), nn.logical_axis_rules(rules):
        with pytest.raises(ValueError, match=msg) as nnx_error:
            nnx_mlp()
        with pytest.raises(ValueError, match=msg) as linen_error:
            linen_mlp().init(jax.random.key(0), x)
    for e in (nnx_error, linen_error):  # the MLP says which of its initializers it was
        assert "While building ParallelMLP.up: its `kernel` is from up_kernel_init" in e.value.__notes__[0]


def test_unknown_logical_name_is_refused_by_both(cpu_mesh):
    x = data(B, S, H)
    msg = (
        r"RowParallelDense: `kernel` dim 0 \(which the layer splits over 'tp'.*kernel_init names "
        r"it with the logical name 'mpl', which no logical axis rule maps{} \(rules: \('batch', "
        r"None\), \('embed', 'fsdp'\), \('mlp', 'tp'\)\)\. Expected one of \['batch', 'embed', "
        r"'mlp'\]"
    )
    with jax.set_mesh(fsdp_mesh(cpu_mesh, tp=4)), nn.logical_axis_rules(RULES):
        with pytest.raises(ValueError, match=msg.format(r" and which is not a mesh axis .*")):
            ubnn.RowParallelDense(
                F, H, kernel_init=nnx.with_partitioning(LECUN, ("mpl", "embed")), rngs=nnx.Rngs(0)
            )
        with pytest.raises(ValueError, match=msg.format("")):
            ubl.RowParallelDense(H, kernel_init=nn.with_logical_partitioning(LECUN, ("mpl", "embed"))).init(
                jax.random.key(0), data(B, S, F)
            )
        # on a dim the layer keeps whole too: a typo must not silently replicate a parameter
        with pytest.raises(
            ValueError,
            match=r"dim 1 .*the logical name 'embd', which no logical axis "
            r"rule maps",
        ):
            ubl.ColumnParallelDense(F, kernel_init=nn.with_logical_partitioning(LECUN, (None, "embd"))).init(
                jax.random.key(0), x
            )


def test_linen_logical_names_need_rules(cpu_mesh):
    msg = (
        r"ColumnParallelDense: kernel_init gives `kernel` the logical names \('embed', 'mlp'\), "
        r"but there are no logical axis rules .*received none"
    )
    with jax.set_mesh(fsdp_mesh(cpu_mesh, tp=4)), pytest.raises(ValueError, match=msg):
        ubl.ColumnParallelDense(F, kernel_init=nn.with_logical_partitioning(LECUN, ("embed", "mlp"))).init(
            jax.random.key(0), data(B, S, H)
        )


def test_linen_tp_dim_none_without_a_rule_for_tp_is_refused(cpu_mesh):
    msg = (
        r"ColumnParallelDense: `kernel` dim 1 \(which the layer splits over 'tp'.*leaves it None, "
        r"and no logical axis rule maps a name to 'tp'"
    )
    with (
        jax.set_mesh(fsdp_mesh(cpu_mesh, tp=4)),
        nn.logical_axis_rules((("embed", "fsdp"),)),
        pytest.raises(ValueError, match=msg),
    ):
        ubl.ColumnParallelDense(F, kernel_init=nn.with_logical_partitioning(LECUN, ("embed", None))).init(
            jax.random.key(0), data(B, S, H)
        )


def test_logical_names_to_other_axes_inside_shard_map_are_refused(cpu_mesh):
    mesh = fsdp_mesh(cpu_mesh, tp=4)

    def build(x):
        with nnx.logical_axis_rules(RULES):
            ubnn.ColumnParallelDense(
                H, F, kernel_init=nnx.with_partitioning(LECUN, ("embed", "mlp")), rngs=nnx.Rngs(0)
            )
        return x

    with pytest.raises(
        ValueError,
        match=r"ColumnParallelDense: kernel_init's logical names "
        r"\('embed', 'mlp'\) map to mesh axes \('fsdp', 'tp'\), "
        r"which put mesh axes other than 'tp'",
    ):
        jax.shard_map(build, mesh=mesh, in_specs=P(), out_specs=P())(data(2))


def test_logical_names_to_the_tp_axis_only_inside_shard_map(cpu_mesh):
    """Local mode: names whose rules give only the TP axis are fine, and init gives each device
    its shard of the global init."""
    mesh = fsdp_mesh(cpu_mesh, tp=4)
    rules = (("embed", None), ("mlp", "tp"))
    init = nnx.with_partitioning(LECUN, ("embed", "mlp"))

    def local(x):
        with nnx.logical_axis_rules(rules):
            return ubnn.ColumnParallelDense(H, F, kernel_init=init, rngs=nnx.Rngs(0)).kernel[...]

    shards = jax.shard_map(local, mesh=mesh, in_specs=P(), out_specs=P(None, "tp"))(data(2))
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        whole = ubnn.ColumnParallelDense(H, F, kernel_init=init, rngs=nnx.Rngs(0)).kernel[...]
    assert_close(shards, whole, rtol=0, atol=0)
    assert whole.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "tp")), 2)
