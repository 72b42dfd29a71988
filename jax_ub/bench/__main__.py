"""``python -m jax_ub.bench ag|rs [--tp 4 2] [--shapes M,K,N ...] [--out DIR]``

For each shape, in one process and one run, the median milliseconds of:

* ``gemm_alone``   cuBLASLt GEMM of the whole local problem on one GPU (AG: x_gathered[M, K] @
  w[K, N/tp]; RS: x[M, K/tp] @ w[K/tp, N]);
* ``comm_nccl``    XLA's own collective alone (``lax.all_gather`` / ``lax.psum_scatter``, NCCL);
* ``comm_jax_ub``  jax_ub's collective alone (copy engine);
* ``xla_plain``    collective then dot in ``shard_map`` (no overlap);
* ``xla_windowed`` the jit-partitioned dot with XLA's windowed-einsum flags;
* ``jax_ub``       the overlapped op (``method="auto"``), plus ``jax_ub_<algo>`` per algorithm.

Timing: warm-up, then ``reps`` repetitions of ``iters`` back-to-back dispatches closed by one
``block_until_ready``; the median per-call time is recorded. Writes
``<out>/<machine>-<yyyymmdd>-<op>.json`` and a PNG bar chart beside it, prints a table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import socket
import statistics
import sys
import time
from typing import Any

DEFAULT_SHAPES = [(8192, 8192, 28672), (8192, 8192, 8192), (16384, 12288, 12288), (2048, 8192, 28672)]
WINDOWED_FLAGS = {
    "xla_gpu_threshold_for_windowed_einsum_mib": 0,
    "xla_gpu_multi_streamed_windowed_einsum": True,
    "xla_gpu_use_memcpy_local_p2p": True,
}


def _progress(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def time_fn(fn, args, *, warmup: int, iters: int, reps: int) -> float:
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = None
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) * 1e3 / iters)
    return statistics.median(samples)


def _machine() -> str:
    try:
        import jax

        kind = jax.devices()[0].device_kind.replace(" ", "_")
        return f"{len(jax.devices())}x{kind}"
    except Exception:
        return socket.gethostname()


def bench_shape(op: str, M: int, K: int, N: int, tp: int, dtype_name: str, a: argparse.Namespace):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_ub
    from jax_ub import overlap

    dtype = jnp.dtype(dtype_name)
    mesh = Mesh(np.array(jax.devices()[:tp]), ("tp",))
    jax_ub.initialize(mesh, "tp")
    key = jax.random.key(M + K + N)
    kx, kw = jax.random.split(key)
    if op == "ag":
        x_shape, w_shape = (M, K), (K, N)
        x_spec, w_spec, y_spec = P("tp", None), P(None, "tp"), P(None, "tp")
    else:
        x_shape, w_shape = (M, K), (K, N)
        x_spec, w_spec, y_spec = P(None, "tp"), P("tp", None), P("tp", None)
    x = jax.device_put(jax.random.normal(kx, x_shape, jnp.float32).astype(dtype), NamedSharding(mesh, x_spec))
    w = jax.device_put(jax.random.normal(kw, w_shape, jnp.float32).astype(dtype), NamedSharding(mesh, w_spec))

    def smap(f, in_specs, out_specs):
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False))

    impls: dict[str, Any] = {}
    dev0 = jax.devices()[0]
    if op == "ag":
        xl = jax.device_put(jax.random.normal(kx, (M, K), jnp.float32).astype(dtype), dev0)
        wl = jax.device_put(jax.random.normal(kw, (K, N // tp), jnp.float32).astype(dtype), dev0)
        impls["gemm_alone"] = (jax.jit(lambda a, b: jax_ub.matmul(a, b, method="cublaslt")), (xl, wl))
        impls["comm_nccl"] = (smap(lambda x: lax.all_gather(x, "tp", tiled=True), (x_spec,), P()), (x,))
        impls["comm_jax_ub"] = (smap(lambda x: overlap.all_gather(x, "tp"), (x_spec,), P()), (x,))
        impls["xla_plain"] = (smap(lambda x, w: lax.all_gather(x, "tp", tiled=True) @ w, (x_spec, w_spec), y_spec), (x, w))
        for m in ("auto", "ring", "all_peer"):
            name = "jax_ub" if m == "auto" else f"jax_ub_{m}"
            impls[name] = (smap(lambda x, w, m=m: jax_ub.all_gather_matmul(x, w, "tp", method=m),
                                (x_spec, w_spec), y_spec), (x, w))
    else:
        xl = jax.device_put(jax.random.normal(kx, (M, K // tp), jnp.float32).astype(dtype), dev0)
        wl = jax.device_put(jax.random.normal(kw, (K // tp, N), jnp.float32).astype(dtype), dev0)
        p = jax.device_put(jax.random.normal(kx, (M * tp, N), jnp.float32).astype(dtype), NamedSharding(mesh, P("tp", None)))
        impls["gemm_alone"] = (jax.jit(lambda a, b: jax_ub.matmul(a, b, method="cublaslt")), (xl, wl))
        impls["comm_nccl"] = (smap(lambda p: lax.psum_scatter(p, "tp", tiled=True), (P("tp", None),), P("tp", None)), (p,))
        impls["comm_jax_ub"] = (smap(lambda p: overlap.reduce_scatter(p, "tp"), (P("tp", None),), P("tp", None)), (p,))
        impls["xla_plain"] = (smap(lambda x, w: lax.psum_scatter(x @ w, "tp", tiled=True), (x_spec, w_spec), y_spec), (x, w))
        for m in ("auto", "ring", "pipeline"):
            name = "jax_ub" if m == "auto" else f"jax_ub_{m}"
            impls[name] = (smap(lambda x, w, m=m: jax_ub.matmul_reduce_scatter(x, w, "tp", method=m),
                                (x_spec, w_spec), y_spec), (x, w))
    # XLA's windowed einsum: the jit-partitioned dot with sharded operands and output.
    try:
        fw = jax.jit(lambda x, w: jnp.dot(x, w), out_shardings=NamedSharding(mesh, y_spec))
        compiled = fw.lower(x, w).compile(compiler_options=WINDOWED_FLAGS)
        impls["xla_windowed"] = (compiled, (x, w))
    except Exception as e:
        _progress(f"xla_windowed unavailable: {type(e).__name__}: {e}")
    out = {}
    for name, (fn, args) in impls.items():
        _progress(f"{op} tp={tp} {M}x{K}x{N} {dtype_name}: {name}")
        try:
            out[name] = time_fn(fn, args, warmup=a.warmup, iters=a.iters, reps=a.reps)
        except Exception as e:
            _progress(f"  {name} failed: {type(e).__name__}: {str(e)[:300]}")
    return out


def plot(records: list[dict], path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _progress("matplotlib missing: no PNG")
        return
    cases = sorted({(r["tp"], r["M"], r["K"], r["N"]) for r in records})
    impls = ["gemm_alone", "comm_nccl", "comm_jax_ub", "xla_plain", "xla_windowed", "jax_ub"]
    fig, ax = plt.subplots(figsize=(max(8, 2.2 * len(cases)), 4.5))
    width = 0.8 / len(impls)
    for j, impl in enumerate(impls):
        vals = [next((r["ms"] for r in records if (r["tp"], r["M"], r["K"], r["N"]) == c and r["impl"] == impl), 0.0)
                for c in cases]
        ax.bar([i + j * width for i in range(len(cases))], vals, width, label=impl)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))])
    ax.set_xticklabels([f"tp{t}\n{M}x{K}x{N}" for t, M, K, N in cases], fontsize=8)
    ax.set_ylabel("ms (median)")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jax_ub.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("op", choices=["ag", "rs"])
    ap.add_argument("--tp", type=int, nargs="+", default=[4, 2])
    ap.add_argument("--shapes", nargs="+", default=None, help="global M,K,N triples")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--machine", default=None)
    a = ap.parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    import jax_ub

    shapes = [tuple(int(v) for v in s.split(",")) for s in a.shapes] if a.shapes else DEFAULT_SHAPES
    machine = a.machine or _machine()
    records = []
    rows = []
    for tp in a.tp:
        if tp > len(jax.devices()):
            _progress(f"skip tp={tp}: only {len(jax.devices())} devices")
            continue
        for M, K, N in shapes:
            if M % tp or K % tp or N % tp:
                _progress(f"skip {M}x{K}x{N}: not divisible by tp={tp}")
                continue
            res = bench_shape(a.op, M, K, N, tp, a.dtype, a)
            jax_ub.shutdown()
            for impl, ms in res.items():
                records.append({"op": "ag_gemm" if a.op == "ag" else "gemm_rs", "M": M, "K": K, "N": N,
                                "tp": tp, "dtype": a.dtype, "impl": impl, "ms": round(ms, 4)})
            rows.append((tp, M, K, N, res))
    date = datetime.date.today().strftime("%Y%m%d")
    os.makedirs(a.out, exist_ok=True)
    stem = os.path.join(a.out, f"{machine}-{date}-{a.op}")
    with open(stem + ".json", "w") as f:
        json.dump({"machine": machine, "date": date, "jax": jax.__version__, "records": records}, f, indent=1)
    plot(records, stem + ".png", f"jax_ub {a.op} ({machine}, {a.dtype})")
    print(f"\nwrote {stem}.json and {stem}.png")
    hdr = "tp  M,K,N               gemm   nccl  ub_comm  xla_plain  windowed  jax_ub  (ring/alt)  speedup  T/T_ideal"
    print(hdr)
    speedups = []
    for tp, M, K, N, r in rows:
        g = lambda k, r=r: r.get(k, float("nan"))  # noqa: E731
        alt = g("jax_ub_all_peer") if a.op == "ag" else g("jax_ub_pipeline")
        ideal = max(g("gemm_alone"), g("comm_jax_ub"))
        sp = g("xla_plain") / g("jax_ub")
        speedups.append(sp)
        print(f"{tp:<3} {M},{K},{N:<10} {g('gemm_alone'):6.3f} {g('comm_nccl'):6.3f} {g('comm_jax_ub'):7.3f} "
              f"{g('xla_plain'):9.3f} {g('xla_windowed'):9.3f} {g('jax_ub'):7.3f}  "
              f"{g('jax_ub_ring'):.3f}/{alt:.3f}  {sp:6.2f}x  {g('jax_ub') / ideal:8.2f}")
    good = [s for s in speedups if s == s]
    if good:
        print(f"geometric mean speedup vs xla_plain: {math.exp(sum(map(math.log, good)) / len(good)):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
