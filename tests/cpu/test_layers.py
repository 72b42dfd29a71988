"""CPU tier: the TP/SP layers of jax_ub.nn (NNX) and jax_ub.linen against plain unsharded JAX.

Meshes of 2 or 4 forced host devices (tests/conftest.py); everything runs the pure-XLA path.
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
    OUT,
    PLAIN,
    TOL,
    B,
    F,
    H,
    S,
    assert_close,
    data,
    linen_matches,
    nnx_fn,
    nnx_layer,
    on_cpu,  # noqa: F401  (autouse fixture)
    param_specs,
    plain_dense,
    plain_mlp,
    pure,
    randomized,
    value_and_grads,
)
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_ub import linen as ubl
from jax_ub import nn as ubnn

# ------------------------------------------------------------------------------------------------
# Parameters and metadata.


def test_nnx_param_shapes_and_partitioning(cpu_mesh):
    mesh = cpu_mesh(4)
    with jax.set_mesh(mesh):
        mlp = ubnn.ParallelMLP(H, F, rngs=nnx.Rngs(0))
    shapes = jax.tree.map(jnp.shape, pure(mlp))
    assert shapes == {
        "norm": {"scale": (H,), "bias": (H,)},
        "up": {"kernel": (H, F), "bias": (F,)},
        "down": {"kernel": (F, H), "bias": (H,)},
    }
    specs = param_specs(mlp)
    assert specs == {
        "norm": {"scale": P(None), "bias": P(None)},
        "up": {"kernel": P(None, "tp"), "bias": P("tp")},
        "down": {"kernel": P("tp", None), "bias": P(None)},
    }
    # Created sharded under the mesh (Flax eager sharding).
    assert mlp.up.kernel[...].sharding.spec == P(None, "tp")
    assert mlp.down.kernel[...].sharding.spec == P("tp", None)
    assert mlp.up.bias[...].sharding.spec == P("tp")


def test_nnx_builds_without_mesh_and_keeps_metadata():
    layer = ubnn.ColumnParallelDense(H, F, axis_name="model", use_bias=False, rngs=nnx.Rngs(0))
    assert layer.bias is None and layer.kernel[...].shape == (H, F)
    assert nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(layer))) == {"kernel": P(None, "model")}


def test_nnx_param_dtype_and_compute_dtype(cpu_mesh):
    with jax.set_mesh(cpu_mesh(2)):
        layer = ubnn.ColumnParallelDense(H, F, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
        y = nnx.jit(lambda m, x: m(x))(layer, data(B, S, H))
    assert layer.kernel[...].dtype == jnp.float32
    assert y.dtype == jnp.bfloat16


def test_linen_param_shapes_and_partitioning(cpu_mesh):
    with jax.set_mesh(cpu_mesh(4)):
        variables = jax.jit(ubl.ParallelMLP(F).init)(jax.random.key(0), data(B, S, H))
    specs = nn.get_partition_spec(variables)["params"]
    assert specs == {
        "norm": {"scale": P(None), "bias": P(None)},
        "up": {"kernel": P(None, "tp"), "bias": P("tp")},
        "down": {"kernel": P("tp", None), "bias": P(None)},
    }
    shapes = jax.tree.map(jnp.shape, nn.unbox(variables))["params"]
    assert shapes["up"]["kernel"] == (H, F) and shapes["down"]["kernel"] == (F, H)


# ------------------------------------------------------------------------------------------------
# Global arrays + jit (the layer applies shard_map itself) vs plain JAX.


@pytest.mark.parametrize("tp", [1, 2, 4], ids=lambda t: f"tp{t}")
@pytest.mark.parametrize("kind", ["column", "row", "mlp"])
def test_nnx_global_mode_matches_plain(cpu_mesh, kind, tp):
    mesh = cpu_mesh(tp)
    with jax.set_mesh(mesh):
        module = nnx_layer(kind, precision=HIGHEST)
        params = randomized(pure(module))  # non-zero biases, a norm that is not the identity
        x, ct = data(B, S, IN[kind]), data(B, S, OUT[kind], seed=2)
        got, got_g = value_and_grads(nnx_fn(module), params, x, ct)
    want, want_g = value_and_grads(PLAIN[kind], jax.device_get(params), x, ct)
    assert_close(got, want)
    assert_close(got_g, want_g)
    out_spec = {"column": P(None, None, "tp"), "row": P(None, "tp"), "mlp": P(None, "tp")}[kind]
    assert got.sharding.is_equivalent_to(NamedSharding(mesh, out_spec), 3)


@pytest.mark.parametrize("kind", ["column", "row", "mlp"])
def test_linen_global_mode_matches_plain(cpu_mesh, kind):
    cls = {
        "column": lambda: ubl.ColumnParallelDense(F, precision=HIGHEST),
        "row": lambda: ubl.RowParallelDense(H, precision=HIGHEST),
        "mlp": lambda: ubl.ParallelMLP(F, precision=HIGHEST),
    }[kind]
    model = cls()
    x, ct = data(B, S, IN[kind]), data(B, S, OUT[kind], seed=2)
    linen_matches(cpu_mesh(2), model, PLAIN[kind], x, ct, perturb=True)


def test_nnx_and_linen_agree_on_same_params(cpu_mesh):
    x = data(B, S, H)
    with jax.set_mesh(cpu_mesh(2)):
        mlp = ubnn.ParallelMLP(H, F, rngs=nnx.Rngs(3))
        params = pure(mlp)
        y_nnx = nnx.jit(lambda m, x: m(x))(mlp, x)
        y_linen = jax.jit(ubl.ParallelMLP(F).apply)({"params": params}, x)
        # linen's own init gives the same parameter tree structure
        lparams = nn.unbox(jax.jit(ubl.ParallelMLP(F).init)(jax.random.key(0), x))["params"]
    assert jax.tree.structure(lparams) == jax.tree.structure(params)
    np.testing.assert_allclose(np.asarray(y_nnx), np.asarray(y_linen), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("gated", [False, True], ids=["gelu", "swiglu"])
@pytest.mark.parametrize("explicit", [False, True], ids=["auto-axes", "explicit-axes"])
def test_dp_tp_mesh(cpu_mesh, explicit, gated):
    mesh = cpu_mesh(2, dp=2, explicit=explicit)
    x, ct = data(B, S, H), data(B, S, H, seed=2)
    kw = dict(gated=True, activation=jax.nn.silu) if gated else {}
    with jax.set_mesh(mesh):
        mlp = ubnn.ParallelMLP(H, F, precision=HIGHEST, rngs=nnx.Rngs(0), **kw)
        params = pure(mlp)
        xs = jax.device_put(x, NamedSharding(mesh, P("dp", "tp")))
        got, got_g = value_and_grads(nnx_fn(mlp), params, xs, ct)
    want, want_g = value_and_grads(lambda p, x: plain_mlp(p, x, gated=gated), jax.device_get(params), x, ct)
    assert_close(got, want)
    assert_close(got_g, want_g)
    # batch split over dp, sequence over tp: no device holds the whole activation
    assert got.sharding.is_equivalent_to(NamedSharding(mesh, P("dp", "tp")), 3)


def test_mesh_argument_without_context(cpu_mesh):
    mesh = cpu_mesh(2)
    layer = ubnn.RowParallelDense(F, H, mesh=mesh, precision=HIGHEST, rngs=nnx.Rngs(0))
    assert layer.kernel[...].sharding.spec == P("tp", None)
    x = data(B, S, F)
    got = nnx.jit(lambda m, x: m(x))(layer, x)
    np.testing.assert_allclose(got, plain_dense(jax.device_get(pure(layer)), x), **TOL)


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
def test_mesh_argument_without_context_nnx_and_linen_mlp(cpu_mesh, explicit):
    """`mesh=` outside any mesh context, also for a mesh whose axes are Explicit (what
    `jax.make_mesh` builds by default): both frameworks' ParallelMLP equal the plain MLP."""
    mesh = cpu_mesh(4, explicit=explicit)
    x = data(B, S, H)
    mlp = ubnn.ParallelMLP(H, F, mesh=mesh, precision=HIGHEST, rngs=nnx.Rngs(0))
    got = nnx.jit(lambda m, x: m(x))(mlp, x)
    np.testing.assert_allclose(got, PLAIN["mlp"](jax.device_get(pure(mlp)), x), **TOL)
    module = ubl.ParallelMLP(ffn_features=F, mesh=mesh, precision=HIGHEST)
    variables = module.init(jax.random.key(0), x)
    got_l = jax.jit(module.apply)(variables, x)
    params = jax.device_get(
        jax.tree.map(  # no constraint: illegal on Explicit axes
            lambda v: v.unbox(apply_constraint=False) if isinstance(v, nn.Partitioned) else v,
            variables["params"],
            is_leaf=lambda v: isinstance(v, nn.Partitioned),
        )
    )
    np.testing.assert_allclose(got_l, PLAIN["mlp"](params, x), **TOL)


