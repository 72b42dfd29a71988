"""CPU tier: the mesh check every CUDA op's operand passes through (jax_ub._mesh_check).

A jax_ub custom call takes its rank from the communicator of the device it runs on, which
``initialize`` numbered by the device's position in *its* mesh; shard_map numbers it by the
program's mesh. The check runs when shard_map's body is lowered and must refuse a program whose
mesh groups or orders the devices otherwise, and must cost nothing (no op) where they agree.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_ub import _mesh_check


@pytest.fixture(autouse=True)
def _on_cpu():
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def _mesh(order, shape=None, names=("tp",)):
    devs = np.array([jax.devices("cpu")[i] for i in order])
    return Mesh(devs.reshape(shape or (len(order),)), names)


def _ids(mesh, axis="tp"):
    return _mesh_check.program_groups(mesh, axis)


def _prog(mesh, groups, axis="tp", specs=None, check_vma=True):
    def body(x):
        return _mesh_check.check(x * 2.0, what="all_gather_matmul", axis=axis, groups=groups) + 1.0

    spec = specs or P(axis)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=check_vma))


def _x(n=8):
    return jax.random.normal(jax.random.key(0), (n, 4))


def test_program_groups_follow_axis_order():
    assert _ids(_mesh([0, 1, 2, 3])) == ((0, 1, 2, 3),)
    assert _ids(_mesh([3, 2, 1, 0])) == ((3, 2, 1, 0),)
    dp_tp = _mesh([0, 1, 2, 3], (2, 2), ("dp", "tp"))
    assert _ids(dp_tp) == ((0, 1), (2, 3))
    assert _ids(dp_tp, "dp") == ((0, 2), (1, 3))
    assert _ids(dp_tp, "model") is None
    assert _ids(jax.sharding.get_abstract_mesh(), "tp") is None  # no devices: nothing to check


def test_same_mesh_passes_and_leaves_no_op():
    mesh = _mesh([0, 1, 2, 3])
    f = _prog(mesh, _ids(mesh))
    x = _x()
    np.testing.assert_array_equal(f(x), x * 2.0 + 1.0)
    hlo = f.lower(x).as_text()
    assert "jax_ub_mesh_check" not in hlo and "custom_call" not in hlo


def test_permuted_device_order_is_refused():
    init = _mesh([0, 1, 2, 3])
    prog = _mesh([1, 0, 2, 3])
    with pytest.raises(
        ValueError,
        match=r"all_gather_matmul: mesh axis 'tp' of this program has the "
        r"device group \[1, 0, 2, 3\].*initialize created the groups "
        r"\[\[0, 1, 2, 3\]\] \(in rank order\).*same order along 'tp'",
    ):
        _prog(prog, _ids(init))(_x())


def test_dp_tp_groups():
    init = _mesh([0, 1, 2, 3], (2, 2), ("dp", "tp"))
    groups = _ids(init)
    # the program may use one TP group of the initialized mesh, or the whole mesh
    _prog(_mesh([2, 3]), groups)(_x())
    _prog(init, groups, specs=P(("dp", "tp")))(_x())
    # a mesh that groups the devices along tp otherwise ((0, 2), (1, 3)) is refused
    transposed = _mesh([0, 2, 1, 3], (2, 2), ("dp", "tp"))
    with pytest.raises(ValueError, match=r"device group \[0, 2\]"):
        _prog(transposed, groups, specs=P(("dp", "tp")))(_x())


def test_under_vmap_grad_and_without_shard_map():
    mesh = _mesh([0, 1, 2, 3])
    groups = _ids(mesh)

    def body(x):
        return jnp.sin(_mesh_check.check(x, what="op", axis="tp", groups=groups))

    f = jax.shard_map(jax.vmap(body), mesh=mesh, in_specs=P(None, "tp"), out_specs=P(None, "tp"))
    xs = jax.random.normal(jax.random.key(1), (3, 8, 2))
    np.testing.assert_allclose(jax.jit(f)(xs), jnp.sin(xs), rtol=1e-6)
    g = jax.jit(jax.grad(lambda x: jnp.sum(f(x))))(xs)
    np.testing.assert_allclose(g, jnp.cos(xs), rtol=1e-6)
    # outside shard_map there is no mesh to compare with: the value passes through
    np.testing.assert_array_equal(
        jax.jit(lambda x: _mesh_check.check(x, what="op", axis="tp", groups=groups))(xs), xs
    )
    # a permuted mesh is refused under vmap and grad too
    bad = jax.shard_map(
        jax.vmap(body), mesh=_mesh([3, 2, 1, 0]), in_specs=P(None, "tp"), out_specs=P(None, "tp")
    )
    with pytest.raises(ValueError, match="device group"):
        jax.jit(jax.grad(lambda x: jnp.sum(bad(x))))(xs)
