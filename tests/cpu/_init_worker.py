"""One process of the multi-process ``jax_ub.initialize`` tests (started by ``tests/launcher.py``).

It runs ``jax_ub.comm``'s multi-process logic (agreements, peer failures, the outcome barrier,
shutdown's barrier) over a real ``jax.distributed`` service on the CPU backend. The CUDA extension
is a stand-in whose calls are recorded (and one of which can be made to fail on one rank), and
the mesh holds stand-in GPU devices: two per process, each TP group spanning the processes.

Usage: ``python _init_worker.py SCENARIO``. Environment: ``FAIL_ON`` (an extension function that
raises on rank ``FAIL_RANK``, default 1), ``T`` (jax_ub's timeout, s), ``P2P_NO`` (``"a,b"``: this
process's CUDA says GPUs a and b cannot access each other, on rank ``P2P_NO_RANK``, default 1),
``TUNING_FILE_<rank>`` (this process's ``JAX_UB_TUNING_FILE``), ``TUNING_REWRITE`` (what rank 0
writes to its tuning file before initializing again, scenario ``tables_changed``).
Results are printed as ``RESULT <json>`` lines: one per step, ``{"step", "ok", "dt", "err" | "set",
"transport", "reason"}``, and ``calls``.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import sys
import time

import numpy as np

rank = int(os.environ["JAX_UB_TEST_RANK"])
nprocs = int(os.environ["JAX_UB_TEST_NPROCS"])
scenario = sys.argv[1]
T = float(os.environ.get("T", "20"))

if f"TUNING_FILE_{rank}" in os.environ:
    os.environ["JAX_UB_TUNING_FILE"] = os.environ[f"TUNING_FILE_{rank}"]
if scenario == "bad_setting" and rank == 1:
    os.environ["JAX_UB_TIMEOUT"] = "soon"  # not a number: this process's initialize() refuses it
if scenario == "refuse_exit" and rank == 0:
    os.environ["JAX_UB_TIMEOUT"] = "soon"  # process 0 (jax.distributed's service) refuses, exits
if scenario == "mismatch_exit" and rank == 0:
    os.environ["JAX_UB_EXPERIMENTAL_AG_PUSH_PIECES"] = "2"
if scenario == "schedule_mismatch" and rank == 1:
    os.environ["JAX_UB_EXPERIMENTAL_AG_PUSH_PIECES"] = "2"  # another communication schedule than process 0's

import jax  # noqa: E402

wanted = {"initialization_timeout": 30, "heartbeat_timeout_seconds": 30, "shutdown_timeout_seconds": 10}
accepted = inspect.signature(jax.distributed.initialize).parameters
jax.distributed.initialize(
    os.environ["JAX_UB_TEST_COORD"], nprocs, rank, **{k: v for k, v in wanted.items() if k in accepted}
)

import jax_ub  # noqa: E402
from jax_ub import _ext  # noqa: E402

CALLS: list[str] = []


class FakeExtension:
    """Every comm_* call succeeds (and is recorded), except ``FAIL_ON`` on ``FAIL_RANK``."""

    def __getattr__(self, name):
        def call(*args, **kwargs):
            CALLS.append(name)
            if name == os.environ.get("FAIL_ON") and rank == int(os.environ.get("FAIL_RANK", "1")):
                raise RuntimeError(f"injected {name} failure on process {rank}")
            if name == "p2p_matrix":
                can = [[1] * 8 for _ in range(8)]
                if os.environ.get("P2P_NO") and rank == int(os.environ.get("P2P_NO_RANK", "1")):
                    a, b = map(int, os.environ["P2P_NO"].split(","))
                    can[a][b] = can[b][a] = 0
                return can
            if name == "pci_bus_ids":  # every process sees the host's GPUs
                return [f"0000:{0x18 + i:02x}:00.0" for i in range(8)]
            if name == "comm_export_ipc":
                return b"handle-%d-%d" % (args[0], args[1])
            if name == "comm_connect_ipc":  # why the peer's process cannot be watched
                return os.environ.get("UNCHECKED", "")
            if name == "nccl_comm_destroy":
                return 0  # communicators destroyed
            if name == "nccl_load_error":
                return ""
            if name == "nccl_unique_id":
                return bytes(128)
            return None

        return call


class FakeGpu:
    platform = "gpu"

    def __init__(self, i: int) -> None:
        # Every process sees the host's 8 GPUs (see pci_bus_ids): the CUDA ordinal is the id, so
        # the GPUs of a group have distinct bus ids and the survey judges each pair.
        self.id, self.process_index, self.local_hardware_id = i, i // 2, i

    def __repr__(self) -> str:
        return f"gpu:{self.id}"


no_cuda = scenario == "path_mismatch" and rank == 1
_ext.extension = lambda: FakeExtension()
_ext.cuda_path_available = lambda: (False, "stand-in: no GPU") if no_cuda else (True, "")
GPUS = [FakeGpu(i) for i in range(2 * nprocs)]


def mesh():
    """[[0, 1], [2, 3], ...] as ("tp", "dp"): each TP group spans the processes (IPC handles)."""
    devices = np.array(GPUS, dtype=object).reshape(nprocs, 2)
    return jax.sharding.Mesh(devices, ("tp", "dp"))


def step(name, fn):
    t0 = time.monotonic()
    try:
        s = fn()
        out = {
            "ok": True,
            "set": None if s is None else s.set_id,
            "transport": getattr(s, "transport", None),
            "reason": getattr(s, "transport_reason", None),
        }
    except Exception as err:  # reported to the test
        out = {"ok": False, "err": f"{type(err).__name__}: {err}"}
    print("RESULT " + json.dumps({"step": name, "dt": round(time.monotonic() - t0, 2), **out}), flush=True)


class _LogLines(logging.Handler):
    """jax_ub's log records as RESULT lines (step "log"), for the tests that check a message."""

    def emit(self, record: logging.LogRecord) -> None:
        print(
            "RESULT " + json.dumps({"step": "log", "level": record.levelname, "msg": record.getMessage()}),
            flush=True,
        )


