"""One process of the fault-injection matrix (``tools/fault_matrix.py``; started by tests/launcher.py).

Every process runs the same program: initialize, an op, the first trace of a larger op (buffers
grow collectively), an op on a compiled shape, another one with a fault in flight, shutdown. One
process (``FAULT_RANK``) injects ``FAULT_KIND`` at ``FAULT_PHASE``; the others must each end with a
jax_ub error naming it, in time. Like a program that follows README's pattern, a process prints
the error and exits (``os._exit``), process 0 a moment later (it hosts jax.distributed's service,
which the others may still be reading).

Environment: ``FAULT_KIND`` (exit: sys.exit(0); kill: SIGKILL; stall: sleeps ``JAX_UB_TIMEOUT`` +
10 s, then exits; raise: an uncaught exception), ``FAULT_PHASE`` (before_init, during_init,
first_trace, between_ops, mid_op, shutdown, or none), ``FAULT_RANK`` (default: the last),
``FAULT_BACKEND`` (cpu: a stand-in extension on stand-in GPUs, so that jax_ub's host side runs
for real over jax.distributed; gpu: the CUDA extension, every process on the GPU it sees).

Prints ``RESULT <json>`` lines: ``{"event": "phase"|"fault"|"error"|"done", "t": time.time(), ...}``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time

import numpy as np

rank = int(os.environ["JAX_UB_TEST_RANK"])
nprocs = int(os.environ["JAX_UB_TEST_NPROCS"])
KIND = os.environ.get("FAULT_KIND", "none")
PHASE = os.environ.get("FAULT_PHASE", "none")
FAULTY = int(os.environ.get("FAULT_RANK", nprocs - 1))
BACKEND = os.environ.get("FAULT_BACKEND", "cpu")
T = float(os.environ.get("JAX_UB_TIMEOUT", "5"))


def report(event: str, **kw) -> None:
    print("RESULT " + json.dumps({"event": event, "t": time.time(), **kw}), flush=True)


def fault() -> None:
    report("fault", kind=KIND, phase=PHASE)
    sys.stdout.flush()
    sys.stderr.flush()
    if KIND == "exit":
        sys.exit(0)
    if KIND == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if KIND == "stall":
        time.sleep(T + 10)
        os._exit(0)
    if KIND == "raise":
        raise RuntimeError(f"injected fault: process {rank} raised at {PHASE}")
    raise SystemExit(f"unknown FAULT_KIND {KIND!r}")


def at(phase: str) -> None:
    if rank == FAULTY and phase == PHASE:
        fault()


import jax  # noqa: E402

jax.distributed.initialize(
    os.environ["JAX_UB_TEST_COORD"],
    nprocs,
    rank,
    initialization_timeout=120,
    heartbeat_timeout_seconds=100,
    # A process that exits cleanly waits this long for its peers in jax's shutdown barrier, after
    # which jax's service ends every process: longer than the survivors take to report.
    shutdown_timeout_seconds=int(T) + 20,
)
# As any program does before its mesh exists: start the backend (on CPU with several processes,
# a rendezvous inside jax, which jax_ub's timeout does not bound: a peer missing here is jax's).
jax.devices()

import jax_ub  # noqa: E402
from jax_ub import _ext  # noqa: E402
from jax_ub.comm import bootstrap as _bootstrap  # noqa: E402
from jax_ub.comm import lifecycle  # noqa: E402


def step(name: str, fn) -> None:
    """Runs one phase; on an error, reports it (with jax_ub's reason where the error is XLA's)
    and exits: a program cannot go on without its peers."""
    report("phase", phase=name)
    # A survivor still in this phase long after the bound prints every thread's stack (where it
    # waits), then goes on waiting: the matrix counts it as a hang.
    faulthandler.dump_traceback_later(T + 15, exit=False)
    try:
        fn()
    except BaseException as err:  # reported, then this process ends
        msg = f"{type(err).__name__}: {err}"
        try:
            jax_ub.comm.raise_if_failed(err)
        except Exception as reason:
            msg = f"{type(reason).__name__}: {reason}"
        faulthandler.cancel_dump_traceback_later()
        report("error", phase=name, error=msg[:3000])
        sys.stdout.flush()
        sys.stderr.flush()
        if rank == 0:
            time.sleep(3.0)
        os._exit(1)
    faulthandler.cancel_dump_traceback_later()


if BACKEND == "cpu":

    class FakeExtension:
        """Every comm_* call succeeds: jax_ub's host side (agreements, barriers, buffer growth's
        collective steps, shutdown) runs for real, without a GPU."""

        def __getattr__(self, name):
            def call(*args, **kwargs):
                if name == "p2p_matrix":
                    return [[1] * nprocs for _ in range(nprocs)]
                if name == "pci_bus_ids":
                    return [f"0000:{0x18 + i:02x}:00.0" for i in range(nprocs)]
                if name == "comm_export_ipc":
                    return b"handle-%d-%d" % (args[0], args[1])
                if name in ("comm_connect_ipc", "nccl_load_error", "comm_error"):
                    return ""
                if name == "nccl_comm_destroy":
                    return 0
                if name == "nccl_unique_id":
                    return bytes(128)
                return None

            return call

    class FakeGpu:
        platform = "gpu"

        def __init__(self, i: int) -> None:
            self.id, self.process_index, self.local_hardware_id = i, i, i

        def __repr__(self) -> str:
            return f"gpu:{self.id}"

    fake = FakeExtension()
    _ext.extension = lambda: fake
    _ext.loaded_extension = lambda: fake
    _ext.cuda_path_available = lambda: (True, "")
    mesh = jax.sharding.Mesh(np.array([FakeGpu(i) for i in range(nprocs)], dtype=object), ("tp",))

    def small_op() -> None:
        pass

    def first_trace() -> None:  # what tracing an op larger than the buffers calls
        s = jax_ub.comm.get("tp")
        jax_ub.comm.ensure_capacity(s, s.capacity + (4 << 20))

    def between_ops() -> None:  # a host-side collective a program makes between steps
        jax_ub.check_processes({"step": 1})

else:
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("tp",))

    def operands(m: int, k: int, n: int, seed: int):
        rng = np.random.default_rng(seed)
        xf = rng.standard_normal((nprocs * m, k)).astype(jnp.bfloat16)
        wf = rng.standard_normal((k, nprocs * n)).astype(jnp.bfloat16)
        x = jax.make_array_from_callback(xf.shape, NamedSharding(mesh, P("tp", None)), lambda i: xf[i])
        w = jax.make_array_from_callback(wf.shape, NamedSharding(mesh, P(None, "tp")), lambda i: wf[i])
        return x, w, np.asarray(xf, np.float64) @ np.asarray(wf, np.float64)

    f = jax.jit(
        jax.shard_map(
            lambda x, w: jax_ub.all_gather_matmul(x, w, "tp", method="ring"),
            mesh=mesh,
            in_specs=(P("tp", None), P(None, "tp")),
            out_specs=P(None, "tp"),
            check_vma=False,
        )
    )
    SMALL = operands(64, 256, 64, 1)
    LARGE = operands(512, 1024, 256, 2)  # 4 MiB gathered: the 1 MiB buffers grow

    def run(ops, block: bool = True):
        x, w, want = ops
        y = f(x, w)
        if not block:
            return
        for shard in y.addressable_shards:
            got = np.asarray(shard.data, np.float64)
            ref = want[shard.index]
            err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
            if not err < 2e-2:
                raise AssertionError(f"wrong result: relative error {err:.3e}")

    def small_op() -> None:
        run(SMALL)

    def first_trace() -> None:
        run(LARGE)

    def between_ops() -> None:
        run(SMALL)


if PHASE == "during_init" and rank == FAULTY:
    plain_agree = _bootstrap.agree

    def agree_then_fault(exchange, fields, **kw):  # the second agreement: mid-initialize
        if kw.get("tag", "agree") == "agree":
            fault()
        return plain_agree(exchange, fields, **kw)

    lifecycle._bootstrap.agree = agree_then_fault  # type: ignore[assignment]

at("before_init")
step("initialize", lambda: jax_ub.initialize(mesh, "tp", buffer_mib=1))
step("op", small_op)
at("first_trace")
step("first_trace", first_trace)
at("between_ops")
step("between_ops", between_ops)
if BACKEND != "cpu":
    if rank == FAULTY and PHASE == "mid_op":
        run(SMALL, block=False)  # enqueued: the fault strikes while the GPU runs it
        fault()
    step("mid_op", lambda: (small_op(), small_op()))
at("shutdown")
step("shutdown", jax_ub.shutdown)
report("done")
sys.stdout.flush()
if rank == 0:
    time.sleep(2.0)
os._exit(0)
