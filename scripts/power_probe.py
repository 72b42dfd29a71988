"""Is the overlapped op slower than T_ideal because of power? For each impl of `bench ag|rs` at a
shape, runs it back to back for WINDOW seconds while nvidia-smi samples every GPU of the mesh every
100 ms: ms per call, median power draw / limit, SM clock, and how often the power-cap (or thermal /
hardware slowdown) clock reason was active. ms x MHz ("Mcycles per call") takes the clock out: it
is the work the schedule costs at a fixed clock.

    python scripts/power_probe.py OP TP M,K,N [M,K,N ...]     (OP: ag or rs)
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time

import jax

import jax_ub
from jax_ub.bench.agrs import build as agrs_impls
from jax_ub.bench.harness import make_mesh

WINDOW = 2.0
FIELDS = ["index", "power.draw", "power.limit", "clocks.sm", "temperature.gpu",
          "clocks_throttle_reasons.sw_power_cap", "clocks_throttle_reasons.sw_thermal_slowdown",
          "clocks_throttle_reasons.hw_slowdown"]


def query_fields() -> list[str]:
    for n in (len(FIELDS), 5):  # the reason fields may be unknown to this nvidia-smi
        q = ",".join(FIELDS[:n])
        r = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True)
        if r.returncode == 0:
            return FIELDS[:n]
    raise SystemExit(f"nvidia-smi --query-gpu failed: {r.stdout} {r.stderr}")


def sustained(fn, args, fields, gpus):
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    with tempfile.NamedTemporaryFile("w+") as log:
        smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={','.join(fields)}",
                                "--format=csv,noheader,nounits", "-lms", "100"], stdout=log,
                               stderr=subprocess.DEVNULL)
        try:
            calls, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < WINDOW:
                out = [fn(*args) for _ in range(10)]
                jax.block_until_ready(out)
                calls += 10
            ms = (time.perf_counter() - t0) * 1e3 / calls
        finally:
            smi.terminate()
            smi.wait(timeout=10)
        log.seek(0)
        rows = [[v.strip() for v in ln.split(",")] for ln in log if ln.count(",") == len(fields) - 1]
    per = {}
    for g in gpus:
        mine = [r for r in rows if r[0] == str(g)][2:]  # drop the first 200 ms (ramp)
        if not mine:
            continue
        col = lambda i, rr=mine: [float(r[i]) for r in rr if r[i].replace(".", "", 1).isdigit()]  # noqa: E731
        cap = [r[5] for r in mine] if len(fields) > 5 else []
        slow = [r[6:] for r in mine] if len(fields) > 5 else []
        per[g] = {"W": statistics.median(col(1) or [0]), "limit": statistics.median(col(2) or [0]),
                  "MHz": statistics.median(col(3) or [0]), "C": statistics.median(col(4) or [0]),
                  "cap": sum(v == "Active" for v in cap) / max(len(cap), 1),
                  "slow": sum(any(v == "Active" for v in s) for s in slow) / max(len(slow), 1)}
    return ms, per


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("op", choices=["ag", "rs"])
    ap.add_argument("tp", type=int)
    ap.add_argument("shapes", nargs="+")
    ap.add_argument("--impls", default="gemm_alone,gemm_all_gpus,comm_jax_ub,xla_plain,jax_ub_ring,"
                                        "jax_ub_chain,jax_ub_push,jax_ub")
    a = ap.parse_args()
    fields = query_fields()
    want = a.impls.split(",")
    for s in a.shapes:
        M, K, N = (int(v) for v in s.split(","))
        mesh = make_mesh(a.tp, True)
        gpus = [d.id for d in mesh.devices.flat]
        impls = agrs_impls(a.op, mesh, M, K, N, "bfloat16", True)
        for name in [n for n in want if n in impls]:
            entry = impls[name]
            fn, args = entry() if callable(entry) else entry
            ms, per = sustained(fn, args, fields, gpus)
            busy = gpus[:1] if name == "gemm_alone" else gpus
            mhz = statistics.mean(per[g]["MHz"] for g in busy if g in per) if per else 0.0
            desc = "; ".join(f"gpu{g} {p['W']:.0f}/{p['limit']:.0f} W {p['MHz']:.0f} MHz {p['C']:.0f} C "
                             f"cap {p['cap']:.0%} slow {p['slow']:.0%}" for g, p in per.items())
            print(f"POWER {a.op} tp{a.tp} {M},{K},{N} {name:14s} {ms:7.3f} ms  {ms * mhz / 1e3:7.3f} "
                  f"Mcycles  [{desc}]", flush=True)
        jax_ub.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
