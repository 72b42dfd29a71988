"""One process of the ``jax_ub.check_processes`` tests (started by ``tests/launcher.py``).

Usage: ``python _check_worker.py SCENARIO``; prints one ``RESULT <json>`` line:
``{"ok", "dt", "type", "err"}``. Scenarios (process 1 is the odd one out unless said):

* ``ok``: equal fields (a tuple on one process, a list on the other); both go on.
* ``problem``: process 1 passes a problem; ``problems``: both do.
* ``fields``: process 1 was started with other ``steps`` and ``seed``.
* ``missing``: process 1 never calls (it sleeps past ``T``); process 0 waits ``T`` seconds.
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

wanted = {"initialization_timeout": 30, "heartbeat_timeout_seconds": 60, "shutdown_timeout_seconds": 10}
accepted = inspect.signature(jax.distributed.initialize).parameters
jax.distributed.initialize(os.environ["JAX_UB_TEST_COORD"], nprocs, rank,
                           **{k: v for k, v in wanted.items() if k in accepted})

import jax_ub  # noqa: E402

fields = {"steps": 10, "seed": 0, "shape": (4, 8)}
problem = None
if scenario in ("problem", "problems") and (rank == 1 or scenario == "problems"):
    problem = f"--heads (6) must be divisible by tp ({rank + 3})"
if scenario == "problem_exit0" and rank == 0:
    problem = "the CUDA extension is missing on this host"
if scenario == "fields" and rank == 1:
    fields = {"steps": 20, "seed": 1, "shape": [4, 8]}
if scenario == "ok" and rank == 1:
    fields = {"steps": 10, "seed": 0, "shape": [4, 8]}  # a list equals process 0's tuple

if scenario == "missing" and rank == 1:
    time.sleep(T + 5)  # never calls
    os._exit(0)

t0 = time.monotonic()
try:
    jax_ub.check_processes(fields, problem=problem, timeout_s=T)
    out = {"ok": True}
except Exception as e:
    out = {"ok": False, "type": type(e).__name__, "err": str(e)}
out["dt"] = time.monotonic() - t0
print("RESULT " + json.dumps(out), flush=True)
# At once, as a failed process should (process 0's exit takes jax.distributed's service with it),
# and with no jax.distributed.shutdown() barrier: the test reads the result line only.
os._exit(0)
