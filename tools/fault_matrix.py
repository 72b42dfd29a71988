"""Fault-injection matrix: one process of a multi-process run fails; every other must end in time
with a jax_ub error that names it.

    python tools/fault_matrix.py --backend cpu                       # host side, no GPU (CI)
    python tools/fault_matrix.py --backend gpu --transports ipc,nccl # 4 ranks sharing the GPUs

Each case runs ``tests/cpu/_fault_worker.py`` as ``--nprocs`` processes (jax.distributed on
localhost); the last process injects one fault kind (exit: ``sys.exit(0)``; kill: SIGKILL;
stall: sleeps past the timeout; raise: an uncaught exception) at one phase (before_init,
during_init, first_trace of a larger shape, between_ops, mid_op, shutdown; mid_op on GPU only).
A case passes when every other process ends with a jax_ub error naming the faulty process
within ``JAX_UB_TIMEOUT`` + 5 s of the fault (or of reaching the phase, where it got there later),
no process is left running, and (GPU) no memory stays allocated on the GPUs afterwards.

Prints one line per case and a Markdown table (``--table FILE`` writes it too); exits 1 if a case
failed. Cases run ``--parallel`` at a time.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.launcher import parallel_launch  # noqa: E402

WORKER = ROOT / "tests" / "cpu" / "_fault_worker.py"
KINDS = ("exit", "kill", "stall", "raise")
PHASES = ("before_init", "during_init", "first_trace", "between_ops", "mid_op", "shutdown")
CPU_PHASES = ("before_init", "during_init", "first_trace", "between_ops", "shutdown")
GRACE_S = 5.0  # the bound: JAX_UB_TIMEOUT + this


@dataclasses.dataclass
class Case:
    kind: str
    phase: str
    transport: str
    ok: bool = False
    hang: bool = False
    times: list[float] = dataclasses.field(default_factory=list)  # time to error per survivor
    why: str = ""
    stderr: dict[int, str] = dataclasses.field(default_factory=dict)  # a failed case's: each process's end

    @property
    def name(self) -> str:
        return f"{self.transport}/{self.phase}/{self.kind}"


def _events(stdout: str) -> list[dict]:
    out = []
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            with contextlib.suppress(ValueError):
                out.append(json.loads(line[7:]))
    return out


def run_case(case: Case, backend: str, nprocs: int, timeout_s: float, start_by: float | None = None) -> Case:
    """Runs one case (three or more processes); ``start_by`` (time.monotonic()): a case not started
    by then is skipped (``why`` says so), so that a bounded run ends with its children reaped."""
    if start_by is not None and time.monotonic() > start_by:
        case.why = "not run: --budget spent"
        return case
    env = {
        "FAULT_KIND": case.kind,
        "FAULT_PHASE": case.phase,
        "FAULT_BACKEND": backend,
        "JAX_UB_TIMEOUT": f"{timeout_s:g}",
        "JAX_UB_TRANSPORT": case.transport,
        "JAX_PLATFORMS": "cpu" if backend == "cpu" else "cuda",
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
    }
    layout = {} if backend == "cpu" else {"share_gpus": 1}
    limit = timeout_s + (45 if backend == "cpu" else 75)
    results = parallel_launch(nprocs, WORKER, env=env, timeout_s=limit, **layout)
    faulty = nprocs - 1
    fault_at = next((e["t"] for e in _events(results[faulty].stdout) if e["event"] == "fault"), None)
    problems = []
    if fault_at is None:
        problems.append(f"process {faulty} never injected its fault: {results[faulty].stderr[-600:]}")
    for r in results:
        if r.timed_out:
            case.hang = True
            problems.append(f"process {r.rank} was still running after {limit:g} s (killed)")
    for r in results[:faulty]:
        ev = _events(r.stdout)
        err = next((e for e in ev if e["event"] == "error"), None)
        if err is None:
            problems.append(f"process {r.rank} ended without a jax_ub error (exit {r.returncode})")
            continue
        entered = max((e["t"] for e in ev if e["event"] == "phase" and e["phase"] == err["phase"]), default=0)
        dt = err["t"] - max(fault_at or 0.0, entered)
        case.times.append(dt)
        msg = err["error"]
        if f"process {faulty}" not in msg and f"rank {faulty}" not in msg:
            problems.append(f"process {r.rank}'s error does not name process {faulty}: {msg[:400]}")
        if dt > timeout_s + GRACE_S:
            problems.append(
                f"process {r.rank} ended {dt:.1f} s after the fault (bound {timeout_s + GRACE_S:g})"
            )
    case.ok = not problems
    case.why = "; ".join(problems)
    if problems:
        case.stderr = {r.rank: r.stderr[-4000:] for r in results}
    return case


def gpu_memory_used() -> list[int]:
    """MiB used on each GPU (nvidia-smi), or [] without it."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        return [int(x) for x in out.split()]
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return []


