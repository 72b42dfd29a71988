"""CPU tier: jax_ub.comm.liveness (an exited peer seen at once by the bootstrap's waits) and
jax_ub.comm.failures (jax_ub's reason where XLA raised its own error)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from jax_ub.comm import bootstrap, failures, liveness


class _ClientLike:
    """jax.distributed's client's key-value methods over a LocalStore (KVExchange treats a
    LocalStore itself as ranks in threads of one process, without liveness checks)."""

    def __init__(self) -> None:
        self._s = bootstrap.LocalStore()
        self.set, self.try_get = self._s.set, self._s.try_get

    def key_value_set_bytes(self, key, value):
        self._s.set(key, value)

    def blocking_key_value_get_bytes(self, key, timeout_ms):
        value = self._s.wait(key, timeout_ms / 1000)
        if value is None:
            raise TimeoutError("DEADLINE_EXCEEDED")
        return value

    def key_value_try_get_bytes(self, key):
        value = self._s.try_get(key)
        if value is None:
            raise KeyError("NOT_FOUND")
        return value


def _identity_of(pid: int) -> bytes:
    ident = liveness.identity()
    stat = liveness._proc_stat(pid)
    assert stat is not None
    return json.dumps({**ident, "pid": pid, "start": stat[1]}).encode()


def test_a_wait_for_a_process_that_exited_ends_at_once_naming_it():
    store = _ClientLike()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    store.set("jax_ub/process/1/identity", _identity_of(child.pid))
    child.wait()
    ex = bootstrap.KVExchange("t/gone", 0, 2, 20.0, client=store, processes=[0, 1])
    t0 = time.monotonic()
    with pytest.raises(bootstrap.PeerFailedError, match=r"rank 1, whose process 1 \(pid \d+\) has exited"):
        ex.barrier("b")
    assert time.monotonic() - t0 < 3


def test_a_live_peer_is_waited_for_and_a_missing_one_times_out():
    store = _ClientLike()
    store.set("jax_ub/process/1/identity", _identity_of(os.getpid()))  # alive: this very process
    ex = bootstrap.KVExchange("t/alive", 0, 2, 1.0, client=store, processes=[0, 1])
    t0 = time.monotonic()
    with pytest.raises(bootstrap.PeerTimeoutError, match="rank 1"):
        ex.barrier("b")
    assert 0.9 < time.monotonic() - t0 < 3
    late = bootstrap.KVExchange("t/late", 0, 2, 10.0, client=store, processes=[0, 1])
    peer = bootstrap.KVExchange("t/late", 1, 2, 10.0, client=store, processes=[0, 1])
    threading.Timer(1.0, lambda: peer.barrier("b")).start()
    late.barrier("b")  # the peer comes after a second: no false "exited"


def test_the_exit_mark_names_a_process_on_any_machine():
    store = _ClientLike()
    store.set("jax_ub/process/1/identity", json.dumps({"boot": "another-machine", "pid": 1}).encode())
    assert liveness.exited(store, 1) is None  # another machine: /proc says nothing
    liveness._mark_exiting(store, 1)
    assert "process 1 exited" in (liveness.exited(store, 1) or "")


def test_a_pid_reused_by_another_process_is_an_exited_peer():
    store = _ClientLike()
    ident = json.loads(_identity_of(os.getpid()))
    store.set("jax_ub/process/2/identity", json.dumps({**ident, "start": "1"}).encode())
    assert "another process" in (liveness.exited(store, 2) or "")


def test_raise_if_failed_carries_the_reason_and_chains_the_xla_error(monkeypatch):
    failures.raise_if_failed(RuntimeError("not jax_ub's"))  # nothing failed: returns
    why = "jax_ub all_gather_matmul (set 1, group 0, rank 0 of 4, device 0): timed out waiting for rank 3"
    monkeypatch.setattr(failures, "_source", lambda: {("tp", 0): why})
    xla = RuntimeError("CUDA_ERROR_LAUNCH_FAILED: unspecified launch failure")
    with pytest.raises(failures.CommFailedError, match="waiting for rank 3") as info:
        failures.raise_if_failed(xla)
    assert info.value.__cause__ is xla and info.value.reasons == {("tp", 0): why}


def test_an_uncaught_error_after_a_failed_op_shows_the_reason_first():
    """The excepthook initialize() installs: jax_ub's reason first on stderr, and as a note."""
    code = (
        "from jax_ub.comm import failures\n"
        "failures.set_source(lambda: {('tp', 0): 'rank 3 (pid 42) has exited'})\n"
        "failures.install_excepthook()\n"
        "raise RuntimeError('CUDA_ERROR_LAUNCH_FAILED: unspecified launch failure')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    first = out.stderr.splitlines()[0]
    assert first.startswith("jax_ub: a communication op failed on this process"), out.stderr
    assert out.stderr.count("rank 3 (pid 42) has exited") == 2, out.stderr  # first, and as the note
    assert "unspecified launch failure" in out.stderr


def test_the_reason_names_the_peers_known_to_have_exited(monkeypatch):
    """The NCCL transport cannot say which peer an op missed: the exited ones are named beside."""
    why = "jax_ub all_gather_matmul (...): timed out after 4.0 s in NCCL send/recv with ranks 0, 2, 3"
    monkeypatch.setattr(failures, "_source", lambda: {("tp", 0): why})
    monkeypatch.setattr(failures, "_peers", lambda: ["process 3 (pid 42) has exited"])
    with pytest.raises(failures.CommFailedError, match=r"peers known to have exited: process 3 \(pid 42\)"):
        failures.raise_if_failed()


def test_nccl_names_the_process_of_the_failed_group_that_did_not_report(monkeypatch):
    """Transport nccl cannot say which peer a send/recv missed: after a failed op, the processes of
    the group that ran into the same failure say so at once; the one that did not (here process 2,
    stalled) is named."""
    from jax_ub.comm import lifecycle

    store = _ClientLike()

    class Ext:
        def comm_error(self, set_id, dev):
            return "jax_ub all_gather_matmul (...): timed out in NCCL send/recv with ranks ..."

    class Dev:
        def __init__(self, p: int) -> None:
            self.process_index = p

    monkeypatch.setattr(lifecycle._ext, "extension", lambda: Ext())

    def member(rank: int) -> lifecycle.CommSet:
        ex = bootstrap.KVExchange("jax_ub/init9/groupall", rank, 3, 5.0, client=store, processes=range(3))
        group = [[Dev(0), Dev(1), Dev(2)]]
        return lifecycle.CommSet(9, 9, "tp", 3, group, [(rank, 0, rank)], 1, 5.0, "nccl", ex)

    s0, s1 = member(0), member(1)
    got = {}
    t = threading.Thread(target=lambda: got.setdefault(1, lifecycle._roll_call(s1)))
    t0 = time.monotonic()
    t.start()
    assert lifecycle._roll_call(s0) == [2]
    t.join()
    assert got[1] == [2] and time.monotonic() - t0 < lifecycle._ROLL_CALL_S + 1.5
    monkeypatch.setattr(lifecycle, "_sets", {"tp": s0})
    said = lifecycle._exited_peers()
    assert said == [
        "process 2 of the failed group did not report a failure of its own within 2 s: alive but not "
        "in this op (stalled, or running other ops), or gone"
    ], said


def test_check_processes_ends_at_once_naming_a_process_that_exited(monkeypatch):
    """A PeerExitedError, which code written for a missing peer (PeerTimeoutError) catches too."""
    from jax_ub.comm import processes

    store = _ClientLike()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    store.set("jax_ub/process/1/identity", _identity_of(child.pid))
    child.wait()
    monkeypatch.setattr(processes, "_distributed", lambda: (store, 0, 2))
    t0 = time.monotonic()
    with pytest.raises(bootstrap.PeerTimeoutError, match=r"process 1 \(pid \d+\) has exited") as info:
        processes.check_processes({"steps": 1}, timeout_s=20)
    assert isinstance(info.value, bootstrap.PeerExitedError) and time.monotonic() - t0 < 3
    assert str(info.value).startswith("jax_ub.check_processes: "), info.value
    with pytest.raises(processes.ProcessCheckError, match=r"cannot go on: bad flag; and .*has exited"):
        processes.check_processes({"steps": 1}, problem="bad flag", timeout_s=20)


def test_check_processes_names_a_process_whose_answer_cannot_be_read_again(monkeypatch):
    """Every answer came, but a re-read after the timeout fails (the service went with an exited
    process): the process is named as missing, not a bare TypeError from an unreadable answer."""
    from jax_ub.comm import processes

    store = _ClientLike()
    monkeypatch.setattr(processes, "_distributed", lambda: (store, 0, 2))

    def timed_out(self, *a, **k):
        raise bootstrap.PeerTimeoutError("timed out")

    monkeypatch.setattr(bootstrap.KVExchange, "_all_gather", timed_out)
    monkeypatch.setattr(processes, "_peers_with", lambda ex, tag, present=True: [])  # all there, then
    monkeypatch.setattr(processes, "_peek", lambda ex, key: None)  # ... the re-read fails
    with pytest.raises(bootstrap.PeerTimeoutError, match=r"waited 5 s for process 1 of 2"):
        processes.check_processes({"steps": 1}, timeout_s=5)
