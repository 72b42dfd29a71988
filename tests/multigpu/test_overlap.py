"""Multi-GPU tier, one process driving every local GPU: the CUDA overlap ops against the reference.

Random inputs (never zeros); the device allocator is filled with NaN buffers of the output size and
released right before each call, so an unwritten element shows up as NaN. Every device's buffer of
an output is checked (tests/_checks.py: a replicated output has one copy per device), every element
against its own rounding bound around a float32 reference, plus the relative Frobenius error.
Skipped where the machine has fewer than 2 GPUs.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from tests import _checks  # noqa: E402


def _n_gpus() -> int:
    try:
        return len(jax.devices("cuda"))
    except RuntimeError:
        return 0


pytestmark = pytest.mark.multigpu  # tests/conftest.py skips it without 2 GPUs

TOL = {jnp.bfloat16: 1e-2, jnp.float16: 5e-3, jnp.float32: 1e-5}
# Group sizes of the parametrized tests (each skips where there are fewer GPUs), and the largest
# group the unparametrized ones use: every GPU there is, up to 8 (tp=8 over one NVLink domain).
TPS = (2, 4, 8)
MAX_TP = 8
HP = lax.Precision.HIGHEST


def _no_worse_than_xla(got, xla, exact, what: str) -> None:
    """Low-precision results of a model of several ops (its intermediates rounded too, so no
    element-wise bound applies): jax_ub's error against the float32 run within twice XLA's own
    (the same model in the same dtype) plus 1e-3."""
    for i, (a, b, r) in enumerate(zip(got, xla, exact, strict=True)):
        ours, theirs = _rel(a, r), _rel(b, r)
        assert ours <= 2 * theirs + 1e-3, (what, i, ours, theirs)


def _rel(out, ref) -> float:
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    assert not np.isnan(out).any(), "NaN in output: unwritten (poisoned) elements"
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


@pytest.fixture(scope="module")
def ub():
    import jax_ub

    yield jax_ub
    jax_ub.shutdown()


def _mesh(tp: int, dp: int = 1) -> Mesh:
    devs = np.array(jax.devices("cuda")[: tp * dp]).reshape(dp, tp)
    return Mesh(devs, ("dp", "tp"))


def _need(n):
    if _n_gpus() < n:
        pytest.skip(f"needs {n} GPUs")


def _rand(key, shape, dtype):
    return jax.random.normal(jax.random.key(key), shape, jnp.float32).astype(dtype)


AG_SHAPES = [  # global (M, K, N)
    (1024, 512, 768),
    (6144, 5120, 13824),  # non-powers-of-two
    (512, 1024, 2048),  # small M: M/tp = 128 at tp=4
]


def _ag_case(ub, tp, dtype, M, K, N, method, batch=None):
    mesh = _mesh(tp)
    ub.initialize(mesh, "tp")
    x = _rand(M + K, (M, K) if batch is None else (batch, M, K), dtype)
    w = _rand(N, (K, N), dtype)
    gax = 0 if batch is None else 1
    xspec = P("tp", None) if batch is None else P(None, "tp", None)

    def f(x, w):
        y, xg = ub.all_gather_matmul(
            x, w, "tp", gather_axis=gax, return_gathered=True, method=method, precision=HP
        )
        return y, xg

    y_spec = P(None, "tp") if batch is None else P(None, None, "tp")
    g = jax.jit(
        jax.shard_map(
            f,
            mesh=mesh,
            in_specs=(xspec, P(None, "tp")),
            out_specs=(y_spec, P(*([None] * x.ndim))),
            check_vma=False,
        )
    )
    _checks.poison((M, N // tp) if batch is None else (batch, M, N // tp), dtype, mesh.devices.flat)
    _checks.poison(x.shape, dtype, mesh.devices.flat)  # the gathered input's buffers too
    y, xg = g(x, w)
    want = _checks.matmul_expected(x, w)
    assert _rel(y, want.value) <= TOL[dtype]
    _checks.assert_close(y, want, f"{method} y")
    _checks.assert_equal(xg, x, f"{method} gathered x")  # exact, on every device
    assert "jax_ub_ag_gemm" in g.lower(x, w).as_text()


@pytest.mark.parametrize("method", ["ring", "all_peer", "push", "push_merge"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("tp", TPS, ids=lambda t: f"tp{t}")
@pytest.mark.parametrize("shape", AG_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_all_gather_matmul(ub, tp, dtype, shape, method):
    _need(tp)
    _ag_case(ub, tp, dtype, *shape, method)


def _push_without_gathered(ub, tp, seed, method="push"):
    """Push AG->GEMM whose gathered input nobody uses (the kernel skips the copies into it)."""
    M, K, N = 2048, 1024, 1536
    mesh = _mesh(tp)
    x, w = _rand(seed, (M, K), jnp.bfloat16), _rand(seed + 1, (K, N), jnp.bfloat16)
    g = jax.jit(
        jax.shard_map(
            lambda x, w: ub.all_gather_matmul(x, w, "tp", method=method, precision=HP),
            mesh=mesh,
            in_specs=(P("tp", None), P(None, "tp")),
            out_specs=P(None, "tp"),
            check_vma=False,
        )
    )
    _checks.poison((M, N // tp), jnp.bfloat16, mesh.devices.flat)
    y, want = g(x, w), _checks.matmul_expected(x, w)
    assert _rel(y, want.value) <= TOL[jnp.bfloat16]
    _checks.assert_close(y, want, f"{method} y without the gathered x")


@pytest.mark.parametrize("pieces", [1, 2, 3, 4])
@pytest.mark.parametrize("tp", TPS, ids=lambda t: f"tp{t}")
def test_all_gather_matmul_push_pieces(ub, tp, pieces):
    """Push's last peer chunk in row pieces (kPiece signals) at every piece count, with and
    without the gathered output (3 does not divide 128 local rows: the largest count that does)."""
    _need(tp)
    with ub.config.override(ag_push_pieces=pieces):
        for shape in ((6144, 5120, 13824), (tp * 128, 1024, 768)):
            _ag_case(ub, tp, jnp.bfloat16, *shape, "push")
        _push_without_gathered(ub, tp, 5)


@pytest.mark.parametrize("tp", TPS, ids=lambda t: f"tp{t}")
def test_all_gather_matmul_push_merge(ub, tp):
    """Push with the peers' chunks in at most two GEMMs (JAX_UB_AG_PUSH_MERGE), with and without
    the gathered output, at a non-power-of-two shape and small M; at tp 2 it is plain push."""
    _need(tp)
    with ub.config.override(ag_push_merge=True):
        for shape in ((6144, 5120, 13824), (tp * 128, 1024, 768)):
            for dtype in (jnp.bfloat16, jnp.float32):
                _ag_case(ub, tp, dtype, *shape, "push")
        _push_without_gathered(ub, tp, 7)
    _push_without_gathered(ub, tp, 9, method="push_merge")  # the method, without the knob


@pytest.mark.parametrize("tp", TPS, ids=lambda t: f"tp{t}")
def test_all_gather_matmul_batch_dims(ub, tp):
    """Leading batch dims: the gather axis is moved to the front (an XLA transpose before the op)."""
    _need(tp)
    _ag_case(ub, tp, jnp.bfloat16, 512, 256, 384, "ring", batch=2)


@pytest.mark.parametrize("method", ["ring", "pipeline", "chain", "columns"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("tp", TPS, ids=lambda t: f"tp{t}")
@pytest.mark.parametrize("shape", AG_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matmul_reduce_scatter(ub, tp, dtype, shape, method):
    _need(tp)
    _rs_case(ub, tp, dtype, shape, method)


@pytest.mark.parametrize("split", ["rows", "cols"])
@pytest.mark.parametrize("pieces", [1, 3, 4])
@pytest.mark.parametrize("tp", TPS, ids=lambda t: f"tp{t}")
def test_matmul_reduce_scatter_chain_pieces(ub, tp, pieces, split):
    """The chain's piece signalling at every piece count, in row or column pieces (3 does not
    divide 128-row outputs: the op falls back to the largest count that does; 1000 columns in 3
    or 4 pieces are not 16-byte blocks: rows then)."""
    _need(tp)
    with ub.config.override(rs_chain_pieces=pieces, rs_chain_split=split):
        for shape in ((6144, 5120, 13824), (tp * 128, 1024, 768), (tp * 96, 512, 1000)):
            _rs_case(ub, tp, jnp.bfloat16, shape, "chain")


@pytest.mark.parametrize("pieces", [1, 3, 8])
@pytest.mark.parametrize("tp", TPS, ids=lambda t: f"tp{t}")
def test_matmul_reduce_scatter_column_pieces(ub, tp, pieces):
    """columns at several block counts: 13824 columns in 1, 3 (4608 each) or 8 blocks; 1000
    columns in 8 blocks of 125 are not whole 16-byte vectors, so 5 blocks of 200 then."""
    _need(tp)
    with ub.config.override(rs_column_pieces=pieces):
        for shape in ((6144, 5120, 13824), (tp * 128, 1024, 768), (tp * 96, 512, 1000)):
            _rs_case(ub, tp, jnp.bfloat16, shape, "columns")


def _rs_case(ub, tp, dtype, shape, method):
    M, K, N = shape
    mesh = _mesh(tp)
    ub.initialize(mesh, "tp")
    x = _rand(M * 3 + K, (M, K), dtype)
    w = _rand(N * 5, (K, N), dtype)

    def f(x, w):
        return ub.matmul_reduce_scatter(x, w, "tp", method=method, precision=HP)

    def f_ref(x, w):
        return lax.psum_scatter(jnp.matmul(x, w, precision=HP), "tp", scatter_dimension=0, tiled=True)

    spec = dict(mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P("tp", None), check_vma=False)
    g = jax.jit(jax.shard_map(f, **spec))
    _checks.poison((M // tp, N), dtype, mesh.devices.flat)
    y = g(x, w)
    want = _checks.matmul_expected(x, w, roundings=tp + 1)  # chain: a rounding per hop
    ref = want.value
    err = _rel(y, ref)
    assert err <= TOL[dtype]
    _checks.assert_close(y, want, f"{method} y")
    # fp32 accumulation: no worse than XLA's own psum_scatter of low-precision partials. float32
    # operands: both errors sit at the rounding floor of a float32 reference (XLA's can be below
    # one ulp, as it rounds like the reference), so the chain's other summation order (partial
    # sums added in the GEMM epilogue, world - 1 roundings) gets 4 ulps of slack there.
    xla_err = _rel(jax.jit(jax.shard_map(f_ref, **spec))(x, w), ref)
    slack = 4 * float(jnp.finfo(jnp.float32).eps) if dtype == jnp.float32 else 1e-7
    assert err <= xla_err * 1.05 + slack, (err, xla_err)
    assert "jax_ub_gemm_rs" in g.lower(x, w).as_text()


def check_bare_collectives(ub, mesh, tp) -> None:
    """Every rank's random shard reaches every peer exactly (all-gather), and the reduce-scatter
    sums every rank's contribution, through whatever transport ``mesh``'s axis was initialized
    with (test_nccl_transport.py reuses this)."""
    x = _rand(7, (tp * 384, 1000), jnp.bfloat16)

    def f(x):
        return ub.collectives.all_gather(x, "tp"), ub.collectives.reduce_scatter(x, "tp")

    ag, rs = jax.jit(
        jax.shard_map(f, mesh=mesh, in_specs=P("tp", None), out_specs=(P(), P("tp", None)), check_vma=False)
    )(x)
    _checks.assert_equal(ag, x, "all-gather")  # every device's copy
    # Each rank reduce-scatters its own [384, 1000] shard: the global result is the sum of the
    # tp shards, rows split across ranks.
    want = _checks.sum_expected(x.reshape(tp, 384, 1000), roundings=tp + 1)
    assert _rel(rs, want.value) < 5e-3
    _checks.assert_close(rs, want, "reduce-scatter")


def test_bare_collectives_random_pattern(ub):
    """Every rank's random shard reaches every peer through the copy-engine transport, exactly."""
    tp = min(_n_gpus(), MAX_TP)
    mesh = _mesh(tp)
    ub.initialize(mesh, "tp")
    check_bare_collectives(ub, mesh, tp)


