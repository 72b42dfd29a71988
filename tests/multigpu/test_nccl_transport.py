"""Multi-GPU tier, transport nccl, one process driving every local GPU: the same ops as
test_overlap.py, with every byte between GPUs moved by ncclSend/ncclRecv instead of the copy engine.

Random inputs, NaN-poisoned outputs, relative error against a float32 reference. Skips without >= 2
CUDA GPUs or without a loadable NCCL.
"""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from tests import _checks  # noqa: E402
from tests._gpus import nccl  # noqa: E402
from tests.multigpu.test_overlap import (  # noqa: E402
    HP,
    MAX_TP,
    TOL,
    TPS,
    _mesh,
    _n_gpus,
    _need,
    _no_worse_than_xla,
    _rand,
    _rel,
    check_bare_collectives,
)

pytestmark = pytest.mark.multigpu  # tests/conftest.py skips it without 2 GPUs


@pytest.fixture(scope="module")
def ub():
    nccl()  # a GPU machine without a loadable NCCL fails here
    import jax_ub

    jax_ub.shutdown()
    yield jax_ub
    jax_ub.shutdown()


def _init(ub, tp, dp=1):
    mesh = _mesh(tp, dp)
    s = ub.initialize(mesh, "tp", transport="nccl")
    assert s.transport == "nccl"
    return mesh


@pytest.mark.parametrize("tp", TPS, ids=lambda t: f"tp{t}")
def test_random_pattern_through_nccl(ub, tp):
    """Every rank's random shard reaches every peer exactly (all-gather), and the reduce-scatter
    sums every rank's contribution."""
    _need(tp)
    check_bare_collectives(ub, _init(ub, tp), tp)


