"""CPU tier: parameters of the TP layers (NNX and linen) as a user hands them over.

* initializers that carry their own partitioning (``with_partitioning``): names on the dims the
  layer keeps whole are merged into the layer's (FSDP), conflicts are refused;
* shape checks that blame the parameter that is wrong (a kernel in PyTorch's `[out, in]` layout, a
  bias of the wrong length) and name the layer;
* linen in local mode accepts whole parameters as NNX does.

Numbers are checked against the plain unsharded float32 computation.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
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
    param_specs,
    plain_dense,
    plain_mlp,
    pure,
    value_and_grads,
)
from flax import nnx
from jax.sharding import PartitionSpec as P

from jax_ub import linen as ubl
from jax_ub import nn as ubnn

LECUN = nnx.initializers.lecun_normal()


# ------------------------------------------------------------------------------------------------
# User partitioning merged on the dims the layer keeps whole (FSDP).


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
def test_nnx_fsdp_names_are_merged(cpu_mesh, explicit):
    mesh = fsdp_mesh(cpu_mesh, explicit=explicit)
    x, ct = data(B, S, H), data(B, S, H, seed=2)
    with jax.set_mesh(mesh):
        col = ubnn.ColumnParallelDense(
            H,
            F,
            precision=HIGHEST,
            kernel_init=nnx.with_partitioning(LECUN, ("fsdp", None), note="mine"),
            bias_init=nnx.with_partitioning(NORMAL, (None,)),
            rngs=nnx.Rngs(0),
        )
        row = ubnn.RowParallelDense(
            F,
            H,
            precision=HIGHEST,
            kernel_init=nnx.with_partitioning(LECUN, P(None, "fsdp")),
            bias_init=nnx.with_partitioning(NORMAL, ("fsdp",)),
            rngs=nnx.Rngs(1),
        )
        assert param_specs(col) == {"kernel": P("fsdp", "tp"), "bias": P("tp")}
        assert param_specs(row) == {"kernel": P("tp", "fsdp"), "bias": P("fsdp")}
        # created sharded over both axes, and the user's other metadata kept
        assert col.kernel[...].sharding.spec == P("fsdp", "tp")
        assert row.kernel[...].sharding.spec == P("tp", "fsdp")
        assert col.kernel.get_metadata()["note"] == "mine"
        params = {"col": pure(col), "row": pure(row)}
        f = lambda p, x: nnx_fn(row)(p["row"], nnx_fn(col)(p["col"], x))  # noqa: E731
        got, got_g = value_and_grads(f, params, x, ct)
    plain = lambda p, x: plain_dense(p["row"], plain_dense(p["col"], x))  # noqa: E731
    want, want_g = value_and_grads(plain, jax.device_get(params), x, ct)
    assert_close(got, want)
    assert_close(got_g, want_g)


def test_linen_fsdp_names_are_merged_in_one_box(cpu_mesh):
    mesh = fsdp_mesh(cpu_mesh)
    x, ct = data(B, S, H), data(B, S, F, seed=2)
    model = ubl.ColumnParallelDense(
        F,
        precision=HIGHEST,
        kernel_init=nn.with_partitioning(LECUN, ("fsdp", "tp")),
        bias_init=nn.with_partitioning(NORMAL, ("tp",)),
    )
    with jax.set_mesh(mesh):
        variables = jax.jit(model.init)(jax.random.key(0), x)
        kernel = variables["params"]["kernel"]
        assert isinstance(kernel, nn.Partitioned) and not isinstance(kernel.value, nn.Partitioned)
        assert nn.get_partition_spec(variables)["params"] == {"kernel": P("fsdp", "tp"), "bias": P("tp")}
        # the linen recipe: init again with out_shardings from those specs
        shardings = jax.tree.map(
            lambda s: jax.sharding.NamedSharding(mesh, s), nn.get_partition_spec(variables)
        )
        variables = jax.jit(model.init, out_shardings=shardings)(jax.random.key(0), x)
        assert variables["params"]["kernel"].value.sharding.spec == P("fsdp", "tp")
        params = nn.unbox(variables)["params"]
        got, got_g = value_and_grads(lambda p, x: model.apply({"params": p}, x), params, x, ct)
    want, want_g = value_and_grads(plain_dense, jax.device_get(params), x, ct)
    assert_close(got, want)
    assert_close(got_g, want_g)


CONFLICTS = {
    "other-axis-on-tp-dim": (
        ("dp", "fsdp"),
        r"names 'fsdp' on dim 1 of `kernel`, which the layer "
        r"splits over 'tp' itself",
    ),
    "tp-on-whole-dim": (("tp", None), r"names the tensor-parallel axis 'tp' on dim 0 of `kernel`"),
    "too-many-entries": (("fsdp", None, None), r"has 3 entries, but `kernel` has 2 dims"),
}


@pytest.mark.parametrize("case", list(CONFLICTS), ids=list(CONFLICTS))
def test_conflicting_partitioning_is_refused_by_both(cpu_mesh, case):
    names, msg = CONFLICTS[case]
    x = data(B, S, H)
    with jax.set_mesh(fsdp_mesh(cpu_mesh)):
        with pytest.raises(ValueError, match=r"ColumnParallelDense: kernel_init's partitioning .*" + msg):
            ubnn.ColumnParallelDense(H, F, kernel_init=nnx.with_partitioning(LECUN, names), rngs=nnx.Rngs(0))
        with pytest.raises(ValueError, match=r"ColumnParallelDense: kernel_init's partitioning .*" + msg):
            ubl.ColumnParallelDense(F, kernel_init=nn.with_partitioning(LECUN, names)).init(
                jax.random.key(0), x
            )


def test_extra_names_inside_shard_map_are_refused(cpu_mesh):
    mesh = fsdp_mesh(cpu_mesh)

    def build(x):
        ubnn.ColumnParallelDense(
            H, F, kernel_init=nnx.with_partitioning(LECUN, ("fsdp", None)), rngs=nnx.Rngs(0)
        )
        return x

    with pytest.raises(
        ValueError,
        match=r"ColumnParallelDense: kernel_init's partitioning names "
        r"\('fsdp', 'tp'\) .*inside `jax.shard_map` over 'tp'",
    ):
        jax.shard_map(build, mesh=mesh, in_specs=P(), out_specs=P())(data(2))


def test_boxed_init_names_only_the_tp_axis_is_accepted(cpu_mesh):
    """A box that repeats the layer's own names (or none) changes nothing."""
    with jax.set_mesh(cpu_mesh(2)):
        a = ubnn.ColumnParallelDense(
            H, F, kernel_init=nnx.with_partitioning(LECUN, (None, "tp")), rngs=nnx.Rngs(0)
        )
        b = ubnn.ColumnParallelDense(H, F, rngs=nnx.Rngs(0))
        assert param_specs(a) == param_specs(b) == {"kernel": P(None, "tp"), "bias": P("tp")}
    assert_close(pure(a), pure(b), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------
# Shape checks blame the parameter and name the layer.


def assert_both_refused(mesh, mode, col, row, col_msg, row_msg):
    """``col`` called on x `[B, S, H]` and ``row`` on `[B, S, F]`, on global arrays under ``mesh``
    (``mode="global"``) or on local shards inside a ``jax.shard_map`` over it, each raise the
    ValueError its message matches."""
    cases = [
        (col, data(B, S, H), P(None, "tp"), P(None, None, "tp"), col_msg),
        (row, data(B, S, F), P(None, None, "tp"), P(None, "tp"), row_msg),
    ]
    for layer, x, x_spec, out_spec, msg in cases:
        if mode == "global":
            call = lambda layer=layer, x=x: layer(x)  # noqa: E731
        else:
            call = lambda layer=layer, x=x, a=x_spec, b=out_spec: jax.shard_map(  # noqa: E731
                lambda x: layer(x), mesh=mesh, in_specs=a, out_specs=b
            )(x)
        with jax.set_mesh(mesh), pytest.raises(ValueError, match=msg):
            call()


@pytest.mark.parametrize("mode", ["global", "shard_map"])
def test_kernel_in_pytorch_layout_is_blamed(cpu_mesh, mode):
    mesh = cpu_mesh(4)
    hint = r"It is \[out_features, in_features\] \(PyTorch's layout"
    col = ubnn.ColumnParallelDense(H, F, rngs=nnx.Rngs(0))
    col.kernel.set_value(data(F, H))
    row = ubnn.RowParallelDense(F, H, rngs=nnx.Rngs(0))
    row.kernel.set_value(data(H, F))
    got = r".*got kernel.shape=.*" + hint
    assert_both_refused(
        mesh,
        mode,
        col,
        row,
        r"ColumnParallelDense: kernel must be `\[in_features, out_features\]` = \[16, 32\]" + got,
        r"RowParallelDense: kernel must be `\[in_features, out_features\]` = \[32, 16\]" + got,
    )


def test_kernel_is_checked_before_x(cpu_mesh):
    col = ubnn.ColumnParallelDense(H, F, rngs=nnx.Rngs(0))
    col.kernel.set_value(data(F, H))
    with (
        jax.set_mesh(cpu_mesh(2)),
        pytest.raises(
            ValueError,
            match=r"ColumnParallelDense: kernel "
            r"must be .*\[16, 32\]",
        ),
    ):
        col(data(B, S, 12))  # x is wrong too, but against the layer's in_features, not the kernel


@pytest.mark.parametrize("mode", ["global", "shard_map"])
def test_bias_of_the_wrong_length_is_named(cpu_mesh, mode):
    mesh = cpu_mesh(4)
    col = ubnn.ColumnParallelDense(H, F, rngs=nnx.Rngs(0))
    col.bias.set_value(jnp.ones(H))
    row = ubnn.RowParallelDense(F, H, rngs=nnx.Rngs(0))
    row.bias.set_value(jnp.ones(F))
    assert_both_refused(
        mesh,
        mode,
        col,
        row,
        r"ColumnParallelDense: bias must be `\[out_features\]` = \[32\].*got bias.shape=\[16\]",
        r"RowParallelDense: bias must be `\[out_features\]` = \[16\]; got bias.shape=\[32\]",
    )


def test_construction_divisibility_names_the_feature_count(cpu_mesh):
    with jax.set_mesh(cpu_mesh(4)):
        with pytest.raises(
            ValueError,
            match=r"ColumnParallelDense: out_features must be divisible by "
            r"the size of mesh axis 'tp' \(4\); got 30",
        ):
            ubnn.ColumnParallelDense(H, 30, rngs=nnx.Rngs(0))
        with pytest.raises(ValueError, match=r"RowParallelDense: in_features must be divisible .*got 30"):
            ubnn.RowParallelDense(30, H, rngs=nnx.Rngs(0))
        with pytest.raises(ValueError, match=r"ColumnParallelDense: features must be divisible .*got 30"):
            ubl.ColumnParallelDense(30).init(jax.random.key(0), data(B, S, H))
        with pytest.raises(
            ValueError,
            match=r"RowParallelDense: in_features \(x.shape\[-1\]\) must be "
            r"divisible .*got 30",
        ):
            ubl.RowParallelDense(H).init(jax.random.key(0), data(B, S, 30))


# ------------------------------------------------------------------------------------------------
# linen in local mode: whole parameters, as NNX.


@pytest.mark.parametrize("gated", [False, True], ids=["gelu", "swiglu"])
def test_linen_whole_params_inside_user_shard_map(cpu_mesh, gated):
    mesh = cpu_mesh(4, dp=2)
    kw = dict(gated=True, activation=jax.nn.silu) if gated else {}
    model = ubl.ParallelMLP(F, precision=HIGHEST, bias_init=NORMAL, **kw)
    x, ct = data(B, S, H), data(B, S, H, seed=2)
    with jax.set_mesh(mesh):
        params = nn.unbox(jax.jit(model.init)(jax.random.key(0), x))["params"]
    params = jax.device_get(params)  # whole, replicated on every device
    fn = jax.shard_map(
        lambda p, x: model.apply({"params": p}, x),
        mesh=mesh,
        in_specs=(P(), P("dp", "tp")),
        out_specs=P("dp", "tp"),
    )
    got, got_g = value_and_grads(fn, params, x, ct)
    want, want_g = value_and_grads(lambda p, x: plain_mlp(p, x, gated=gated), params, x, ct)
    assert_close(got, want)
    assert_close(got_g, want_g)


def test_linen_local_params_of_another_size_are_refused(cpu_mesh):
    model = ubl.ColumnParallelDense(F)
    params = {"kernel": jnp.ones((H, 8)), "bias": jnp.ones(8)}  # neither F/tp = 16 nor F = 32
    fn = jax.shard_map(
        lambda p, x: model.apply({"params": p}, x),
        mesh=cpu_mesh(2),
        in_specs=(P(), P(None, "tp")),
        out_specs=P(None, None, "tp"),
    )
    with pytest.raises(Exception, match=r"kernel"):
        fn(params, data(B, S, H))


@pytest.mark.parametrize("framework", ["nnx", "linen"])
def test_a_mesh_axis_the_mesh_lacks_is_named_by_both(cpu_mesh, framework):
    """with_partitioning naming an axis the mesh does not have: the layer's own message (linen
    used to end in jax's bare "Resource axis: data ... is not found in mesh")."""
    msg = (
        r"ColumnParallelDense: `kernel` dim 0 .*but the mesh has no axis 'data' \(its axes: \('fsdp', 'tp'\)"
    )
    with jax.set_mesh(fsdp_mesh(cpu_mesh)), pytest.raises(ValueError, match=msg):
        if framework == "nnx":
            ubnn.ColumnParallelDense(
                H, F, kernel_init=nnx.with_partitioning(LECUN, ("data", None)), rngs=nnx.Rngs(0)
            )
        else:
            ubl.ColumnParallelDense(F, kernel_init=nn.with_partitioning(LECUN, ("data", None))).init(
                jax.random.key(0), data(B, S, H)
            )