@pytest.mark.parametrize("pieces", [1, 3, 8])
@pytest.mark.parametrize("method", ["ring", "pipeline"])
@pytest.mark.parametrize("tp", TPS, ids=lambda t: f"tp{t}")
def test_reduce_scatter_pieces(ub, tp, method, pieces):
    """The bare reduce-scatter in row pieces (config.rs_pieces), each summed as soon as every
    peer's piece has landed: 383 rows per rank split unevenly (3 and 8 do not divide them) into
    pieces whose rows are 2002 bytes (unaligned sum inputs), and 5 rows per rank (8 pieces are cut
    to 5), in bf16 and float32; every rank's contribution summed, poisoned outputs."""
    _need(tp)
    mesh = _mesh(tp)
    ub.initialize(mesh, "tp")
    spec = dict(mesh=mesh, check_vma=False, in_specs=P("tp", None), out_specs=P("tp", None))
    for dtype, rows, cols in ((jnp.bfloat16, 383, 1001), (jnp.float32, 383, 1001), (jnp.bfloat16, 5, 1000)):
        z = _rand(43 + rows, (tp * tp * rows, cols), dtype)  # each rank's [tp * rows, cols] shard
        with ub.config.override(rs_pieces=pieces):
            got = jax.jit(
                jax.shard_map(lambda z: ub.collectives.reduce_scatter(z, "tp", method=method), **spec)
            )
            assert f"splits = {min(pieces, rows)} : i32" in got.lower(z).as_text()
            _checks.poison((rows, cols), dtype, mesh.devices.flat)
            r = got(z)
        want = _checks.sum_expected(z.reshape(tp, tp * rows, cols), roundings=tp + 1)
        assert _rel(r, want.value) <= (5e-3 if dtype == jnp.bfloat16 else 1e-6), (dtype, rows)
        _checks.assert_close(r, want, f"{method} {dtype.__name__} {rows} rows")


