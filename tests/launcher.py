"""One launcher for every multi-process test: N local Python processes, one per rank.

    results = parallel_launch(4, WORKER, ["gather"], env={"JAX_PLATFORMS": "cpu"}, timeout_s=60)
    assert all(r.ok for r in results), format_failures(results)

Each child gets ``JAX_UB_TEST_COORD`` (``127.0.0.1:<free port>``, for
``jax.distributed.initialize``), ``JAX_UB_TEST_NPROCS``, ``JAX_UB_TEST_RANK``, the repository root
on ``PYTHONPATH``, unbuffered output, NVLink multicast switched off (``NCCL_NVLS_ENABLE=0``,
``NVSHMEM_DISABLE_NVLS=1``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``) and, with
``devices_per_proc``, its own ``CUDA_VISIBLE_DEVICES``. Every child runs in its own process
group; whatever happens, every group is killed and every child reaped before
:func:`parallel_launch` returns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# Children never use NVLink multicast (NVLS): it is unavailable or unreliable on the shared test
# machines, and jax_ub only uses it on request.
NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "NVSHMEM_DISABLE_NVLS": "1",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
}

# For ranks that share a GPU: NCCL's "Duplicate GPU detected" check compares (host hash, bus id),
# and NCCL_HOSTID replaces the host hash. One host per rank, then NCCL's socket transport over
# loopback (no InfiniBand probing).
NCCL_SHARED_GPU_ENV = {
    "NCCL_HOSTID": "jax_ub-test-rank-{rank}",
    "NCCL_SOCKET_IFNAME": "lo",
    "NCCL_IB_DISABLE": "1",
}


@dataclasses.dataclass
class Result:
    """What one rank did: exit status, captured output, wall time."""

    rank: int
    pid: int
    returncode: int  # negative: killed by that signal
    stdout: str
    stderr: str
    wall_s: float
    timed_out: bool  # killed by the launcher (overall timeout or fail-fast grace)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def lines(self, prefix: str) -> list[str]:
        """The stdout lines starting with ``prefix``, with the prefix removed."""
        return [ln[len(prefix) :] for ln in self.stdout.splitlines() if ln.startswith(prefix)]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _visible_devices(rank: int, per_proc: int) -> str:
    parent = os.environ.get("CUDA_VISIBLE_DEVICES")
    pool = [d.strip() for d in parent.split(",") if d.strip()] if parent else None
    ids = range(rank * per_proc, (rank + 1) * per_proc)
    if pool is not None:
        if ids.stop > len(pool):
            raise ValueError(
                f"rank {rank} needs devices {list(ids)} of CUDA_VISIBLE_DEVICES="
                f"{parent!r}, which lists only {len(pool)}"
            )
        return ",".join(pool[i] for i in ids)
    return ",".join(map(str, ids))


def _command(target: str | os.PathLike[str], args: Sequence[str]) -> list[str]:
    target = os.fspath(target)
    if target.endswith(".py") or os.sep in target:
        return [sys.executable, target, *map(str, args)]
    return [sys.executable, "-m", target, *map(str, args)]


def _drain(stream, sink: list[bytes]) -> None:
    for chunk in iter(lambda: stream.read1(65536), b""):
        sink.append(chunk)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def parallel_launch(
    nprocs: int,
    target: str | os.PathLike[str],
    args: Sequence[str] = (),
    *,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 60.0,
    devices_per_proc: int | None = None,
    share_gpus: int | None = None,
    fail_fast_s: float | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> list[Result]:
    """Run ``target`` as ``nprocs`` processes (ranks 0..nprocs-1) and return their results.

    Args:
      nprocs: number of processes.
      target: a script path (``*.py`` or containing a path separator) or a module name (run with
        ``python -m``).
      args: command-line arguments, the same for every rank.
      env: extra environment variables for every child (on top of this process's environment).
      timeout_s: overall bound; ranks still running then are killed (``timed_out=True``).
      devices_per_proc: if given, rank ``r`` sees GPUs ``[r*d, (r+1)*d)`` (of the parent's
        ``CUDA_VISIBLE_DEVICES`` when set) through ``CUDA_VISIBLE_DEVICES``.
      share_gpus: if given (instead of ``devices_per_proc``), rank ``r`` sees GPU ``r % share_gpus``:
        with more ranks than GPUs, several processes share one GPU (world-size logic on fewer GPUs).
        NCCL refuses two ranks of one host on one GPU, so each rank that shares its GPU is also
        made a host of its own for NCCL (:data:`NCCL_SHARED_GPU_ENV`): NCCL then moves its bytes
        through its socket transport over loopback, as between hosts (correctness, not speed).
      fail_fast_s: if given, once a rank exits non-zero the others get this long to finish
        before being killed (a crashed peer usually leaves them waiting in a collective).
      cwd: working directory of the children (default: the repository root).

    Returns:
      One :class:`Result` per rank, in rank order; no child is left running or unreaped.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1; got {nprocs}")
    if devices_per_proc is not None and share_gpus is not None:
        raise ValueError("give devices_per_proc or share_gpus, not both")
    if share_gpus is not None and share_gpus < 1:
        raise ValueError(f"share_gpus must be >= 1; got {share_gpus}")
    coord = f"127.0.0.1:{free_port()}"
    base_env = dict(os.environ)
    base_env.update(env or {})
    base_env.update(NO_MULTICAST_ENV)
    base_env["PYTHONUNBUFFERED"] = "1"
    base_env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT)] + [p for p in base_env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    base_env["JAX_UB_TEST_COORD"] = coord
    base_env["JAX_UB_TEST_NPROCS"] = str(nprocs)
    cmd = _command(target, args)

    procs: list[subprocess.Popen[bytes]] = []
    outs: list[tuple[list[bytes], list[bytes]]] = []
    readers: list[threading.Thread] = []
    start: list[float] = []
    end: dict[int, float] = {}
    killed: set[int] = set()
    try:
        for rank in range(nprocs):
            child_env = dict(base_env, JAX_UB_TEST_RANK=str(rank))
            if devices_per_proc is not None:
                child_env["CUDA_VISIBLE_DEVICES"] = _visible_devices(rank, devices_per_proc)
            elif share_gpus is not None:
                child_env["CUDA_VISIBLE_DEVICES"] = _visible_devices(rank % share_gpus, 1)
                if nprocs > share_gpus:
                    for k, v in NCCL_SHARED_GPU_ENV.items():
                        child_env.setdefault(k, v.format(rank=rank))
            start.append(time.monotonic())
            p = subprocess.Popen(
                cmd,
                env=child_env,
                cwd=cwd or REPO_ROOT,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )  # own process group: killpg reaches all
            procs.append(p)
            sinks: tuple[list[bytes], list[bytes]] = ([], [])
            outs.append(sinks)
            for stream, sink in ((p.stdout, sinks[0]), (p.stderr, sinks[1])):
                t = threading.Thread(target=_drain, args=(stream, sink), daemon=True)
                t.start()
                readers.append(t)

        deadline = time.monotonic() + timeout_s
        while len(end) < nprocs:
            now = time.monotonic()
            for rank, p in enumerate(procs):
                if rank not in end and p.poll() is not None:
                    end[rank] = now
                    if p.returncode != 0 and fail_fast_s is not None:
                        deadline = min(deadline, now + fail_fast_s)
            if len(end) == nprocs:
                break
            if now >= deadline:
                for rank, p in enumerate(procs):
                    if rank not in end:
                        _kill_group(p.pid)
                        killed.add(rank)
                break
            time.sleep(0.02)
    finally:
        for p in procs:
            _kill_group(p.pid)  # also any grandchildren left in the group
        for rank, p in enumerate(procs):
            p.wait()
            end.setdefault(rank, time.monotonic())
        for t in readers:
            t.join(timeout=10)
        for p in procs:
            for stream in (p.stdout, p.stderr):
                if stream is not None:
                    stream.close()

    return [
        Result(
            rank=rank,
            pid=p.pid,
            returncode=p.returncode,
            stdout=b"".join(outs[rank][0]).decode(errors="replace"),
            stderr=b"".join(outs[rank][1]).decode(errors="replace"),
            wall_s=end[rank] - start[rank],
            timed_out=rank in killed,
        )
        for rank, p in enumerate(procs)
    ]


def format_failures(results: Sequence[Result], tail_chars: int = 4000) -> str:
    """Each rank's status and the tail of its stderr (and stdout), for an assertion message."""
    parts = []
    for r in results:
        status = "killed after the timeout" if r.timed_out else f"exit {r.returncode}"
        parts.append(f"===== rank {r.rank} (pid {r.pid}): {status}, {r.wall_s:.1f} s =====")
        for name, text in (("stdout", r.stdout), ("stderr", r.stderr)):
            text = text.strip()
            if text:
                cut = "...\n" if len(text) > tail_chars else ""
                parts.append(f"--- {name} ---\n{cut}{text[-tail_chars:]}")
    return "\n".join(parts)


def assert_all_ok(results: Sequence[Result]) -> None:
    """Fail with every rank's stderr unless every rank exited 0 in time."""
    if not all(r.ok for r in results):
        bad = [r.rank for r in results if not r.ok]
        raise AssertionError(f"ranks {bad} failed\n" + format_failures(results))
