"""Worker of the FP8 overlap-op tests: one process per rank under jax.distributed (ranks may share a
GPU), every schedule of ``jax_ub.overlap.ag_gemm`` / ``gemm_rs`` on float8 operands with their
scales, each rank's result against the float64 product of the dequantized operands.

    python _fp8_worker.py
        (env from tests/launcher.py; JAX_UB_TRANSPORT picks the transport)

Prints ``RESULT <name> <worst relative error>`` lines; exits non-zero on any mismatch.
"""

from __future__ import annotations

import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

nprocs = int(os.environ["JAX_UB_TEST_NPROCS"])
rank = int(os.environ["JAX_UB_TEST_RANK"])
jax.distributed.initialize(os.environ["JAX_UB_TEST_COORD"], nprocs, rank, heartbeat_timeout_seconds=120)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
import _checks  # noqa: E402  (tests/_checks.py)

import jax_ub  # noqa: E402
from jax_ub import overlap  # noqa: E402
from jax_ub.comm import bootstrap as _bootstrap  # noqa: E402

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
# The FP8 tensor cores' accumulation allowance (tests/gpu/test_fp8_gemm.py states it).
ACC = 2.0**-9
mesh = Mesh(np.array(jax.devices()), ("tp",))
tp = mesh.shape["tp"]
cs = jax_ub.initialize(mesh, "tp", timeout_s=float(os.environ.get("JAX_UB_TIMEOUT", "60")))
print(f"RESULT transport {cs.transport}", flush=True)
ex = _bootstrap.KVExchange("jax_ub-test/fp8", rank, nprocs, 60.0)
failed = False


def fp8_array(seed, shape, dtype, spec):
    """A random float8 array (normal * 8, over the format's range) sharded by ``spec``, and its
    host copy as float64."""
    q = np.asarray((jax.random.normal(jax.random.key(seed), shape, jnp.float32) * 8.0).astype(dtype))
    arr = jax.make_array_from_callback(shape, NamedSharding(mesh, spec), lambda idx: q[idx])
    return arr, q.astype(np.float64)


def scales(seed, n, spec):
    """``n`` random float32 scales in [0.01, 1) (one per rank with spec P("tp"))."""
    s = np.asarray(jax.random.uniform(jax.random.key(seed), (n,), jnp.float32, 0.01, 1.0))
    return jax.make_array_from_callback((n,), NamedSharding(mesh, spec), lambda idx: s[idx]), s.astype(
        np.float64
    )


def expected(value, scale, out, roundings=1, k=0):
    eps = float(jnp.finfo(out).eps)
    bound = (roundings * eps + ACC + 2 * k * float(np.finfo(np.float32).eps)) * scale
    return _checks.Expected(value, bound + float(np.finfo(np.float32).tiny))


def check(name, arr, want):
    """Every shard this process holds within its element-wise bound; RESULT is the worst relative
    Frobenius error."""
    global failed
    worst = 0.0
    for shard in arr.addressable_shards:
        got = np.asarray(shard.data, np.float64)
        ref = want.value[shard.index]
        worst = max(worst, float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)))
    print(f"RESULT {name} {worst:.3e}", flush=True)
    try:
        _checks.assert_close(arr, want, name)
    except AssertionError as e:
        print(f"FAILED {e}", flush=True)
        failed = True


def smap(f, in_specs, out_specs):
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False))


m, k, n = 96, 256, 160  # per rank: x rows (AG), inner dim, output columns
ipc = cs.transport == "ipc"
ag_cases = [
    ("ring", {}),
    ("all_peer", {}),
    ("push", {}),
    ("push", dict(ag_push_pieces=2)),
    ("push_merge", {}),
]
rs_cases = [
    ("ring", {}),
    ("pipeline", {}),
    ("chain", {}),
    ("chain", dict(rs_chain_split="cols")),
    ("columns", {}),
]
if not ipc:  # the NCCL schedule runs whatever is named
    ag_cases, rs_cases = [("ring", {})], [("ring", {})]
pairs = [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3)]