@pytest.mark.parametrize("copy_sms", [0, 8, 100], ids=lambda n: f"copysms{n}")
@pytest.mark.parametrize("method", ["ring", "push"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("tp", TPS, ids=lambda t: f"tp{t}")
def test_bulk_overlap(ub, tp, dtype, method, copy_sms):
    """Bulk forms: the collective under an independent GEMM equals lax + jnp.matmul. copy_sms: the
    all-gather's same-device copies wait for SMs (0), or run as a kernel beside the GEMM's first
    rows, which leave them 8 or 100 SMs (split into two GEMMs of two plans)."""
    _need(tp)
    mesh = _mesh(tp)
    ub.initialize(mesh, "tp")
    if copy_sms:  # the GEMM runs in two parts
        assert _bulk_side_at(copy_sms, 640 * 1000 * jnp.dtype(dtype).itemsize, 4096, 1024, 2048, dtype)[
            1
        ] in range(128, 4096, 128)
    x = _rand(31, (tp * 640, 1000), dtype)  # AG: gathered exactly
    z = _rand(34, (tp * tp * 640, 1000), dtype)  # RS: each rank's [tp*640, 1000] partial sums
    a = _rand(32, (4096, 1024), dtype)
    b = _rand(33, (1024, 2048), dtype)
    spec = dict(mesh=mesh, check_vma=False)

    def f(x, z, a, b):
        g, y1 = ub.bulk_all_gather(x, a, b, "tp", method=method, precision=HP)
        r, y2 = ub.bulk_reduce_scatter(z, a, b, "tp", method="ring", precision=HP)
        return g, y1, r, y2

    def f_ref(x, z, a, b):
        g = lax.all_gather(x, "tp", axis=0, tiled=True)
        r = lax.psum_scatter(z.astype(jnp.float32), "tp", scatter_dimension=0, tiled=True)
        y = jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32), precision=HP)
        return g, y, r, y

    ins = (P("tp", None), P("tp", None), P(), P())
    outs = (P(), P(), P("tp", None), P())
    got = jax.jit(jax.shard_map(f, in_specs=ins, out_specs=outs, **spec))
    ref = jax.jit(jax.shard_map(f_ref, in_specs=ins, out_specs=outs, **spec))
    _checks.poison((tp * 640, 1000), dtype, mesh.devices.flat)
    with ub.config.override(bulk_copy_sms=copy_sms):
        g, y1, r, y2 = got(x, z, a, b)
    rg, ry, rr, _ = ref(x, z, a, b)
    assert _rel(g, rg) == 0.0
    assert _rel(y1, ry) <= TOL[dtype] and _rel(y2, ry) <= TOL[dtype]
    assert _rel(r, rr) <= TOL[dtype]
    _checks.assert_equal(g, x, "bulk all-gather")  # every device's copy
    gemm = _checks.matmul_expected(a, b)
    _checks.assert_close(y1, gemm, "GEMM beside the all-gather")
    _checks.assert_close(y2, gemm, "GEMM beside the reduce-scatter")
    _checks.assert_close(
        r, _checks.sum_expected(z.reshape(tp, tp * 640, 1000), roundings=2), "bulk reduce-scatter"
    )
    assert "jax_ub_bulk" in got.lower(x, z, a, b).as_text()