def test_method_is_passed_to_the_primitives(cpu_mesh):
    with jax.set_mesh(cpu_mesh(2)):
        ok = ubnn.ColumnParallelDense(H, F, method="xla", rngs=nnx.Rngs(0))
        assert nnx.jit(lambda m, x: m(x))(ok, data(B, S, H)).shape == (B, S, F)
        bad = ubnn.ColumnParallelDense(H, F, method="bogus", rngs=nnx.Rngs(0))
        with pytest.raises(ValueError, match="method"):
            bad(data(B, S, H))


# ------------------------------------------------------------------------------------------------
# Inside the user's own shard_map (local shards).


@pytest.mark.parametrize("kind", ["column", "row", "mlp"])
def test_nnx_inside_user_shard_map(cpu_mesh, kind):
    mesh = cpu_mesh(4)
    module = nnx_layer(kind, precision=HIGHEST)  # built without a mesh: plain arrays
    params = pure(module)
    specs = param_specs(module)
    x_spec = P(None, None, "tp") if kind == "row" else P(None, "tp")
    out_spec = P(None, None, "tp") if kind == "column" else P(None, "tp")
    fn = jax.shard_map(nnx_fn(module), mesh=mesh, in_specs=(specs, x_spec), out_specs=out_spec)
    x, ct = data(B, S, IN[kind]), data(B, S, OUT[kind], seed=2)
    got, got_g = value_and_grads(fn, params, x, ct)
    want, want_g = value_and_grads(PLAIN[kind], params, x, ct)
    assert_close(got, want)
    assert_close(got_g, want_g)


