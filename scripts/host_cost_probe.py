"""Host time per op (the FFI handlers' enqueueing, jax_ub.comm.host_stats) at a world size larger
than the GPUs at hand: WORLD processes, one rank each, sharing the GPUs round robin (CUDA IPC works
between processes on one GPU). The GPU times such a run gives mean nothing; the host calls each op
makes are those of WORLD ranks on WORLD GPUs, minus one process's threads contending (one process
driving several GPUs adds that).

    python3 scripts/host_cost_probe.py WORLD [REPS] [LABEL]

Every dispatch (CHAIN ops) is waited for before the next, so no enqueue blocks on a full queue.
Prints per impl the median over ranks of host us per op, and checks each output against
XLA's (bf16 rel. error), so that a variant that enqueues less but computes something else shows.
Used with two builds installed side by side (PYTHONPATH=<site of build A or B>) to A/B a change of
the enqueue path; LABEL names the build in the lines.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

CHAIN = 4
M_PER_RANK, K, N_PER_RANK = 256, 1024, 256


def child() -> int:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # ranks share a GPU
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    nprocs = int(os.environ["JAX_UB_TEST_NPROCS"])
    rank = int(os.environ["JAX_UB_TEST_RANK"])
    jax.distributed.initialize(os.environ["JAX_UB_TEST_COORD"], nprocs, rank,
                               heartbeat_timeout_seconds=120)
    import jax_ub
    from jax_ub import _bootstrap, overlap
    from jax_ub.bench.harness import chain_fn

    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    mesh = Mesh(np.array(jax.devices()), ("tp",))
    tp = mesh.shape["tp"]
    jax_ub.initialize(mesh, "tp")
    ex = _bootstrap.KVExchange("host-cost-probe", rank, nprocs, 120.0)

    def arr(seed, shape, spec, scale=1.0):
        full = np.asarray(jax.random.normal(jax.random.key(seed), shape, jnp.float32) * scale,
                          jnp.bfloat16)
        return jax.make_array_from_callback(shape, NamedSharding(mesh, spec), lambda i: full[i])

    def smap(f, ins, outs):
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=ins, out_specs=outs, check_vma=False))

    cuda = jax_ub.build_info()["extension_loaded"]
    M, N = M_PER_RANK * tp, N_PER_RANK * tp
    x_ag, w_ag = arr(1, (M, K), P("tp", None)), arr(2, (K, N), P(None, "tp"), 0.03)
    x_rs, w_rs = arr(3, (M, K), P(None, "tp")), arr(4, (K, N), P("tp", None), 0.03)
    ag_specs, rs_specs = (P("tp", None), P(None, "tp")), (P(None, "tp"), P("tp", None))

    def ag(method):
        return smap(lambda x, w: jax_ub.all_gather_matmul(x, w, "tp", method=method if cuda else "xla"),
                    ag_specs, P(None, "tp")), (x_ag, w_ag), "ag_xla"

    def rs(method):
        return smap(lambda x, w: jax_ub.matmul_reduce_scatter(x, w, "tp", method=method if cuda else "xla"),
                    rs_specs, P("tp", None)), (x_rs, w_rs), "rs_xla"

    impls = {
        "ag_xla": (smap(lambda x, w: lax.all_gather(x, "tp", tiled=True) @ w, ag_specs,
                        P(None, "tp")), (x_ag, w_ag), None),
        "rs_xla": (smap(lambda x, w: lax.psum_scatter(x @ w, "tp", tiled=True), rs_specs,
                        P("tp", None)), (x_rs, w_rs), None),
        "ag_bare": (smap(lambda x: overlap.all_gather(x, "tp"), (P("tp", None),), P()), (x_ag,),
                    None),
        "ag_push": ag("push"), "ag_ring": ag("ring"), "ag_all_peer": ag("all_peer"),
        "rs_ring": rs("ring"), "rs_pipeline": rs("pipeline"),
    }
    if not cuda:  # the CPU smoke run of this script: the methods ran as "xla", no bare op
        del impls["ag_bare"]
    refs = {}
    for name, (fn, args, ref) in impls.items():
        prog = chain_fn(fn, CHAIN)
        for _ in range(3):
            out = jax.block_until_ready(prog(*args))
        got = np.concatenate([np.asarray(s.data, np.float32).ravel()
                              for s in out[-1].addressable_shards])
        refs[name] = got
        err = ""
        if ref is not None:
            want = refs[ref]
            err = f" rel_err {np.linalg.norm(got - want) / np.linalg.norm(want):.2e}"
        ex.barrier(f"warm-{name}")
        h0 = jax_ub.comm.host_stats()
        t0 = time.perf_counter()
        for _ in range(reps):
            jax.block_until_ready(prog(*args))
        wall = (time.perf_counter() - t0) * 1e6 / reps / CHAIN
        h1 = jax_ub.comm.host_stats()
        host = ""
        for key, h in h1.items():
            ops = h["ops"] - h0[key]["ops"]
            if ops:
                host = f" host_us {(h['host_s'] - h0[key]['host_s']) / ops * 1e6:.1f} ops {ops}"
        print(f"RESULT {name} wall_us {wall:.1f}{host}{err}", flush=True)
    ex.barrier("done")
    jax_ub.shutdown()
    ex.barrier("shutdown")
    if rank == 0:
        time.sleep(1.0)
    jax.distributed.shutdown()
    return 0


def parent() -> int:
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
    sys.path.insert(0, os.path.join(root, "tests"))
    from launcher import format_failures, parallel_launch

    world = int(sys.argv[1])
    reps = sys.argv[2] if len(sys.argv) > 2 else "200"
    label = sys.argv[3] if len(sys.argv) > 3 else ""
    import subprocess
    try:
        ngpu = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.count("GPU ")
    except OSError:  # no NVIDIA driver: the CPU path (reference ops, no host times)
        ngpu = 1
    results = parallel_launch(world, os.path.abspath(__file__), ["child", reps],
                              share_gpus=max(1, min(ngpu, world)), timeout_s=300, fail_fast_s=20)
    if not all(r.ok for r in results):
        print(format_failures(results))
        return 1
    rows: dict[str, dict[str, list[float]]] = {}
    errs: dict[str, list[str]] = {}
    for r in results:
        for line in r.stdout.splitlines():
            if not line.startswith("RESULT "):
                continue
            f = line.split()
            vals = dict(zip(f[2::2], f[3::2]))
            row = rows.setdefault(f[1], {})
            for k in ("wall_us", "host_us"):
                if k in vals:
                    row.setdefault(k, []).append(float(vals[k]))
            if "rel_err" in vals:
                errs.setdefault(f[1], []).append(vals["rel_err"])
    for name, row in rows.items():
        host = row.get("host_us")
        h = (f"host us/op median {statistics.median(host):7.1f} (ranks {min(host):.1f}-{max(host):.1f})"
             if host else "host us/op -")
        e = f"  rel_err {max(errs[name])}" if name in errs else ""
        print(f"{label} world {world} {name:12s} {h}  wall us/op {statistics.median(row['wall_us']):8.1f}{e}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(child() if len(sys.argv) > 1 and sys.argv[1] == "child" else parent())