def _bulk_side_at(copy_sms, *args):
    from jax_ub import config, schedule

    with config.override(bulk_copy_sms=copy_sms):
        return schedule.bulk_side("ag", *args)


@pytest.mark.parametrize("rows,cols", [(3, 5), (640, 1001), (2050, 1001)], ids=lambda v: str(v))
@pytest.mark.parametrize("tp", TPS, ids=lambda t: f"tp{t}")
def test_bulk_all_gather_copy_kernel_odd_sizes(ub, tp, rows, cols):
    """The bulk all-gather's copy kernel (bulk_copy_sms) on shards whose size is not whole 16-byte
    vectors, and whose rows in the gathered output start at 2-byte offsets: the byte path."""
    _need(tp)
    mesh = _mesh(tp)
    ub.initialize(mesh, "tp")
    x = _rand(35, (tp * rows, cols), jnp.bfloat16)
    a = _rand(36, (256, 384), jnp.bfloat16)
    b = _rand(37, (384, 512), jnp.bfloat16)
    spec = dict(mesh=mesh, check_vma=False, in_specs=(P("tp", None), P(), P()), out_specs=(P(), P()))
    with ub.config.override(bulk_copy_sms=8):
        got = jax.jit(jax.shard_map(lambda x, a, b: ub.bulk_all_gather(x, a, b, "tp", precision=HP), **spec))
        _checks.poison((tp * rows, cols), jnp.bfloat16, mesh.devices.flat)
        g, y = got(x, a, b)
    rg, ry = jax.jit(
        jax.shard_map(
            lambda x, a, b: (
                lax.all_gather(x, "tp", axis=0, tiled=True),
                jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32), precision=HP),
            ),
            **spec,
        )
    )(x, a, b)
    assert _rel(g, rg) == 0.0
    assert _rel(y, ry) <= TOL[jnp.bfloat16]
    _checks.assert_equal(g, x, "bulk all-gather")  # every device's copy
    _checks.assert_close(y, _checks.matmul_expected(a, b), "GEMM beside the all-gather")


@pytest.mark.parametrize("tp", TPS, ids=lambda t: f"tp{t}")
def test_execute_builds_no_gemm_plan(ub, tp):
    """Every chunk GEMM's cuBLASLt plan is built (and its kernel loaded) by the trace-time warm-up,
    none inside an op whose peers wait (README: one process driving several GPUs): after compiling,
    running every schedule adds no plan. The shape puts chunk pointers at 16-byte but not 256-byte offsets
    (e.g. AG's y rows at 264 * 196 * 2 bytes), where the plan key once differed from the warm-up's."""
    from jax_ub import _ext

    _need(tp)
    mesh = _mesh(tp)
    ub.initialize(mesh, "tp")
    M, K, N = 1056, 520, 784
    x = _rand(41, (M, K), jnp.bfloat16)  # AG: rows over tp
    w = _rand(42, (K, N), jnp.bfloat16)  # AG: columns over tp
    x2 = _rand(43, (M, K), jnp.bfloat16)  # RS: columns over tp
    w2 = _rand(44, (K, N), jnp.bfloat16)  # RS: rows over tp
    a = _rand(45, (264, K), jnp.bfloat16)
    b = _rand(46, (K, N), jnp.bfloat16)

    def f(x, w, x2, w2, a, b):
        outs = [ub.all_gather_matmul(x, w, "tp", method=m, precision=HP) for m in ("ring", "push")]
        outs += [
            ub.matmul_reduce_scatter(x2, w2, "tp", method=m, precision=HP)
            for m in ("ring", "pipeline", "chain", "columns")
        ]
        for split in ("rows", "cols"):  # the chain's row and column pieces
            with ub.config.override(rs_chain_split=split):
                outs.append(ub.matmul_reduce_scatter(x2, w2, "tp", method="chain", precision=HP))
        outs += list(ub.bulk_all_gather(x, a, b, "tp", precision=HP))
        outs += list(ub.bulk_reduce_scatter(x2, a, b, "tp", precision=HP))
        return outs

    ins = (P("tp", None), P(None, "tp"), P(None, "tp"), P("tp", None), P(), P())
    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=ins, out_specs=P(), check_vma=False))
    args = (x, w, x2, w2, a, b)
    compiled = g.lower(*args).compile()  # traces: the warm-up builds every plan here
    before = _ext.extension().gemm_plan_cache_size()
    host0 = ub.comm.host_stats()
    outs = jax.block_until_ready(compiled(*args))
    after = _ext.extension().gemm_plan_cache_size()
    for i, o in enumerate(outs):  # out_specs P(): each device holds its own rank's result
        for s_ in o.addressable_shards:
            assert not np.isnan(np.asarray(s_.data, np.float32)).any(), (i, s_.device)
    assert after == before, f"{after - before} cuBLASLt plan(s) built at execute time"
    # The host time of every op is counted once per device: as many as the compiled program has
    # overlap custom calls (XLA merges identical ones: here the chain's rows and cols when both
    # splits give the same call).
    n_ops = len(
        re.findall(
            r'custom_call_target="jax_ub_(?:ag_gemm|gemm_rs|bulk|all_gather|'
            r'reduce_scatter)"',
            compiled.as_text(),
        )
    )
    assert 9 <= n_ops <= 10, n_ops
    host1 = ub.comm.host_stats()
    assert sorted(host1) == sorted(host0) and len(host1) == tp, host1
    for key, h in host1.items():
        assert h["ops"] - host0[key]["ops"] == n_ops, (key, n_ops, host0[key], h)
        spent = h["host_s"] - host0[key]["host_s"]
        waited = h["meet_s"] - host0[key]["meet_s"]
        assert 0 < spent < 60 and 0 <= waited <= spent, (key, host0[key], h)