for i, (method, over) in enumerate(ag_cases):
    for j, out in enumerate((jnp.bfloat16, jnp.float32)):
        dx, dw = pairs[(i + j) % len(pairs)]
        seed = 100 * i + 10 * j
        x8, xf = fp8_array(seed + 1, (tp * m, k), dx, P("tp", None))
        w8, wf = fp8_array(seed + 2, (k, tp * n), dw, P(None, "tp"))
        xs, xsf = scales(seed + 3, 1, P())  # one x scale for every rank (the gathered rows share it)
        ws, wsf = scales(seed + 4, tp, P("tp"))  # each rank's own w block scale
        x_full = xf * xsf[0]
        w_full = wf * np.repeat(wsf, n)[None, :]

        def ag(x, w, a, b, m_=method, out_=out):
            return overlap.ag_gemm(
                x,
                w,
                axis_name="tp",
                axis=0,
                precision=None,
                method=m_,
                need_full=True,
                x_scale=a.reshape(()),
                w_scale=b.reshape(()),
                out_dtype=out_,
            )

        with jax_ub.config.override(**over):
            f = smap(ag, (P("tp", None), P(None, "tp"), P(), P("tp")), (P(None, "tp"), P()))
            _checks.poison((tp * m, n), out, jax.local_devices())
            y, xg = f(x8, w8, xs, ws)
        tag = (
            f"fp8_ag_{method}{'_' + '_'.join(map(str, over.values())) if over else ''}_{jnp.dtype(out).name}"
        )
        check(tag, y, expected(x_full @ w_full, np.abs(x_full) @ np.abs(w_full), out, k=k))
        # The gathered x is the float8 bytes, bit for bit.
        try:
            assert xg.dtype == jnp.dtype(dx), (xg.dtype, dx)
            for shard in xg.addressable_shards:  # every device's copy, every element
                got = np.asarray(shard.data).astype(np.float64)
                bad = int((got != xf[shard.index]).sum())
                assert bad == 0, f"{tag} gathered x on {shard.device}: {bad} elements differ"
            print(f"RESULT {tag}_gathered exact", flush=True)
        except AssertionError as e:
            print(f"FAILED {e}", flush=True)
            failed = True

for i, (method, over) in enumerate(rs_cases):
    for j, out in enumerate((jnp.bfloat16, jnp.float32)):
        dx, dw = pairs[(i + j + 1) % len(pairs)]
        seed = 1000 + 100 * i + 10 * j
        M = tp * m
        x8, xf = fp8_array(seed + 1, (M, tp * k), dx, P(None, "tp"))  # rank r: columns r*k..
        w8, wf = fp8_array(seed + 2, (tp * k, n), dw, P("tp", None))  # rank r: rows r*k..
        xs, xsf = scales(seed + 3, tp, P("tp"))  # each rank's own scales
        ws, wsf = scales(seed + 4, tp, P("tp"))
        parts = [
            (xf[:, r * k : (r + 1) * k] * xsf[r]) @ (wf[r * k : (r + 1) * k] * wsf[r]) for r in range(tp)
        ]
        absum = sum(
            np.abs(xf[:, r * k : (r + 1) * k] * xsf[r]) @ np.abs(wf[r * k : (r + 1) * k] * wsf[r])
            for r in range(tp)
        )

        def rs(x, w, a, b, m_=method, out_=out):
            return overlap.gemm_rs(
                x,
                w,
                axis_name="tp",
                axis=0,
                precision=None,
                method=m_,
                x_scale=a.reshape(()),
                w_scale=b.reshape(()),
                out_dtype=out_,
            )[0]

        with jax_ub.config.override(**over):
            f = smap(rs, (P(None, "tp"), P("tp", None), P("tp"), P("tp")), P("tp", None))
            _checks.poison((m, n), out, jax.local_devices())
            y = f(x8, w8, xs, ws)
        tag = (
            f"fp8_rs_{method}{'_' + '_'.join(map(str, over.values())) if over else ''}_{jnp.dtype(out).name}"
        )
        # Partials (and the chain's partial sums) travel in the output dtype: one rounding a hop.
        check(tag, y, expected(sum(parts), absum, out, roundings=tp + 1, k=k))

# The public op on float8 operands with scales, where it dispatches to this CUDA path.
try:
    x8, xf = fp8_array(7, (tp * m, k), E4M3, P("tp", None))
    w8, wf = fp8_array(8, (k, tp * n), E4M3, P(None, "tp"))
    xs, ws = jnp.float32(0.25), jnp.float32(0.5)
    f = smap(
        lambda x, w: jax_ub.all_gather_matmul(x, w, "tp", method="ring", scales=(xs, ws)),
        (P("tp", None), P(None, "tp")),
        P(None, "tp"),
    )
    y = f(x8, w8)
    xd, wd = xf * 0.25, wf * 0.5
    check(
        "fp8_public_all_gather_matmul_ring", y, expected(xd @ wd, np.abs(xd) @ np.abs(wd), jnp.bfloat16, k=k)
    )
except Exception as e:  # the public FP8 API is another module's; report, do not hide
    print(f"FAILED public all_gather_matmul(scales=...): {type(e).__name__}: {str(e)[:300]}", flush=True)
    failed = True

ex.barrier("done")
jax_ub.shutdown()
ex.barrier("shutdown")
if rank == 0:
    time.sleep(1.0)
jax.distributed.shutdown()
sys.exit(1 if failed else 0)
