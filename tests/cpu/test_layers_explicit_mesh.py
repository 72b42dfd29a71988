"""CPU tier: a layer given ``mesh=`` a mesh with Explicit axes (``jax.make_mesh``'s default), with no
``jax.set_mesh``: ``jax.jit(init)`` and a build under ``nnx.jit`` work and shard the parameters;
an eager gradient, which jax cannot compute on such a mesh, is refused by the layer with a message
that says what to do, and what it says works.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _layer_helpers import HIGHEST, NORMAL, assert_close, data, on_cpu  # noqa: F401
from flax import nnx
from jax.sharding import PartitionSpec as P

from jax_ub import linen as ubl
from jax_ub import nn as ubnn

B, S, H, F = 2, 8, 16, 32


def explicit_mesh(cpu_mesh):
    mesh = cpu_mesh(4, explicit=True)
    assert set(mesh.axis_types) == {jax.sharding.AxisType.Explicit}
    return mesh


def raw(tree):
    """The arrays of linen's boxes (``nn.unbox`` would constrain them with
    ``with_sharding_constraint``, which Explicit axes refuse)."""
    return jax.tree.map(lambda b: b.value, tree, is_leaf=lambda b: isinstance(b, nn.Partitioned))


def plain(kernel, bias, x):
    return jnp.dot(x, kernel, precision=HIGHEST) + bias


def test_linen_jit_init_with_mesh_alone(cpu_mesh):
    mesh = explicit_mesh(cpu_mesh)
    x = data(B, S, H)
    model = ubl.ColumnParallelDense(F, bias_init=NORMAL, precision=HIGHEST, mesh=mesh)
    params = jax.jit(model.init)(jax.random.key(0), x)["params"]
    kernel, bias = raw(params["kernel"]), raw(params["bias"])
    assert kernel.sharding.spec == P(None, "tp") and bias.sharding.spec == P("tp")
    assert kernel.sharding.mesh == mesh
    y = jax.jit(model.apply)({"params": params}, x)
    np.testing.assert_allclose(
        np.asarray(y), np.asarray(plain(np.asarray(kernel), np.asarray(bias), x)), rtol=2e-5, atol=2e-5
    )


def test_nnx_build_under_nnx_jit_with_mesh_alone(cpu_mesh):
    mesh = explicit_mesh(cpu_mesh)
    x = data(B, S, H)
    layer = nnx.jit(
        lambda: ubnn.RowParallelDense(H, F, bias_init=NORMAL, precision=HIGHEST, mesh=mesh, rngs=nnx.Rngs(0))
    )()
    kernel = layer.kernel[...]
    assert kernel.sharding.spec == P("tp", None) and kernel.sharding.mesh == mesh
    y = nnx.jit(lambda m, x: m(x))(layer, x)
    want = plain(np.asarray(kernel), np.asarray(layer.bias[...]), x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("framework", ["nnx", "linen"])
def test_eager_gradient_is_refused_with_what_to_do_and_that_works(cpu_mesh, framework):
    mesh = explicit_mesh(cpu_mesh)
    x, ct = data(B, S, H), data(B, S, F, seed=2)
    if framework == "nnx":
        layer = ubnn.ColumnParallelDense(
            H, F, bias_init=NORMAL, precision=HIGHEST, mesh=mesh, rngs=nnx.Rngs(0)
        )
        graphdef, params = nnx.split(layer, nnx.Param)
        params = nnx.to_pure_dict(params)
        fn = lambda p, x: nnx.merge(graphdef, p)(x)  # noqa: E731
    else:
        model = ubl.ColumnParallelDense(F, bias_init=NORMAL, precision=HIGHEST, mesh=mesh)
        params = raw(model.init(jax.random.key(0), x)["params"])
        fn = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
    loss = lambda p, x: jnp.sum(fn(p, x) * ct)  # noqa: E731
    with pytest.raises(ValueError) as e:
        jax.grad(loss)(params, x)
    msg = str(e.value)
    assert msg.startswith(
        "ColumnParallelDense: differentiated outside `jax.jit` on a mesh with Explicit axes"
    )
    assert "`with jax.set_mesh(mesh):`" in msg and "jax.jit(jax.grad(loss))" in msg
    whole = jax.device_get(params)
    want = jax.grad(lambda p, x: jnp.sum(plain(p["kernel"], p["bias"], x) * ct))(whole, x)
    with jax.set_mesh(mesh):
        eager = jax.grad(loss)(params, x)
    jitted = jax.jit(jax.grad(loss))(params, x)
    assert_close(eager, want)
    assert_close(jitted, want)
