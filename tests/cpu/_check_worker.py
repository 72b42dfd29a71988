"""One process of the ``jax_ub.check_processes`` tests (started by ``tests/launcher.py``).

Usage: ``python _check_worker.py SCENARIO``; prints one ``RESULT <json>`` line per call:
``{"ok", "dt", "type", "err", "problems", "differences"}``. Scenarios (process 1 is the odd one out
unless said):

* ``ok``: equal fields (a tuple on one process, a list on the other); both go on. Process 1 first
  calls check_processes before jax.distributed.initialize (a one-process call, not numbered).
* ``problem``: process 1 passes a problem; ``problems``: both do, and their fields differ too;
  ``same_problem``: both pass the same problem.
* ``fields``: process 1 was started with other ``steps`` and ``seed``; ``no_fields``: process 1
  passes no fields at all; ``fields_many``: every process but 0 has another seed (run it with 3).
* ``missing``: process 1 never calls (it sleeps past ``T``); process 0 waits ``T`` seconds.
  ``problem_missing``: the same, and process 0 has a problem of its own.
* ``twice``: process 1 calls twice, process 0 once: process 1's second call names the mismatch.
* ``bad_argument``: process 1 passes ``problem=3``; ``bad_fields``: fields JSON cannot encode.
* ``late``: process 1 calls only after process 0 timed out: both raise.
* ``problem_exit0``: process 0 (jax.distributed's service) passes a problem and exits with
  ``os._exit`` at once after raising; process 1 must still get the message.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import time

rank = int(os.environ["JAX_UB_TEST_RANK"])
nprocs = int(os.environ["JAX_UB_TEST_NPROCS"])
scenario = sys.argv[1]
T = float(os.environ.get("T", "20"))

import jax  # noqa: E402

import jax_ub  # noqa: E402


def check(fields, **kw) -> None:
    t0 = time.monotonic()
    try:
        jax_ub.check_processes(fields, timeout_s=T, **kw)
        out = {"ok": True}
    except Exception as e:  # the type is the result
        out = {"ok": False, "type": type(e).__name__, "err": str(e)}
        if isinstance(e, jax_ub.ProcessCheckError):
            out.update(problems={str(k): v for k, v in e.problems.items()}, differences=e.differences)
    out["dt"] = time.monotonic() - t0
    print("RESULT " + json.dumps(out), flush=True)


if scenario == "ok" and rank == 1:
    check({"steps": 99})  # one process so far: returns, and takes no call number

wanted = {"initialization_timeout": 30, "heartbeat_timeout_seconds": 60, "shutdown_timeout_seconds": 10}
accepted = inspect.signature(jax.distributed.initialize).parameters
jax.distributed.initialize(
    os.environ["JAX_UB_TEST_COORD"], nprocs, rank, **{k: v for k, v in wanted.items() if k in accepted}
)

fields = {"steps": 10, "seed": 0, "shape": (4, 8)}
kw = {}
if scenario in ("problem", "problems") and (rank == 1 or scenario == "problems"):
    kw["problem"] = f"--heads (6) must be divisible by tp ({rank + 3})"
if scenario == "same_problem":
    kw["problem"] = "--heads (6) must be divisible by tp (4)"
if scenario == "problems" and rank == 1:
    fields = {"steps": 10, "seed": 0, "shape": (4, 8), "cpu_devices": 4}
if scenario in ("problem_exit0", "problem_missing") and rank == 0:
    kw["problem"] = "the CUDA extension is missing on this host"
if scenario == "fields" and rank == 1:
    fields = {"steps": 20, "seed": 1, "shape": [4, 8]}
if scenario == "fields_many" and rank >= 1:
    fields = {"steps": 10, "seed": 1, "shape": (4, 8)}
if scenario == "no_fields" and rank == 1:
    fields = None
if scenario == "ok" and rank == 1:
    fields = {"steps": 10, "seed": 0, "shape": [4, 8]}  # a list equals process 0's tuple
if scenario == "bad_argument" and rank == 1:
    kw["problem"] = 3

if scenario in ("missing", "problem_missing") and rank == 1:
    time.sleep(T + 5)  # never calls
    os._exit(0)
if scenario == "late" and rank == 1:
    time.sleep(T + 2)  # calls after process 0 gave up
if scenario == "bad_fields" and rank == 1:
    fields = {"steps": 10, "seed": 0, "shape": (4, 8), "table": {(4, 8): 1}}  # a tuple key

check(fields, **kw)
if scenario == "twice" and rank == 1:
    check(fields)  # process 0 makes no second call
# No jax.distributed.shutdown() barrier: the test reads the result lines only. Process 0 hosts
# jax.distributed's service, and its exit ends every other process: it stays while they may still
# read (a successful check does not wait for that), except where leaving at once is the test.
if rank == 0 and scenario != "problem_exit0":
    time.sleep(T + 3 if scenario in ("twice", "late") else 2)
os._exit(0)
