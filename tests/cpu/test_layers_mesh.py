"""CPU tier: how the TP layers (NNX and linen) find their mesh, and what they say when they cannot.

* an ``axis_name`` the mesh lacks is the layer's own error, where the layer is built (NNX) or
  initialised (linen), naming the axis and the mesh's axes;
* with no mesh in context, a layer runs on the mesh of its parameters' ``NamedSharding`` (outside
  ``jax.jit``) or, NNX, on the concrete mesh it was built under (under ``nnx.jit`` too);
* under the legacy ``with mesh:`` the error says to use ``jax.set_mesh``.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import pytest
from _layer_helpers import (
    HIGHEST,
    B,
    F,
    H,
    S,
    assert_close,
    data,
    on_cpu,  # noqa: F401  (autouse fixture)
    plain_dense,
    plain_mlp,
    pure,
)
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_ub import linen as ubl
from jax_ub import nn as ubnn

# ------------------------------------------------------------------------------------------------
# axis_name missing from the mesh.

MISSING = r"mesh axis 'model' \(the layer's `axis_name`\) is not an axis of the mesh \(axes \('dp', 'tp'\)\)"


def test_nnx_missing_axis_fails_at_construction(cpu_mesh):
    mesh = cpu_mesh(2, dp=2)
    with jax.set_mesh(mesh):
        for cls, args in (
            (ubnn.ColumnParallelDense, (H, F)),
            (ubnn.RowParallelDense, (F, H)),
            (ubnn.ParallelMLP, (H, F)),
        ):
            with pytest.raises(ValueError, match=cls.__name__ + ": " + MISSING):
                cls(*args, axis_name="model", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="ColumnParallelDense: " + MISSING):  # mesh= outside context
        ubnn.ColumnParallelDense(H, F, axis_name="model", mesh=mesh, rngs=nnx.Rngs(0))


def test_linen_missing_axis_fails_at_init_with_the_layers_error(cpu_mesh):
    x = data(B, S, H)
    with jax.set_mesh(cpu_mesh(2, dp=2)):
        for cls in (ubl.ColumnParallelDense, ubl.ParallelMLP):
            with pytest.raises(ValueError, match=cls.__name__ + ": " + MISSING):
                cls(F, axis_name="model").init(jax.random.key(0), x)
        with pytest.raises(ValueError, match="RowParallelDense: " + MISSING):
            ubl.RowParallelDense(H, axis_name="model").init(jax.random.key(0), data(B, S, F))


def test_missing_axis_at_call_when_built_without_a_mesh(cpu_mesh):
    layer = ubnn.ColumnParallelDense(H, F, axis_name="model", rngs=nnx.Rngs(0))
    with (
        jax.set_mesh(cpu_mesh(2, dp=2)),
        pytest.raises(
            ValueError,
            match=r"ColumnParallelDense: mesh axis 'model' is unknown here \(a mesh with "
            r"axes \('dp', 'tp'\)\)",
        ),
    ):
        layer(data(B, S, H))


@pytest.mark.parametrize(
    "axis_name, hint",
    [
        (("tp",), r"got \('tp',\) \(tuple\)\. Pass 'tp': the layers take one axis name, not a tuple"),
        # (linen turns a list attribute into a tuple)
        (["tp"], r"got (\['tp'\] \(list\)|\('tp',\) \(tuple\))\. Pass 'tp'"),
        (0, r"got 0 \(int\)\.(?! Pass)"),
        (("dp", "tp"), r"got \('dp', 'tp'\) \(tuple\)\.(?! Pass)"),
    ],
)
def test_axis_name_not_a_str_is_the_layers_own_type_error(cpu_mesh, axis_name, hint):
    """Not jax's "axis 0 is out of bounds" (an int) or "('tp',) is not an axis of the mesh (axes
    ('tp',))" (a tuple of one name): the layer says it wants one name, a str."""
    head = r"`axis_name` must be the name \(a str\) of the mesh's tensor-parallel axis, e\.g\. 'tp'; "
    mesh = cpu_mesh(2, dp=2)
    for cls, args in (
        (ubnn.ColumnParallelDense, (H, F)),
        (ubnn.RowParallelDense, (F, H)),
        (ubnn.ParallelMLP, (H, F)),
        (ubnn.LayerNorm, (H,)),
        (ubnn.RMSNorm, (H,)),
    ):
        with pytest.raises(TypeError, match=cls.__name__ + ": " + head + hint):
            cls(*args, axis_name=axis_name, mesh=mesh, rngs=nnx.Rngs(0))
    for module, x in (
        (ubl.ColumnParallelDense(F, axis_name=axis_name, mesh=mesh), data(B, S, H)),
        (ubl.RowParallelDense(H, axis_name=axis_name, mesh=mesh), data(B, S, F)),
        (ubl.ParallelMLP(F, axis_name=axis_name, mesh=mesh), data(B, S, H)),
        (ubl.LayerNorm(axis_name=axis_name, mesh=mesh), data(B, S, H)),
    ):
        with pytest.raises(TypeError, match=type(module).__name__ + ": " + head + hint):
            module.init(jax.random.key(0), x)