def test_timeline_trace_records_overlap(ub):
    """trace_enable/trace_collect: every chunk's copy and GEMM of one AG call, on every GPU."""
    tp = min(_n_gpus(), MAX_TP)
    mesh = _mesh(tp)
    ub.initialize(mesh, "tp")
    x = _rand(41, (tp * 512, 1024), jnp.bfloat16)
    w = _rand(42, (1024, 1024 * tp), jnp.bfloat16)
    g = jax.jit(
        jax.shard_map(
            lambda x, w: ub.all_gather_matmul(x, w, "tp", method="ring"),
            mesh=mesh,
            in_specs=(P("tp", None), P(None, "tp")),
            out_specs=P(None, "tp"),
            check_vma=False,
        )
    )
    jax.block_until_ready(g(x, w))
    ub.trace.trace_enable(True)
    try:
        jax.block_until_ready(g(x, w))
    finally:
        ub.trace.trace_enable(False)
    recs = ub.trace.trace_collect()
    assert {r["rank"] for r in recs} == set(range(tp))
    for rank in range(tp):
        mine = [r for r in recs if r["rank"] == rank]
        assert sorted(r["chunk"] for r in mine if r["name"] == "gemm") == list(range(tp))
        assert sorted(r["chunk"] for r in mine if r["name"] == "copy") == sorted(set(range(tp)) - {rank})
        assert all(r["start_ms"] <= r["end_ms"] for r in mine)
    assert ub.trace.trace_collect() == []  # collected once
    # op_start_ms: back-to-back calls start later and later on each device, from 0.
    ub.trace.trace_enable(True)
    try:
        jax.block_until_ready([g(x, w) for _ in range(3)])
    finally:
        ub.trace.trace_enable(False)
    recs = ub.trace.trace_collect()
    for dev in {r["device"] for r in recs}:
        starts = {}
        for r in recs:
            if r["device"] == dev:
                starts.setdefault(r["epoch"], r["op_start_ms"])
        seq = [starts[e] for e in sorted(starts)]
        assert len(seq) == 3 and 0.0 <= seq[0] < 0.05 and seq[0] < seq[1] < seq[2], seq


def test_scan_batch_dims_repeated_and_mixed_shapes(ub):
    tp = min(_n_gpus(), MAX_TP)
    mesh = _mesh(tp)
    ub.initialize(mesh, "tp")
    x = _rand(1, (2, 64 * tp, 256), jnp.bfloat16)  # [b, s, h], gathered along s
    w1 = _rand(2, (256, 128 * tp), jnp.bfloat16)
    w2 = _rand(3, (128 * tp, 256), jnp.bfloat16)

    def block(x, w1, w2):
        def step(h, _):
            a = ub.all_gather_matmul(h, w1, "tp", gather_axis=1, method="ring")
            return ub.matmul_reduce_scatter(
                jax.nn.gelu(a), w2, "tp", scatter_axis=1, method="ring"
            ) * 0.05, None

        h, _ = lax.scan(step, x, None, length=3)
        return h

    def block_ref(x, w1, w2):
        def step(h, _):
            a = lax.all_gather(h, "tp", axis=1, tiled=True) @ w1
            return lax.psum_scatter(jax.nn.gelu(a) @ w2, "tp", scatter_dimension=1, tiled=True) * 0.05, None

        h, _ = lax.scan(step, x, None, length=3)
        return h

    spec = dict(
        mesh=mesh,
        in_specs=(P(None, "tp", None), P(None, "tp"), P("tp", None)),
        out_specs=P(None, "tp", None),
        check_vma=False,
    )
    got = jax.jit(jax.shard_map(block, **spec))
    xla = jax.jit(jax.shard_map(block_ref, **spec))
    exact = xla(*(a.astype(jnp.float32) for a in (x, w1, w2)))
    ref = xla(x, w1, w2)
    for _ in range(3):  # repeated calls
        _no_worse_than_xla([got(x, w1, w2)], [ref], [exact], "scan block")


