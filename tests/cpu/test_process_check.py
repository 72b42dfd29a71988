"""The watchdog's check of a peer process (transport ipc): how a process describes itself, and
what the check says while it runs, once it has exited but is not reaped (a zombie), once it is
gone, and when its pid belongs to another process. Pure /proc reads in the extension, so it runs
on CPU; skips where the extension is not built."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from jax_ub import _ext

ext = _ext.extension()
pytestmark = pytest.mark.skipif(
    ext is None or not hasattr(ext, "process_gone"), reason="needs the jax_ub extension"
)

CHILD = (
    "import sys; from jax_ub import _ext; print(*_ext.extension().this_process(), flush=True);"
    " sys.stdin.readline()"
)


def _child() -> tuple[subprocess.Popen, list[int]]:
    p = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    ident = [int(v) for v in p.stdout.readline().split()]
    assert len(ident) == 4 and ident[0] == p.pid, ident
    return p, ident


def test_this_process_describes_itself():
    pid, start, ns_dev, ns_ino = ext.this_process()
    assert pid > 0 and start > 0 and ns_ino > 0
    assert tuple(ext.process_gone([pid, start, ns_dev, ns_ino])) == (True, "", "")


def test_a_peer_that_runs_then_exits_unreaped_then_is_reaped():
    p, ident = _child()
    try:
        assert tuple(ext.process_gone(ident)) == (True, "", "")
        p.stdin.write("\n")
        p.stdin.flush()
        deadline = time.monotonic() + 30
        while ext.process_gone(ident)[1] == "" and time.monotonic() < deadline:
            time.sleep(0.02)  # exiting; not waited for, so it stays a zombie
        assert ext.process_gone(ident)[1] == "has exited (a zombie, not yet reaped by its parent)"
        checkable, _, why_not = ext.process_gone(ident)
        assert not checkable  # a new peer in that state would not be checked
        assert why_not == "it had already exited when it connected"
    finally:
        p.wait(timeout=30)
    assert ext.process_gone(ident)[1] == "has exited"


def test_a_pid_now_held_by_another_process_counts_as_exited():
    pid, start, ns_dev, ns_ino = ext.this_process()
    checkable, gone, why_not = ext.process_gone([pid, start + 1, ns_dev, ns_ino])
    assert not checkable
    assert gone == "has exited (its pid now belongs to another process)"
    assert why_not.startswith("this process's /proc does not show it"), why_not


def test_a_process_of_another_pid_namespace_is_never_checked():
    pid, start, ns_dev, ns_ino = ext.this_process()
    checkable, _, why_not = ext.process_gone([pid, start, ns_dev, ns_ino + 1])
    assert checkable is False
    assert why_not == "it runs in another pid namespace (another container)"
    checkable, _, why_not = ext.process_gone([pid, 0, ns_dev, ns_ino])  # start time unknown
    assert checkable is False
    assert why_not == "it could not describe itself (no /proc there)"
