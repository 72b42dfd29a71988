"""Multi-GPU tier, one process driving every local GPU, cases that need a process of their own:
an environment set before CUDA starts, or communicators left unusable on purpose.

Skips without >= 2 CUDA GPUs. Each case runs tests/multigpu/_op_worker.py under a timeout.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multigpu.test_multiprocess import NGPU

pytestmark = [pytest.mark.multigpu, pytest.mark.skipif(NGPU < 2, reason="needs >= 2 CUDA GPUs")]
WORKER = Path(__file__).with_name("_op_worker.py")
ROOT = Path(__file__).resolve().parents[2]


def _run(mode: str, env: dict, timeout_s: float) -> list[str]:
    full = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", **env)
    try:
        p = subprocess.run(
            [sys.executable, str(WORKER), mode],
            env=full,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired as e:  # run() has killed the child
        out = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
        pytest.fail(f"{mode}: no result after {timeout_s} s (a hang); output tail:\n{out[-3000:]}")
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0, f"{mode}: exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    assert "RESULT done" in lines, lines
    return lines


def test_resharded_inputs_with_one_hardware_queue(capsys):
    # CUDA_DEVICE_MAX_CONNECTIONS=1 puts every stream of a GPU in one hardware queue, so a stream
    # wait for a peer stalls XLA's input copies too. Without the host meeting in Begin this hung
    # within the first calls (the copy feeding GPU 1's op sat behind GPU 0's wait for that op).
    lines = _run("resharded", {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "JAX_UB_TIMEOUT": "30"}, 240)
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    (res,) = [ln for ln in lines if ln.startswith("RESULT resharded ")]
    assert res.split()[3] == "90", res


def test_rank_that_never_starts_an_op_fails_on_the_host(capsys):
    lines = _run("never_starts", {"JAX_UB_TIMEOUT": "3"}, 180)
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    (secs,) = [float(ln.split()[-1]) for ln in lines if ln.startswith("RESULT never_starts seconds")]
    messages = [ln for ln in lines if ln.startswith("RESULT never_starts message ")]
    assert len(messages) == 2 and not any(m.endswith(" no error") for m in messages), messages
    text = " ".join(messages)
    assert "rank 1 (device 1, this process) did not start op epoch 2 on the host within" in text, text
    # The failing call names its location once (the FFI layer adds it; the message must not).
    assert messages[0].count(", rank 0 of ") == 1, messages[0]
    assert secs < 60, secs


def test_programs_load_from_the_persistent_compilation_cache(tmp_path, capsys):
    """A second process with the same JAX_COMPILATION_CACHE_DIR loads the jax_ub programs (forward
    and gradient) from the persistent cache instead of compiling them, and computes the same bits."""
    env = {
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
        "JAX_UB_TIMEOUT": "30",
    }
    runs = [_run("compile_cache", env, 240) for _ in range(2)]
    with capsys.disabled():
        print("\n" + "\n".join(ln for lines in runs for ln in lines))

    def field(lines, name):
        (ln,) = [ln for ln in lines if ln.startswith(f"RESULT compile_cache {name} ")]
        return ln.split()[3:]

    (h1, _, m1), (h2, _, m2) = (field(lines, "hits") for lines in runs)
    assert int(m1) >= 4, (h1, m1)  # ag, rs, mlp, grad compiled and written
    assert any((tmp_path / "cache").iterdir())
    assert int(h2) >= 4 and int(m2) < int(m1), (h2, m2)  # ... and read back
    assert field(runs[0], "digest") == field(runs[1], "digest")