def test_whole_params_closed_over_in_shard_map_are_sliced(cpu_mesh):
    mesh = cpu_mesh(4)
    mlp = ubnn.ParallelMLP(H, F, precision=HIGHEST, rngs=nnx.Rngs(0))
    x = data(B, S, H)
    fn = jax.jit(jax.shard_map(lambda x: mlp(x), mesh=mesh, in_specs=P(None, "tp"), out_specs=P(None, "tp")))
    np.testing.assert_allclose(fn(x), plain_mlp(pure(mlp), x), **TOL)


def test_linen_inside_user_shard_map(cpu_mesh):
    mesh = cpu_mesh(2, dp=2)
    model = ubl.ParallelMLP(F, precision=HIGHEST)
    x, ct = data(B, S, H), data(B, S, H, seed=2)
    with jax.set_mesh(mesh):
        variables = jax.jit(model.init)(jax.random.key(0), x)
    params, specs = nn.unbox(variables)["params"], nn.get_partition_spec(variables)["params"]
    fn = jax.shard_map(
        lambda p, x: model.apply({"params": p}, x),
        mesh=mesh,
        in_specs=(specs, P("dp", "tp")),
        out_specs=P("dp", "tp"),
    )
    got, got_g = value_and_grads(fn, params, x, ct)
    want, want_g = value_and_grads(plain_mlp, jax.device_get(params), x, ct)
    assert_close(got, want)
    assert_close(got_g, want_g)