# ------------------------------------------------------------------------------------------------
# No mesh in context: the parameters' mesh, or the one the layer was built under.


@pytest.mark.parametrize("call", ["eager", "nnx.jit"])
def test_nnx_built_under_set_mesh_runs_outside_it(cpu_mesh, call):
    mesh = cpu_mesh(2, dp=2)
    x = data(B, S, H)
    with jax.set_mesh(mesh):
        mlp = ubnn.ParallelMLP(
            H, F, precision=HIGHEST, bias_init=nnx.initializers.normal(1.0), rngs=nnx.Rngs(0)
        )
        inside = nnx.jit(lambda m, x: m(x))(mlp, x)
    assert jax.sharding.get_abstract_mesh().empty
    y = mlp(x) if call == "eager" else nnx.jit(lambda m, x: m(x))(mlp, x)
    assert_close(y, plain_mlp(jax.device_get(pure(mlp)), x))
    assert_close(y, inside)
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P("dp", "tp")), 3)


def test_nnx_params_placed_on_a_mesh_by_hand_run_eagerly(cpu_mesh):
    """Built without a mesh; its parameters then put on one: an eager call uses their mesh."""
    mesh = cpu_mesh(4)
    layer = ubnn.RowParallelDense(
        F, H, precision=HIGHEST, bias_init=nnx.initializers.normal(1.0), rngs=nnx.Rngs(0)
    )
    layer.kernel.set_value(jax.device_put(layer.kernel[...], NamedSharding(mesh, P("tp", None))))
    x = data(B, S, F)
    y = layer(x)
    assert_close(y, plain_dense(jax.device_get(pure(layer)), x))
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "tp")), 3)


def test_linen_apply_outside_the_mesh_with_sharded_params(cpu_mesh):
    mesh = cpu_mesh(2, dp=2)
    model = ubl.ParallelMLP(F, precision=HIGHEST, bias_init=nnx.initializers.normal(1.0))
    x = data(B, S, H)
    with jax.set_mesh(mesh):
        variables = jax.jit(model.init)(jax.random.key(0), x)
        specs = nn.get_partition_spec(variables)
    params = jax.tree.map(lambda v, s: jax.device_put(v, NamedSharding(mesh, s)), nn.unbox(variables), specs)
    y = model.apply(params, x)  # no mesh in context, no jit: the kernels' mesh
    assert_close(y, plain_mlp(jax.device_get(params)["params"], x))
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P("dp", "tp")), 3)


def test_no_mesh_anywhere_is_still_an_error():
    layer = ubnn.ColumnParallelDense(H, F, rngs=nnx.Rngs(0))
    with pytest.raises(
        ValueError,
        match=r"ColumnParallelDense: mesh axis 'tp' is unknown here "
        r"\(no mesh\)\..*jax.set_mesh",
    ):
        nnx.jit(lambda m, x: m(x))(layer, data(B, S, H))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # `with mesh:` is deprecated
def test_legacy_with_mesh_says_to_use_set_mesh(cpu_mesh):
    mesh = cpu_mesh(2, dp=2)
    with mesh:
        layer = ubnn.ColumnParallelDense(H, F, rngs=nnx.Rngs(0))
        with pytest.raises(
            ValueError,
            match=r"the legacy `with mesh:` context holds a mesh with axes "
            r"\('dp', 'tp'\), which these layers do not read: use "
            r"`with jax.set_mesh\(mesh\):` instead",
        ):
            layer(data(B, S, H))