@pytest.mark.parametrize("return_gathered", [True, False])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("tp", TPS, ids=lambda t: f"tp{t}")
@pytest.mark.parametrize(
    "shape", [(6144, 5120, 13824), (512, 1024, 2048)], ids=lambda s: "x".join(map(str, s))
)
def test_ag_and_rs_over_nccl(ub, tp, dtype, shape, return_gathered):
    _need(tp)
    M, K, N = shape
    mesh = _init(ub, tp)
    x = _rand(M + K, (M, K), dtype)
    w = _rand(N, (K, N), dtype)

    def f(x, w):
        out = ub.all_gather_matmul(x, w, "tp", return_gathered=return_gathered, method="nccl", precision=HP)
        return out if return_gathered else (out, x)

    g = jax.jit(
        jax.shard_map(
            f,
            mesh=mesh,
            in_specs=(P("tp", None), P(None, "tp")),
            out_specs=(P(None, "tp"), P() if return_gathered else P("tp", None)),
            check_vma=False,
        )
    )
    _checks.poison((M, N // tp), dtype, mesh.devices.flat)
    _checks.poison(x.shape, dtype, mesh.devices.flat)
    y, xg = g(x, w)
    want = _checks.matmul_expected(x, w)
    assert _rel(y, want.value) <= TOL[dtype]
    _checks.assert_close(y, want, "nccl AG y")
    _checks.assert_equal(xg, x, "nccl AG gathered x")  # every device's copy
    assert "jax_ub_ag_gemm" in g.lower(x, w).as_text()

    x2 = _rand(M * 3 + K, (M, K), dtype)
    w2 = _rand(N * 5, (K, N), dtype)
    h = jax.jit(
        jax.shard_map(
            lambda x, w: ub.matmul_reduce_scatter(x, w, "tp", method="nccl", precision=HP),
            mesh=mesh,
            in_specs=(P(None, "tp"), P("tp", None)),
            out_specs=P("tp", None),
            check_vma=False,
        )
    )
    _checks.poison((M // tp, N), dtype, mesh.devices.flat)
    y2, want2 = h(x2, w2), _checks.matmul_expected(x2, w2, roundings=tp + 1)
    assert _rel(y2, want2.value) <= TOL[dtype]
    _checks.assert_close(y2, want2, "nccl RS y")


def test_bulk_scan_gradients_and_dp_over_nccl(ub):
    tp = min(_n_gpus(), MAX_TP)
    mesh = _init(ub, tp)
    x = _rand(1, (2, 64 * tp, 256), jnp.bfloat16)
    # Scaled weights: unit-variance ones saturate tanh, and bf16 gradients through a saturated
    # tanh differ by O(1) between any two summation orders (XLA's included).
    w1 = (_rand(2, (256, 128 * tp), jnp.float32) / 16).astype(jnp.bfloat16)
    w2 = (_rand(3, (128 * tp, 256), jnp.float32) / 16).astype(jnp.bfloat16)

    def block(method):
        def f(x, w1, w2):
            def step(h, _):
                a = ub.all_gather_matmul(h, w1, "tp", gather_axis=1, method=method)
                return ub.matmul_reduce_scatter(
                    jnp.tanh(a), w2, "tp", scatter_axis=1, method=method
                ) * 0.5, None

            h, _ = lax.scan(step, x, None, length=2)
            return jnp.sum(h.astype(jnp.float32) ** 2)

        return jax.shard_map(
            f,
            mesh=mesh,
            in_specs=(P(None, "tp", None), P(None, "tp"), P("tp", None)),
            out_specs=P(),
            check_vma=False,
        )

    got = jax.jit(jax.grad(lambda *a: block("auto")(*a).sum(), (0, 1, 2)))
    ref = jax.jit(jax.grad(lambda *a: block("xla")(*a).sum(), (0, 1, 2)))
    r = ref(x, w1, w2)
    exact = ref(*(a.astype(jnp.float32) for a in (x, w1, w2)))
    for _ in range(2):  # repeated calls
        _no_worse_than_xla(got(x, w1, w2), r, exact, "scan gradients over nccl")
    assert "jax_ub_gemm_rs" in got.lower(x, w1, w2).as_text()

    z = _rand(34, (tp * tp * 640, 1000), jnp.bfloat16)
    a = _rand(32, (1536, 768), jnp.bfloat16)
    b = _rand(33, (768, 1280), jnp.bfloat16)

    def fb(x2, z, a, b):
        g, y1 = ub.bulk_all_gather(x2, a, b, "tp", method="nccl", precision=HP)
        rr, y2 = ub.bulk_reduce_scatter(z, a, b, "tp", method="nccl", precision=HP)
        return g, y1, rr, y2

    x2 = _rand(31, (tp * 640, 1000), jnp.bfloat16)
    gb = jax.jit(
        jax.shard_map(
            fb,
            mesh=mesh,
            in_specs=(P("tp", None), P("tp", None), P(), P()),
            out_specs=(P(), P(), P("tp", None), P()),
            check_vma=False,
        )
    )
    _checks.poison((tp * 640, 1000), jnp.bfloat16, mesh.devices.flat)
    g, y1, rr, y2 = gb(x2, z, a, b)
    _checks.assert_equal(g, x2, "nccl bulk all-gather")  # every device's copy
    gemm = _checks.matmul_expected(a, b)
    assert _rel(y1, gemm.value) <= 1e-2 and _rel(y2, gemm.value) <= 1e-2
    _checks.assert_close(y1, gemm, "GEMM beside the nccl all-gather")
    _checks.assert_close(y2, gemm, "GEMM beside the nccl reduce-scatter")
    want = _checks.sum_expected(z.reshape(tp, tp * 640, 1000), roundings=tp + 1)
    assert _rel(rr, want.value) <= 1e-2
    _checks.assert_close(rr, want, "nccl bulk reduce-scatter")

    if _n_gpus() >= 4:
        ub.shutdown()
        mesh = _init(ub, 2, dp=2)
        xd = _rand(11, (4, 256, 512), jnp.bfloat16)
        wd = _rand(12, (512, 384), jnp.bfloat16)
        y = jax.jit(
            jax.shard_map(
                lambda x, w: ub.all_gather_matmul(x, w, "tp", gather_axis=1, method="nccl"),
                mesh=mesh,
                in_specs=(P("dp", "tp", None), P(None, "tp")),
                out_specs=P("dp", None, "tp"),
                check_vma=False,
            )
        )(xd, wd)
        want = _checks.matmul_expected(xd, wd)
        assert _rel(y, want.value) < 1e-2
        _checks.assert_close(y, want, "nccl dp x tp y")


def test_nccl_method_needs_nccl_transport(ub):
    ub.shutdown()
    mesh = _mesh(2)
    ub.initialize(mesh, "tp", transport="ipc")
    x = _rand(1, (256, 64), jnp.bfloat16)
    w = _rand(2, (64, 64), jnp.bfloat16)
    f = jax.shard_map(
        lambda x, w: ub.all_gather_matmul(x, w, "tp", method="nccl"),
        mesh=mesh,
        in_specs=(P("tp", None), P(None, "tp")),
        out_specs=P(None, "tp"),
        check_vma=False,
    )
    with pytest.raises(ValueError, match="transport='nccl'"):
        jax.jit(f)(x, w)
    ub.shutdown()


def test_nccl_initialize_shutdown_loop_returns_memory(ub, capsys):
    from jax_ub import _ext
    from jax_ub.comm import nccl as _nccl

    mod = _ext.extension()
    ub.shutdown()
    tp = min(_n_gpus(), MAX_TP)
    mesh = _mesh(tp)
    devs = [d.local_hardware_id for d in mesh.devices.flat]
    # NCCL keeps some process-wide state after its first communicator: measure from the second.
    ub.initialize(mesh, "tp", transport="nccl", buffer_mib=64)
    ub.shutdown()
    before = [mod.device_memory(d)[0] for d in devs]
    for _ in range(10):
        ub.initialize(mesh, "tp", transport="nccl", buffer_mib=64)
        ub.shutdown()
    after = [mod.device_memory(d)[0] for d in devs]
    with capsys.disabled():
        print(f"\n10x initialize/shutdown (nccl) free bytes per GPU before {before} after {after}")
    assert mod.registry_size() == 0
    assert not [k for k in mod.nccl_comm_list()], mod.nccl_comm_list()
    for b, a in zip(before, after, strict=True):
        assert abs(b - a) <= (64 << 20), (before, after)
    del _nccl