def test_init_inside_shard_map_gives_local_shards_of_the_global_init(cpu_mesh):
    mesh = cpu_mesh(2)
    x = data(B, S, H)
    with jax.set_mesh(mesh):
        global_params = nn.unbox(jax.jit(ubl.ParallelMLP(F).init)(jax.random.key(0), x))["params"]
    specs = {
        "up": {"kernel": P(None, "tp"), "bias": P("tp")},
        "down": {"kernel": P("tp", None), "bias": P()},
        "norm": {"scale": P(), "bias": P()},
    }

    def local_init(x):  # nn.unbox would constrain to the spec, which is illegal on manual axes
        variables = ubl.ParallelMLP(F).init(jax.random.key(0), x)
        return jax.tree.map(
            lambda v: v.unbox(apply_constraint=False),
            variables["params"],
            is_leaf=lambda v: isinstance(v, nn.Partitioned),
        )

    init = jax.shard_map(local_init, mesh=mesh, in_specs=P(None, "tp"), out_specs=specs)
    assert_close(jax.jit(init)(x), global_params, rtol=0, atol=0)

    # NNX built inside shard_map: local shapes, same values.
    def build(x):
        m = ubnn.ParallelMLP(H, F, rngs=nnx.Rngs(0))
        assert m.up.kernel[...].shape == (H, F // 2) and m.down.kernel[...].shape == (F // 2, H)
        return pure(m)

    local = jax.jit(jax.shard_map(build, mesh=mesh, in_specs=P(None, "tp"), out_specs=specs))(x)
    assert_close(local, pure(ubnn.ParallelMLP(H, F, rngs=nnx.Rngs(0))), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------
# Row-parallel bias is added once, after the reduce-scatter.


@pytest.mark.parametrize("mode", ["global", "shard_map"])
def test_row_bias_added_once(cpu_mesh, mode):
    mesh = cpu_mesh(4)
    bias = jnp.arange(H, dtype=jnp.float32) + 1.0
    layer = ubnn.RowParallelDense(
        F, H, kernel_init=nnx.initializers.zeros_init(), bias_init=lambda *_: bias, rngs=nnx.Rngs(0)
    )
    x = data(B, S, F)
    if mode == "global":
        with jax.set_mesh(mesh):
            y = nnx.jit(lambda m, x: m(x))(layer, x)
    else:
        y = jax.jit(
            jax.shard_map(
                lambda x: layer(x), mesh=mesh, in_specs=P(None, None, "tp"), out_specs=P(None, "tp")
            )
        )(x)
    np.testing.assert_array_equal(np.asarray(y), np.broadcast_to(bias, (B, S, H)))


# ------------------------------------------------------------------------------------------------
# Errors say what was expected and what was received.


def test_error_sequence_not_divisible(cpu_mesh):
    with jax.set_mesh(cpu_mesh(4)):
        layer = ubnn.ColumnParallelDense(H, F, rngs=nnx.Rngs(0))
        with pytest.raises(ValueError, match=r"sequence length .*divisible .*'tp' \(4\); got 6"):
            layer(data(B, 6, H))


def test_error_wrong_hidden_size(cpu_mesh):
    with jax.set_mesh(cpu_mesh(2)):
        col = ubnn.ColumnParallelDense(H, F, rngs=nnx.Rngs(0))
        with pytest.raises(ValueError, match=r"in_features == 16; got x.shape=\[4, 8, 12\]"):
            col(data(B, S, 12))
        row = ubnn.RowParallelDense(F, H, rngs=nnx.Rngs(0))
        with pytest.raises(ValueError, match=r"in_features == 32; got x.shape=\[4, 8, 16\]"):
            row(data(B, S, 16))
        # [tokens, features] is fine (seq_axis=-2 is the tokens); a lone feature vector is not
        with pytest.raises(
            ValueError,
            match=r"x must be `\[\.\.\., seq, in_features\]`: at least 2 "
            r"dims, the sequence on axis seq_axis=-2",
        ):
            col(data(H))


def test_error_wrong_local_hidden_size_in_shard_map(cpu_mesh):
    layer = ubnn.RowParallelDense(F, H, rngs=nnx.Rngs(0))
    fn = jax.shard_map(
        lambda x: layer(x), mesh=cpu_mesh(2), in_specs=P(None, None, "tp"), out_specs=P(None, "tp")
    )
    with pytest.raises(ValueError, match=r"in_features/tp == 16; got x.shape=\[4, 8, 8\]"):
        fn(data(B, S, H))


def test_error_features_not_divisible(cpu_mesh):
    with jax.set_mesh(cpu_mesh(4)), pytest.raises(ValueError, match=r"divisible .*'tp' \(4\); got 18"):
        ubnn.ColumnParallelDense(H, 18, rngs=nnx.Rngs(0))


def test_error_no_mesh():
    layer = ubnn.ColumnParallelDense(H, F, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"mesh axis 'tp' is unknown here \(no mesh\).*jax.set_mesh"):
        layer(data(B, S, H))


def test_error_mesh_without_the_axis(cpu_mesh):
    layer = ubnn.ColumnParallelDense(H, F, axis_name="model", rngs=nnx.Rngs(0))
    with jax.set_mesh(cpu_mesh(2)), pytest.raises(ValueError, match=r"axes \('tp',\)"):
        layer(data(B, S, H))