def table(cases: list[Case], timeout_s: float) -> str:
    rows = [
        "| transport | phase | faults injected | ended in time | median / max time to error (s) | hangs |"
    ]
    rows.append("|---|---|---|---|---|---|")
    groups: dict[tuple[str, str], list[Case]] = {}
    skipped = [c for c in cases if c.why.startswith("not run")]
    cases = [c for c in cases if c not in skipped]
    for c in cases:
        groups.setdefault((c.transport, c.phase), []).append(c)
    for (transport, phase), cs in groups.items():
        times = [t for c in cs for t in c.times]
        tm = f"{statistics.median(times):.1f} / {max(times):.1f}" if times else "-"
        rows.append(
            f"| {transport} | {phase} | {len(cs)} ({', '.join(c.kind for c in cs)}) | "
            f"{sum(c.ok for c in cs)} of {len(cs)} | {tm} | {sum(c.hang for c in cs)} |"
        )
    times = [t for c in cases for t in c.times]
    tm = f"{statistics.median(times):.1f} / {max(times):.1f}" if times else "-"
    rows.append(
        f"| **all** | | {len(cases)} | {sum(c.ok for c in cases)} of {len(cases)} | {tm} | "
        f"{sum(c.hang for c in cases)} |"
    )
    note = f"; not run (--budget): {', '.join(c.name for c in skipped)}" if skipped else ""
    return "\n".join(rows) + f"\n\nJAX_UB_TIMEOUT={timeout_s:g} s; bound: timeout + {GRACE_S:g} s{note}.\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument("--transports", default="ipc", help="comma-separated: ipc,nccl")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--phases", default=None, help="default: every phase of the backend")
    ap.add_argument("--nprocs", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=4.0, help="JAX_UB_TIMEOUT of the processes (s)")
    ap.add_argument("--parallel", type=int, default=4, help="cases run at once")
    ap.add_argument(
        "--budget", type=float, default=None, help="start no case after this many seconds (the rest: not run)"
    )
    ap.add_argument("--table", type=Path, help="also write the Markdown table here")
    ap.add_argument("--json", type=Path, help="also write every case as JSON here")
    args = ap.parse_args(argv)
    phases = args.phases.split(",") if args.phases else list(PHASES if args.backend == "gpu" else CPU_PHASES)
    cases = [Case(k, p, t) for t in args.transports.split(",") for p in phases for k in args.kinds.split(",")]
    before = gpu_memory_used() if args.backend == "gpu" else []
    t0 = time.monotonic()
    start_by = None if args.budget is None else t0 + args.budget
    with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
        futures = [pool.submit(run_case, c, args.backend, args.nprocs, args.timeout, start_by) for c in cases]
        for fut in concurrent.futures.as_completed(futures):
            c = fut.result()
            times = ", ".join(f"{t:.1f}" for t in c.times)
            print(f"{'PASS' if c.ok else 'FAIL'} {c.name}: times to error [{times}] {c.why}", flush=True)
    text = table(cases, args.timeout)
    failed = [c for c in cases if not c.ok and not c.why.startswith("not run")]
    if args.backend == "gpu":
        time.sleep(2.0)
        after = gpu_memory_used()
        text += f"GPU memory used before / after the matrix (MiB): {before} / {after}\n"
        if before and after and any(a > b + 64 for a, b in zip(after, before, strict=False)):
            print(f"FAIL: GPU memory left allocated: {before} -> {after} MiB", flush=True)
            failed.append(Case("-", "gpu-memory", "-"))
    text += f"{len(cases)} cases in {time.monotonic() - t0:.0f} s; failed: {len(failed)}\n"
    print(text, flush=True)
    if args.table:
        args.table.write_text(text)
    if args.json:
        args.json.write_text(json.dumps([dataclasses.asdict(c) for c in cases], indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
