"""Soak: many calls within one ``jax_ub.initialize``, then many initialize/shutdown cycles, with
every result checked and GPU memory, host memory and open file descriptors printed as they go.

    python tools/soak.py                       # 4 processes sharing GPU 0, 1000 calls, 100 cycles
    python tools/soak.py --calls 300 --cycles 30 --nprocs 2

Runs ``--nprocs`` processes (jax.distributed on localhost, all on one GPU: CUDA IPC between
processes on one GPU, NCCL over loopback sockets). Calls: the same random sequence on every process
(a seeded generator) of ``all_gather_matmul`` / ``matmul_reduce_scatter`` with a random method
(every CUDA method and ``auto``), dtype (bfloat16, float32) and shape from a pool (each shape
compiles once; the pool keeps the compile time bounded), each result compared on the host with
a float64 product of the same inputs. Cycles: ``initialize`` / ``shutdown`` of the same mesh, an op
every 10th cycle. Prints ``SOAK`` lines (device memory used, this process's resident memory and
open descriptors; process 0 prints the device's, the others their own) and the verdict: exit 0
when every result was right and the last checkpoints are within the allowed growth of the first
ones after warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SHAPES = [(64, 256, 128), (128, 512, 256), (96, 384, 64), (256, 1024, 512)]  # (m per rank, k, n per rank)
METHODS = ("auto", "ring", "all_peer", "push", "push_merge", "pipeline", "chain", "columns")
DTYPES = ("bfloat16", "float32")
# Allowed growth from the first checkpoint after warm-up to the last: caches (XLA's allocator,
# compiled programs of the shape pool) are full by then.
GPU_SLACK_MIB = 64
RSS_SLACK_MIB = 200
FD_SLACK = 8


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def worker(calls: int, cycles: int, shapes: int) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    rank = int(os.environ["JAX_UB_TEST_RANK"])
    nprocs = int(os.environ["JAX_UB_TEST_NPROCS"])
    jax.distributed.initialize(os.environ["JAX_UB_TEST_COORD"], nprocs, rank)
    import jax_ub
    from jax_ub import _ext
    from jax_ub.comm import bootstrap

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("tp",))
    ex = bootstrap.KVExchange("jax_ub-soak/sync", rank, nprocs, 300.0)
    syncs = iter(range(1 << 30))

    def checkpoint(label: str) -> dict:
        ex.barrier(f"s{next(syncs)}")  # every process at the same point: device memory is comparable
        free, total = _ext.loaded_extension().device_memory(jax.local_devices()[0].local_hardware_id)
        out = {"label": label, "gpu_used_mib": round((total - free) / 2**20), "rss_mib": round(_rss_mib())}
        out["fds"] = _fds()
        print("SOAK " + json.dumps({"rank": rank, **out}), flush=True)
        return out

    funcs = {}

    def op(kind: str, method: str):
        key = (kind, method)
        if key not in funcs:
            if kind == "ag":
                body, ins, out = (
                    lambda x, w: jax_ub.all_gather_matmul(x, w, "tp", method=method),
                    (P("tp", None), P(None, "tp")),
                    P(None, "tp"),
                )
            else:
                body, ins, out = (
                    lambda x, w: jax_ub.matmul_reduce_scatter(x, w, "tp", method=method),
                    (P(None, "tp"), P("tp", None)),
                    P("tp", None),
                )
            funcs[key] = (
                jax.jit(jax.shard_map(body, mesh=mesh, in_specs=ins, out_specs=out, check_vma=False)),
                ins,
            )
        return funcs[key]

    rng = np.random.default_rng(1234)  # the same sequence on every process
    bad = []

    def one_call(i: int) -> None:
        kind = ("ag", "rs")[rng.integers(2)]
        method = METHODS[rng.integers(len(METHODS))]
        dtype = DTYPES[rng.integers(len(DTYPES))]
        m, k, n = SHAPES[rng.integers(shapes)]
        seed = int(rng.integers(1 << 30))
        f, (xs, ws) = op(kind, method)
        r = np.random.default_rng(seed)
        if kind == "ag":
            xf, wf = r.standard_normal((nprocs * m, k)), r.standard_normal((k, nprocs * n))
        else:
            xf, wf = r.standard_normal((nprocs * m, nprocs * k)), r.standard_normal((nprocs * k, n))
        dt = jnp.dtype(dtype)
        xf, wf = (a.astype(dt).astype(np.float64) for a in (xf, wf))  # the inputs as the op sees them
        x = jax.make_array_from_callback(xf.shape, NamedSharding(mesh, xs), lambda idx: xf[idx].astype(dt))
        w = jax.make_array_from_callback(wf.shape, NamedSharding(mesh, ws), lambda idx: wf[idx].astype(dt))
        y = f(x, w)
        want = xf @ wf
        tol = 3e-2 if dtype == "bfloat16" else 2e-3
        for shard in y.addressable_shards:
            got = np.asarray(shard.data, np.float64)
            ref = want[shard.index]
            err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
            if not err <= tol:
                bad.append(f"call {i}: {kind} {method} {dtype} {(m, k, n)}: relative error {err:.2e}")

    t0 = time.time()
    jax_ub.initialize(mesh, "tp")
    marks = []
    for i in range(calls):
        one_call(i)
        if (i + 1) % max(1, calls // 10) == 0:
            marks.append(checkpoint(f"call {i + 1}"))
    jax_ub.shutdown()
    t1 = time.time()
    cyc = []
    for c in range(cycles):
        jax_ub.initialize(mesh, "tp")
        if c % 10 == 0:
            one_call(calls + c)
        jax_ub.shutdown()
        if (c + 1) % max(1, cycles // 10) == 0:
            cyc.append(checkpoint(f"cycle {c + 1}"))
    t2 = time.time()
    verdict = []
    for name, series in (("calls", marks), ("cycles", cyc)):
        if len(series) < 3:
            continue
        first, last = series[1], series[-1]  # after warm-up (the first tenth)
        grew = {
            "gpu_used_mib": last["gpu_used_mib"] - first["gpu_used_mib"],
            "rss_mib": last["rss_mib"] - first["rss_mib"],
            "fds": last["fds"] - first["fds"],
        }
        ok = (
            grew["gpu_used_mib"] <= GPU_SLACK_MIB
            and grew["rss_mib"] <= RSS_SLACK_MIB
            and grew["fds"] <= FD_SLACK
        )
        verdict.append(ok)
        print(
            f"SOAK_SUMMARY rank {rank} {name}: {first['label']} -> {last['label']}: GPU used "
            f"{first['gpu_used_mib']} -> {last['gpu_used_mib']} MiB, RSS {first['rss_mib']} -> "
            f"{last['rss_mib']} MiB, fds {first['fds']} -> {last['fds']}: {'flat' if ok else 'GREW'}",
            flush=True,
        )
    print(
        f"SOAK_SUMMARY rank {rank}: {calls} calls in {t1 - t0:.0f} s ({len(bad)} wrong), {cycles} cycles in "
        f"{t2 - t1:.0f} s",
        flush=True,
    )
    for b in bad[:20]:
        print(f"SOAK_WRONG rank {rank} {b}", flush=True)
    ex.barrier("end")
    if rank == 0:
        time.sleep(1.0)
    return 0 if not bad and all(verdict) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--cycles", type=int, default=100)
    ap.add_argument("--nprocs", type=int, default=4)
    ap.add_argument(
        "--shapes", type=int, default=len(SHAPES), help="how many shapes of the pool the calls use"
    )
    ap.add_argument("--timeout", type=float, default=600.0, help="bound on the whole run (s)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.calls, args.cycles, args.shapes)
    sys.path.insert(0, str(ROOT))
    from tests.launcher import parallel_launch

    env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "JAX_UB_TIMEOUT": "60"}
    results = parallel_launch(
        args.nprocs,
        Path(__file__),
        ["--worker", "--calls", str(args.calls), "--cycles", str(args.cycles), "--shapes", str(args.shapes)],
        env=env,
        timeout_s=args.timeout,
        share_gpus=1,
        fail_fast_s=30,
    )
    ok = True
    for r in results:
        for line in r.stdout.splitlines():
            if line.startswith(("SOAK_SUMMARY", "SOAK_WRONG")) or (line.startswith("SOAK ") and r.rank == 0):
                print(line, flush=True)
        if not r.ok:
            ok = False
            print(f"rank {r.rank}: exit {r.returncode}{' (killed: timeout)' if r.timed_out else ''}")
            print(r.stderr[-3000:])
    print("SOAK: PASS" if ok else "SOAK: FAIL", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
