"""Whether a peer process of a ``jax.distributed`` run has exited, for the waits of the bootstrap.

A key-value wait for a peer that has exited would otherwise last the whole ``JAX_UB_TIMEOUT``
(and a wait outside jax_ub's timeout, none at all). Two marks let a waiting process tell at once:

* every process publishes its identity once, at its first exchange: the machine's boot id, its
  pid namespace, pid and start time (``jax_ub/process/{p}/identity``). A waiter on the same machine
  and pid namespace reads ``/proc``: a pid that is gone, a zombie, or a pid now held by another
  process (another start time) is an exited peer. This sees ``os._exit``, SIGKILL and crashes.
* the same first exchange registers an exit hook (Python runs it on ``sys.exit``, at the end of
  the script and after an uncaught exception, before jax.distributed's own, which may then wait
  in jax's shutdown barrier for minutes) that publishes ``jax_ub/process/{p}/exiting``. This sees
  an exit on any machine.

A peer on another machine killed without its exit hook falls back to the timeout. Imports only
the standard library.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import threading
from typing import Any

__all__ = ["exited", "publish_identity"]

_PREFIX = "jax_ub/process"
_lock = threading.Lock()
_published: set[tuple[int, int]] = set()  # (id of the store's client, process) published already
_identities: dict[tuple[int, int], dict[str, Any] | None] = {}  # read from peers, cached
_EXIT_SET_S = 2.0  # how long the exit hook waits for its mark to be stored


def _client_id(store: Any) -> int:
    """The identity of the key-value service behind ``store`` (jax_ub's adapter wraps the client)."""
    return id(getattr(store, "_client", store))


def _key(process: int, what: str) -> str:
    return f"{_PREFIX}/{process}/{what}"


def _proc_stat(pid: int) -> tuple[str, str] | None:
    """(state, start time in clock ticks) of ``pid`` from /proc, or None where it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[-1].split()  # after "(comm)", which may hold spaces
    if len(fields) < 20:
        return None
    return fields[0], fields[19]  # state, starttime (fields 3 and 22 of proc(5))


def _machine() -> tuple[str, str]:
    """(boot id, pid namespace) of this process; empty strings where they cannot be read."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = ""
    return boot, pidns


def identity() -> dict[str, Any]:
    """This process's identity as published: boot id, pid namespace, pid, start time."""
    boot, pidns = _machine()
    stat = _proc_stat(os.getpid())
    return {"boot": boot, "pidns": pidns, "pid": os.getpid(), "start": stat[1] if stat else ""}


def publish_identity(store: Any, process: int) -> None:
    """Publishes this process's identity and registers its exit mark, once per store and process
    (best effort: without them, a waiter falls back to its timeout)."""
    token = (_client_id(store), process)
    with _lock:
        if token in _published:
            return
        _published.add(token)
    with contextlib.suppress(Exception):
        store.set(_key(process, "identity"), json.dumps(identity()).encode())
    atexit.register(_mark_exiting, store, process)


def _mark_exiting(store: Any, process: int) -> None:
    """The exit hook: tells the peers this process is exiting. In a thread bounded by
    ``_EXIT_SET_S``: the service may be gone (process 0 exited first), and an exit must not wait."""

    def mark() -> None:
        with contextlib.suppress(Exception):
            store.set(_key(process, "exiting"), b"its Python interpreter is exiting")

    t = threading.Thread(target=mark, daemon=True, name="jax_ub-exit-mark")
    t.start()
    t.join(_EXIT_SET_S)


def exited(store: Any, process: int) -> str | None:
    """Why peer ``process`` is known to have exited (a sentence naming it), or None: not known
    (alive, on another machine, or its identity not published yet). Probes that fail say None."""
    try:
        if store.try_get(_key(process, "exiting")) is not None:
            return (
                f"process {process} exited (its exit hook ran: sys.exit, the end of its script or "
                "an uncaught exception)"
            )
    except Exception:
        return None
    cache_key = (_client_id(store), process)
    peer = _identities.get(cache_key)
    if peer is None:
        try:
            raw = store.try_get(_key(process, "identity"))
            peer = json.loads(raw) if raw is not None else None
        except Exception:
            peer = None
        if peer is None:
            return None
        _identities[cache_key] = peer
    boot, pidns = _machine()
    if not boot or peer.get("boot") != boot or peer.get("pidns") != pidns:
        return None  # another machine or container: /proc says nothing about it
    pid = int(peer.get("pid", 0))
    if pid <= 0:
        return None
    stat = _proc_stat(pid)
    if stat is None:
        return f"process {process} (pid {pid}) has exited"
    state, start = stat
    if state in ("Z", "X"):
        return f"process {process} (pid {pid}) has exited (a zombie not yet reaped)"
    if peer.get("start") and start != peer["start"]:
        return f"process {process} (pid {pid}) has exited (its pid now belongs to another process)"
    return None