def test_dp_by_tp_mesh(ub):
    _need(4)
    mesh = _mesh(2, dp=2)
    ub.initialize(mesh, "tp")
    x = _rand(11, (4, 256, 512), jnp.bfloat16)  # batch sharded on dp, seq on tp
    w = _rand(12, (512, 384), jnp.bfloat16)

    def f(x, w):
        return ub.all_gather_matmul(x, w, "tp", gather_axis=1, method="ring")

    y = jax.jit(
        jax.shard_map(
            f,
            mesh=mesh,
            in_specs=(P("dp", "tp", None), P(None, "tp")),
            out_specs=P("dp", None, "tp"),
            check_vma=False,
        )
    )(x, w)
    want = _checks.matmul_expected(x, w)
    assert _rel(y, want.value) < 1e-2
    _checks.assert_close(y, want, "dp x tp y")


@pytest.mark.parametrize(
    "remat", [None, "nothing", "dots", "ub_dots"], ids=["saved", "remat", "remat_dots", "remat_ub_dots"]
)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
def test_gradients_through_cuda_path(ub, dtype, remat):
    """Reverse mode through both CUDA ops, also under jax.checkpoint: saving nothing, the backward
    runs the forward's ops again (as nn.remat'ed layers do); so it does with dots_saveable, which
    sees no dot in a custom call; jax_ub.checkpoint_policy(dots_saveable) keeps the ops' named
    outputs, so the backward runs no more ops than without remat."""
    tp = min(_n_gpus(), MAX_TP)
    mesh = _mesh(tp)
    ub.initialize(mesh, "tp")
    x = _rand(21, (128 * tp, 256), dtype)
    w1 = _rand(22, (256, 64 * tp), dtype)
    w2 = _rand(23, (64 * tp, 256), dtype)
    cp = jax.checkpoint_policies
    policy = {
        "nothing": cp.nothing_saveable,
        "dots": cp.dots_saveable,
        "ub_dots": ub.checkpoint_policy(cp.dots_saveable),
    }.get(remat)

    def model(ag, rs, policy=policy):
        def f(x, w1, w2):
            h = ag(x, w1)
            return jnp.sum(rs(jnp.tanh(h), w2).astype(jnp.float32) ** 2)

        if policy is not None:
            f = jax.checkpoint(f, policy=policy)
        return jax.shard_map(
            f,
            mesh=mesh,
            in_specs=(P("tp", None), P(None, "tp"), P("tp", None)),
            out_specs=P(),
            check_vma=False,
        )

    def ops_of(method):
        return (
            lambda x, w: ub.all_gather_matmul(x, w, "tp", method=method, precision=HP),
            lambda x, w: ub.matmul_reduce_scatter(x, w, "tp", method=method, precision=HP),
        )

    cuda = model(*ops_of("ring"))
    ref = model(*ops_of("xla"))
    # The per-device sums differ; compare gradients of the psum-ed loss.
    g1 = jax.jit(jax.grad(lambda *a: cuda(*a).sum(), (0, 1, 2)))(x, w1, w2)
    g2 = jax.jit(jax.grad(lambda *a: ref(*a).sum(), (0, 1, 2)))(x, w1, w2)
    exact = jax.jit(jax.grad(lambda *a: ref(*a).sum(), (0, 1, 2)))(
        *(a.astype(jnp.float32) for a in (x, w1, w2))
    )
    if dtype == jnp.float32:
        for a, b in zip(g1, exact, strict=True):
            assert _rel(a, b) <= 1e-4
    else:
        _no_worse_than_xla(g1, g2, exact, f"gradients, remat {remat}")

    def n_calls(m):  # value_and_grad: the forward's own calls stay (grad alone drops them)
        hlo = jax.jit(jax.value_and_grad(lambda *a: m(*a).sum())).lower(x, w1, w2).as_text()
        return hlo.count("jax_ub_ag_gemm"), hlo.count("jax_ub_gemm_rs")

    got = n_calls(cuda)
    assert min(got) >= 1, got
    saved = n_calls(model(*ops_of("ring"), policy=None))
    # The backward runs on the CUDA path too: AG's dgrad is an RS and RS's dgrad an AG, so the
    # program with both passes holds twice the forward's calls of each (a backward that fell back
    # to XLA would hold only the forward's).
    fwd = jax.jit(lambda *a: model(*ops_of("ring"), policy=None)(*a).sum()).lower(x, w1, w2).as_text()
    assert saved == (2 * fwd.count("jax_ub_ag_gemm"), 2 * fwd.count("jax_ub_gemm_rs")), (
        saved,
        fwd.count("jax_ub_"),
    )
    if remat == "nothing":  # the backward runs the forward's AG and RS again
        assert got[0] > saved[0] and got[1] > saved[1], (got, saved)
    elif remat == "dots":  # AG's output and gathered input are needed, and not kept
        assert got[0] > saved[0], (got, saved)
    elif remat == "ub_dots":
        assert got == saved, (got, saved)


def test_initialize_shutdown_loop_returns_memory(ub, capsys):
    from jax_ub import _ext

    mod = _ext.extension()
    ub.shutdown()
    tp = min(_n_gpus(), MAX_TP)
    mesh = _mesh(tp)
    devs = [d.local_hardware_id for d in mesh.devices.flat]
    before = [mod.device_memory(d)[0] for d in devs]
    for _ in range(20):
        ub.initialize(mesh, "tp", buffer_mib=64)
        ub.shutdown()
    after = [mod.device_memory(d)[0] for d in devs]
    with capsys.disabled():
        print(f"\n20x initialize/shutdown free bytes per GPU before {before} after {after}")
    assert mod.registry_size() == 0
    for b, a in zip(before, after, strict=True):
        assert abs(b - a) <= (4 << 20), (before, after)


