"""GPU tier: a tensor-parallel axis of size 1 (a dp-only mesh, or one GPU).

There is nothing to gather or scatter, so ``jax_ub.initialize`` creates no communicator (no
registered buffer) and every method, CUDA algorithms included, runs a plain dot: values and
gradients equal XLA's, and the lowered program holds no jax_ub custom call. On a machine with
several GPUs the mesh is ``dp = all GPUs`` by ``tp = 1``, and a set created earlier for a larger
axis of the same name is freed when the axis is initialized again with size 1.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402


def _gpus() -> list:
    try:
        return jax.devices("cuda")
    except RuntimeError:
        return []


pytestmark = pytest.mark.gpu  # tests/conftest.py skips it without a GPU

HP = lax.Precision.HIGHEST
TOL = {jnp.bfloat16: 1e-2, jnp.float32: 1e-5}


@pytest.fixture(scope="module")
def ub():
    import jax_ub

    if not jax_ub.build_info()["cuda_path"]:
        pytest.fail(f"GPU present but jax_ub's CUDA path is inactive: {jax_ub.build_info()['reason']}")
    yield jax_ub
    jax_ub.shutdown()


def _mesh() -> Mesh:
    devs = _gpus()
    return Mesh(np.array(devs).reshape(len(devs), 1), ("dp", "tp"))


def _rel(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert not np.isnan(out).any()
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def _rand(key, shape, dtype):
    return jax.random.normal(jax.random.key(key), shape, jnp.float32).astype(dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize(
    "op,method",
    [
        ("ag", "auto"),
        ("ag", "ring"),
        ("ag", "push"),
        ("ag", "all_peer"),
        ("ag", "push_merge"),
        ("rs", "auto"),
        ("rs", "ring"),
        ("rs", "pipeline"),
        ("rs", "chain"),
        ("rs", "columns"),
    ],
)
def test_every_method_is_a_plain_dot(ub, op, method, dtype):
    mesh = _mesh()
    dp = mesh.shape["dp"]
    assert ub.initialize(mesh, "tp") is None
    assert ub.comm.get("tp") is None
    x = _rand(1, (dp * 256, 384), dtype)
    w = _rand(2, (384, 512), dtype)
    fn = ub.all_gather_matmul if op == "ag" else ub.matmul_reduce_scatter
    spec = dict(mesh=mesh, in_specs=(P(("dp", "tp"), None), P()), out_specs=P(("dp", "tp"), None))
    f = jax.jit(jax.shard_map(lambda x, w: fn(x, w, "tp", method=method, precision=HP), **spec))
    ref = jnp.matmul(x.astype(jnp.float32), w.astype(jnp.float32), precision=HP)
    assert _rel(f(x, w), ref) <= TOL[dtype]
    text = f.lower(x, w).as_text()
    assert "jax_ub_" not in text  # no custom call: XLA's own dot

    def loss(f):
        return lambda x, w: jnp.sum(jnp.sin(f(x, w).astype(jnp.float32)))

    xla = jax.jit(jax.shard_map(lambda x, w: jnp.matmul(x, w, precision=HP), **spec))
    g = jax.jit(jax.grad(loss(f), argnums=(0, 1)))(x, w)
    g_ref = jax.jit(jax.grad(loss(xla), argnums=(0, 1)))(x, w)
    for a, b in zip(g, g_ref, strict=True):
        assert _rel(a, b) <= TOL[dtype]


def test_bulk_ops_on_an_axis_of_size_one(ub):
    mesh = _mesh()
    dp = mesh.shape["dp"]
    ub.initialize(mesh, "tp")
    x = _rand(3, (dp * 64, 96), jnp.bfloat16)
    a, b = _rand(4, (128, 256), jnp.bfloat16), _rand(5, (256, 192), jnp.bfloat16)

    def body(x, a, b):
        g, y1 = ub.bulk_all_gather(x, a, b, "tp", method="ring", precision=HP)
        r, y2 = ub.bulk_reduce_scatter(x, a, b, "tp", method="ring", precision=HP)
        return g, r, y1[None], y2[None]

    xs = P(("dp", "tp"), None)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(xs, P(), P()), out_specs=(xs, xs, xs, xs)))
    g, r, y1, y2 = f(x, a, b)
    assert _rel(g, x) == 0.0
    assert _rel(r, x) == 0.0  # a sum over one device is the input itself
    ref = jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32), precision=HP)
    assert _rel(y1[0], ref) <= TOL[jnp.bfloat16] and _rel(y2[0], ref) <= TOL[jnp.bfloat16]
    assert "jax_ub_" not in f.lower(x, a, b).as_text()


def test_size_one_frees_an_earlier_larger_set(ub):
    """The same axis name first over 2 GPUs (a communicator), then over a size-1 axis: the set is
    freed, and the ops on the new mesh run a plain dot."""
    if len(_gpus()) < 2:
        pytest.skip("needs 2 GPUs for the larger set")
    big = Mesh(np.array(_gpus()[:2]), ("tp",))
    assert ub.initialize(big, "tp") is not None
    assert ub.comm.get("tp") is not None
    assert ub.initialize(_mesh(), "tp") is None
    assert ub.comm.get("tp") is None