if os.environ.get("CAPTURE_LOG"):  # with JAX_UB_LOG=INFO (jax_ub sets its logger's level)
    logging.getLogger("jax_ub").addHandler(_LogLines())

if scenario in ("ok", "fail", "path_mismatch", "schedule_mismatch", "p2p"):
    step("init", lambda: jax_ub.initialize(mesh(), "tp", timeout_s=T))
    step("shutdown", jax_ub.shutdown)
elif scenario in ("refuse_exit", "mismatch_exit"):
    # Process 0 fails and exits at once (os._exit, as README's failure pattern does), taking
    # jax.distributed's service with it; process 1 arrives 3 s later (and, for the mismatch, reads
    # process 0's payload a second after publishing its own). It must still get jax_ub's error.
    if rank == 1:
        time.sleep(3)
        if scenario == "mismatch_exit":
            from jax_ub.comm import bootstrap as _bootstrap

            plain_wait, slowed = _bootstrap._JaxClientStore.wait, []

            def slow_first_wait(self, key, timeout_s):
                if not slowed:
                    slowed.append(key)
                    time.sleep(1.0)
                return plain_wait(self, key, timeout_s)

            _bootstrap._JaxClientStore.wait = slow_first_wait
    step("init", lambda: jax_ub.initialize(mesh(), "tp", timeout_s=T))
    os._exit(0)  # no shutdown: process 0 is gone (or going)
elif scenario == "bad_setting":
    step("init", lambda: jax_ub.initialize(mesh(), "tp", timeout_s=T))
    os.environ.pop("JAX_UB_TIMEOUT", None)  # fixed: the next call must pair with the peer's
    step("again", lambda: jax_ub.initialize(mesh(), "tp", timeout_s=T))
    step("shutdown", jax_ub.shutdown)
elif scenario == "reinit":
    step("init", lambda: jax_ub.initialize(mesh(), "tp", timeout_s=T))
    step("same", lambda: jax_ub.initialize(mesh(), "tp", timeout_s=T))
    step("bigger", lambda: jax_ub.initialize(mesh(), "tp", timeout_s=T, buffer_mib=64))
    step(
        "transport",
        lambda: jax_ub.initialize(mesh(), "tp", timeout_s=T, transport="nccl" if rank == 0 else None),
    )
elif scenario == "tables":
    step("init", lambda: jax_ub.initialize(mesh(), "tp", timeout_s=T))
    _ext.cuda_path_available = lambda: (False, "stand-in: reference path")
    step("reference", lambda: jax_ub.initialize(mesh(), "tp", timeout_s=T))
elif scenario == "tables_changed":
    from jax_ub import choice

    def chosen():
        return choice.choose("rs", 2, "bfloat16", 4096, 4096, 4096, os.environ["JAX_UB_TUNING_FILE"]).method

    step("init", lambda: jax_ub.initialize(mesh(), "tp", timeout_s=T))
    print("RESULT " + json.dumps({"step": "chosen", "method": chosen()}), flush=True)
    if rank == 0:
        with open(os.environ["JAX_UB_TUNING_FILE"], "w") as f:
            f.write(os.environ["TUNING_REWRITE"])
    step("again", lambda: jax_ub.initialize(mesh(), "tp", timeout_s=T))
    print("RESULT " + json.dumps({"step": "chosen_after", "method": chosen()}), flush=True)
    step("shutdown", jax_ub.shutdown)
elif scenario == "record_then_shutdown":
    jax_ub.config.get()  # JAX_UB_RECORD_SHAPES set, no op traced
    jax.distributed.shutdown()  # as scripts do before exit: jax_ub's exit hook runs after it
    sys.exit(0)
elif scenario == "shutdown_one":
    step("init", lambda: jax_ub.initialize(mesh(), "tp", timeout_s=T))
    if rank == 0:
        step("shutdown", jax_ub.shutdown)
    else:
        time.sleep(T + 2)
elif scenario == "distributed_first":
    step("init", lambda: jax_ub.initialize(mesh(), "tp", timeout_s=T))
    jax.distributed.shutdown()
    CALLS.clear()
    step("shutdown", jax_ub.shutdown)
    print("RESULT " + json.dumps({"calls": CALLS}), flush=True)
    os._exit(0)
else:
    raise SystemExit(f"unknown scenario {scenario!r}")
print("RESULT " + json.dumps({"calls": CALLS}), flush=True)
sys.stdout.flush()
jax.distributed.shutdown()