def test_jitted_function_is_traced_again_after_shutdown(ub):
    """A jit function traced under one communicator set runs under the set a later initialize()
    creates (shutdown clears JAX's caches); an executable held across the shutdown fails naming
    the freed set instead of touching freed buffers."""
    ub.shutdown()
    n = min(_n_gpus(), MAX_TP)
    mesh = _mesh(n)
    x = _rand(41, (256 * n, 512), jnp.bfloat16)
    w = _rand(42, (512, 128 * n), jnp.bfloat16)
    ref = jnp.matmul(x.astype(jnp.float32), w.astype(jnp.float32), precision=HP)
    x = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("tp", None)))
    w = jax.device_put(w, jax.sharding.NamedSharding(mesh, P(None, "tp")))
    f = jax.jit(
        jax.shard_map(
            lambda x, w: ub.all_gather_matmul(x, w, "tp", method="ring"),
            mesh=mesh,
            in_specs=(P("tp", None), P(None, "tp")),
            out_specs=P(None, "tp"),
            check_vma=False,
        )
    )
    first = ub.initialize(mesh, "tp")
    held = f.lower(x, w).compile()
    assert _rel(f(x, w), ref) <= TOL[jnp.bfloat16]
    ub.shutdown()
    with pytest.raises(ValueError, match="no jax_ub communicator for mesh axis 'tp'"):
        f(x, w)  # traced again: ring needs a communicator
    second = ub.initialize(mesh, "tp")
    assert second.set_id != first.set_id
    _checks.poison((256 * n, 128), jnp.bfloat16, mesh.devices.flat)
    assert _rel(f(x, w), ref) <= TOL[jnp.bfloat16]
    with pytest.raises(
        Exception,
        match=rf"no communicator for device \d+ in set {first.set_id} "
        r"\(was jax_ub.shutdown\(\) called",
    ):
        jax.block_until_ready(held(x, w))
    assert _rel(f(x, w), ref) <= TOL[jnp.bfloat16]  # the failed call left the set usable
    assert ub.comm.errors() == {}


# XLA of jax 0.11.2 died with SIGSEGV compiling the bulk_ag case's program on two H200s (2026-11-24,
# twice, taking the rest of the test run with it): an all-gather beside an empty dot. On that
# jax a dot with an empty result crashes XLA's compiler in a shard_map with an operand split over
# the axis, on CPU too (lab-2026-11:scripts/zero_size_probe.py, 2026-11-25); jax_ub's ops no longer emit one
# (reference._product: the zeros, without a dot), and the lowered text is checked for that below.
@pytest.mark.parametrize("op", ["ag", "rs", "bulk_ag"])
def test_zero_size_operands_give_xla_results(ub, op):
    """An operand with a zero-size dimension leaves nothing to overlap: a CUDA method runs the
    reference instead of a custom call. The cases JAX lowers in shard_map: an output of width 0,
    and a bulk all-gather whose independent GEMM is empty (its gather is not)."""
    n = 2
    mesh = _mesh(n)
    ub.initialize(mesh, "tp")
    x = _rand(51, (128 * n, 64 * n), jnp.bfloat16)
    w = _rand(52, (64 * n, 0), jnp.bfloat16)
    if op == "ag":
        body = lambda x, w: ub.all_gather_matmul(x, w, "tp", method="ring")  # noqa: E731
        specs, out = (P("tp", None), P(None, "tp")), P(None, "tp")
    elif op == "rs":
        body = lambda x, w: ub.matmul_reduce_scatter(x, w, "tp", method="ring")  # noqa: E731
        specs, out = (P(None, "tp"), P("tp", None)), P("tp", None)
    else:  # the gather of a[128 * n, 64] beside an empty GEMM x[0, K] @ w[K, 0]
        a = _rand(53, (128 * n, 64), jnp.bfloat16)
        x = x[:0]
        body = lambda a, x, w: ub.bulk_all_gather(a, x, w, "tp", method="ring")  # noqa: E731
        specs, out = (P("tp", None), P(), P()), (P(), P())
    args = (a, x, w) if op == "bulk_ag" else (x, w)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out, check_vma=False))
    text = f.lower(*args).as_text()
    assert "jax_ub_" not in text and "dot_general" not in text
    got = f(*args)
    if op == "bulk_ag":
        gathered, got = got
        _checks.assert_equal(gathered, a, "gathered beside an empty GEMM")
    assert got.shape == (x.shape[0], 0), got.shape


def test_uninitialized_axis_gives_clear_error(ub):
    ub.shutdown()
    mesh = _mesh(2)
    x = _rand(1, (256, 64), jnp.bfloat16)
    w = _rand(2, (64, 64), jnp.bfloat16)
    f = jax.shard_map(
        lambda x, w: ub.all_gather_matmul(x, w, "tp", method="ring"),
        mesh=mesh,
        in_specs=(P("tp", None), P(None, "tp")),
        out_specs=P(None, "tp"),
        check_vma=False,
    )
    with pytest.raises(ValueError, match="initialize"):
        jax.jit(f)(x, w)


def test_mesh_device_order_must_match_initialize(ub):
    """Each GPU runs a jax_ub op as the rank initialize() gave it, while shard_map numbers it by the
    program's mesh. A mesh that orders the TP devices otherwise is refused when lowered (its shards
    would land in the wrong rows); initialized with that mesh, the same program is right."""
    n = min(_n_gpus(), MAX_TP)
    devs = jax.devices("cuda")[:n]
    fwd, rev = Mesh(np.array(devs), ("tp",)), Mesh(np.array(devs[::-1]), ("tp",))
    x = _rand(31, (128 * n, 64 * n), jnp.bfloat16)
    w = _rand(32, (64 * n, 64 * n), jnp.bfloat16)
    ref = jnp.matmul(x.astype(jnp.float32), w.astype(jnp.float32), precision=HP)

    def ag(mesh):
        return jax.jit(
            jax.shard_map(
                lambda x, w: ub.all_gather_matmul(x, w, "tp", method="ring", precision=HP),
                mesh=mesh,
                in_specs=(P("tp", None), P(None, "tp")),
                out_specs=P(None, "tp"),
                check_vma=False,
            )
        )

    def rs(mesh):
        return jax.jit(
            jax.shard_map(
                lambda x, w: ub.matmul_reduce_scatter(x, w, "tp", method="ring", precision=HP),
                mesh=mesh,
                in_specs=(P(None, "tp"), P("tp", None)),
                out_specs=P("tp", None),
                check_vma=False,
            )
        )

    for init, other in ((fwd, rev), (rev, fwd)):
        ub.initialize(init, "tp")
        for make in (ag, rs):
            assert _rel(make(init)(x, w), ref) <= TOL[jnp.bfloat16]
            with pytest.raises(ValueError, match=r"device group .*initialize created the groups"):
                make(other)(x, w)


def test_uninitialized_axis_auto_refuses_unless_reference_allowed(ub, caplog, monkeypatch):
    """method='auto' on a GPU axis without a communicator raises, naming the missing
    jax_ub.initialize (never a silent slow path); with JAX_UB_ALLOW_REFERENCE it runs XLA's
    collective and dot instead and says once why there is no overlap."""
    from jax_ub.resolve import CudaPathUnavailableError

    ub.shutdown()
    monkeypatch.setattr(ub.comm.lifecycle, "_warned_axes", set())
    mesh = _mesh(2)
    x = _rand(1, (256, 64), jnp.bfloat16)
    w = _rand(2, (64, 96), jnp.bfloat16)

    def build():
        return jax.jit(
            jax.shard_map(
                lambda x, w: ub.all_gather_matmul(x, w, "tp", method="auto", precision=HP),
                mesh=mesh,
                in_specs=(P("tp", None), P(None, "tp")),
                out_specs=P(None, "tp"),
                check_vma=False,
            )
        )

    with pytest.raises(CudaPathUnavailableError, match=r"jax_ub\.initialize\(mesh, axis='tp'\)"):
        build()(x, w)
    with ub.config.override(allow_reference=True):
        f = build()
        with caplog.at_level("WARNING", logger="jax_ub"):
            y = f(x, w)
            f.lower(x, w)  # traced again: no second warning
        text = f.lower(x, w).as_text()
    ref = jnp.matmul(x.astype(jnp.float32), w.astype(jnp.float32), precision=HP)
    assert _rel(y, ref) <= TOL[jnp.bfloat16]
    assert "jax_ub_" not in text
    msgs = [r.getMessage() for r in caplog.records if "no jax_ub communicator" in r.getMessage()]
    assert len(msgs) == 1 and "jax_ub.initialize(mesh, axis='tp')" in msgs[0], msgs


@pytest.mark.parametrize("w_batched", [False, True], ids=["shared_w", "batched_w"])
def test_vmap_over_microbatches(ub, w_batched):
    """jax.vmap over the ops inside shard_map (e.g. microbatches): each element runs as one op,
    forward and backward, equal to the reference under the same vmap."""
    tp = min(_n_gpus(), MAX_TP)
    mesh = _mesh(tp)
    ub.initialize(mesh, "tp")
    B = 3
    x = _rand(41, (B, 128 * tp, 256), jnp.bfloat16)
    w1 = _rand(42, (B, 256, 64 * tp) if w_batched else (256, 64 * tp), jnp.bfloat16)
    w2 = _rand(43, (B, 64 * tp, 256) if w_batched else (64 * tp, 256), jnp.bfloat16)
    wax = 0 if w_batched else None
    lead = (None,) if w_batched else ()

    def model(method):
        def one(x, w1, w2):
            h = ub.all_gather_matmul(x, w1, "tp", method=method, precision=HP)
            return ub.matmul_reduce_scatter(jnp.tanh(h), w2, "tp", method=method, precision=HP)

        body = jax.vmap(one, in_axes=(0, wax, wax))
        return jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P(None, "tp", None), P(*lead, None, "tp"), P(*lead, "tp", None)),
            out_specs=P(None, "tp", None),
            check_vma=False,
        )

    cuda, ref = model("ring"), model("xla")
    f32 = [a.astype(jnp.float32) for a in (x, w1, w2)]
    _checks.poison((B, 128, 256), jnp.bfloat16, mesh.devices.flat)
    y = jax.jit(cuda)(x, w1, w2)
    _no_worse_than_xla([y], [jax.jit(ref)(x, w1, w2)], [jax.jit(ref)(*f32)], "vmap forward")
    text = jax.jit(cuda).lower(x, w1, w2).as_text()
    assert "jax_ub_ag_gemm" in text and "jax_ub_gemm_rs" in text

    def loss(m):
        return lambda *a: jnp.sum(m(*a).astype(jnp.float32) ** 2)

    g1 = jax.jit(jax.grad(loss(cuda), (0, 1, 2)))(x, w1, w2)
    g2 = jax.jit(jax.grad(loss(ref), (0, 1, 2)))(x, w1, w2)
    _no_worse_than_xla(g1, g2, jax.jit(jax.grad(loss(ref), (0, 1, 2)))(*f32), "vmap gradients")
