"""Communicator lifecycle: :func:`initialize` / :func:`shutdown`.

``initialize(mesh, axis="tp")`` creates one Userbuffers communicator per TP group of ``mesh`` (the
devices that differ only along ``axis``) for every local device, and wires each to its peers:

* peers in this process: peer access and direct pointers (no exchange at all);
* peers in other processes of this host: CUDA IPC handles exchanged through jax.distributed's
  key-value store (no MPI, no files), one process-wide exchange per ``initialize()``.

Every process calls ``initialize``/``shutdown`` collectively with the same mesh. All ranks first
agree on (group layout, buffer size, transport, version); any difference fails every rank with the
same message. Buffers grow collectively when a larger op is traced (never mid-step).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import socket
import threading
from typing import Any

import jax
import numpy as np

from jax_ub import _bootstrap, _ext, config

log = logging.getLogger("jax_ub")

_MIB = 1 << 20


@dataclasses.dataclass
class CommSet:
    """The communicators of one ``initialize()`` call (one per local device of the mesh)."""

    set_id: int
    init_id: int
    axis: str
    world: int  # TP group size
    groups: list[list[Any]]  # devices of each group, in rank order
    local: list[tuple[int, int, int]]  # (cuda ordinal, group, rank) of this process's members
    capacity: int
    timeout_s: float
    transport: str
    exchange: _bootstrap.KVExchange | None  # process-wide, None in single-process mode
    grow_count: int = 0
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @property
    def devices_key(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(d.id for d in g) for g in self.groups)


_sets: dict[str, CommSet] = {}
_next_set_id = 1
_lock = threading.RLock()


def _tp_groups(mesh: Any, axis: str) -> list[list[Any]]:
    names = tuple(mesh.axis_names)
    if axis not in names:
        raise ValueError(f"initialize: axis {axis!r} is not an axis of the mesh; mesh axes are {names}")
    devs = np.asarray(mesh.devices)
    i = names.index(axis)
    moved = np.moveaxis(devs, i, -1).reshape(-1, devs.shape[i])
    return [list(row) for row in moved]


def _ordinal(d: Any) -> int:
    return int(getattr(d, "local_hardware_id", None) if getattr(d, "local_hardware_id", None) is not None else d.id)


def _process_exchange(init_id: int, timeout_s: float) -> _bootstrap.KVExchange | None:
    if jax.process_count() == 1:
        return None
    names = [f"process {p}" for p in range(jax.process_count())]
    return _bootstrap.KVExchange(_bootstrap.group_namespace(init_id, "all"), jax.process_index(),
                                 jax.process_count(), timeout_s, peer_names=names)


def initialize(mesh: Any, axis: str = "tp", *, bootstrap: str | None = None,
               transport: str | None = None, timeout_s: float | None = None,
               buffer_mib: int | None = None) -> CommSet:
    """Creates the communicators of every TP group of ``mesh`` along ``axis`` (collective).

    Args:
      mesh: a ``jax.sharding.Mesh`` of GPUs (any shape, e.g. ``("dp", "tp")``, device ids in any
        order).
      axis: the tensor-parallel mesh axis; ops inside ``shard_map`` use it as ``axis_name``.
      bootstrap: ``"auto"``/``"kv"`` (jax.distributed's key-value store; nothing needed in one
        process). ``"nccl"`` is reserved for the NCCL bootstrap and not available yet.
      transport: ``"auto"``/``"ipc"`` (copy engine over peer-mapped memory). ``"nccl"`` is not
        available yet.
      timeout_s: bound on every wait for a peer (default ``JAX_UB_TIMEOUT``, 120 s).
      buffer_mib: registered buffer size per GPU at start (default ``JAX_UB_BUFFER_MIB``; buffers
        also grow when a larger op is traced).

    Idempotent: calling it again with the same mesh and axis returns the existing set.
    """
    global _next_set_id
    cfg = config.get()
    bootstrap = cfg.bootstrap if bootstrap is None else bootstrap
    transport = cfg.transport if transport is None else transport
    timeout_s = cfg.timeout_s if timeout_s is None else float(timeout_s)
    buffer_mib = cfg.buffer_mib if buffer_mib is None else int(buffer_mib)
    if bootstrap not in config.BOOTSTRAPS:
        raise ValueError(f"initialize: bootstrap must be one of {config.BOOTSTRAPS}; got {bootstrap!r}")
    if transport not in config.TRANSPORTS:
        raise ValueError(f"initialize: transport must be one of {config.TRANSPORTS}; got {transport!r}")
    if bootstrap == "nccl" or transport == "nccl":
        raise NotImplementedError(
            "initialize: the NCCL bootstrap/transport is not available in this version of jax_ub; "
            "use bootstrap='kv', transport='ipc' (every GPU pair of a group must be peer-mappable)")
    if cfg.multicast:
        log.warning("jax_ub: JAX_UB_MULTICAST=1 ignored: no multicast path in this version")
    groups = _tp_groups(mesh, axis)
    with _lock:
        existing = _sets.get(axis)
        if existing is not None:
            if existing.devices_key == tuple(tuple(d.id for d in g) for g in groups):
                return existing
            shutdown(axis)
        mod = _ext.extension()
        ok, why = _ext.cuda_path_available()
        if mod is None or not ok:
            raise RuntimeError(f"jax_ub.initialize: the CUDA path is unavailable: {why}")
        for g in groups:
            if any(d.platform != "gpu" for d in g):
                raise ValueError(f"initialize: mesh devices must be GPUs; got {g}")
        init_id = _bootstrap.next_init_id()
        set_id = _next_set_id
        _next_set_id += 1
        world = len(groups[0])
        me = jax.process_index()
        local = [(_ordinal(d), gi, r) for gi, g in enumerate(groups) for r, d in enumerate(g)
                 if d.process_index == me]
        capacity = max(buffer_mib, 1) * _MIB
        exchange = _process_exchange(init_id, timeout_s)
        s = CommSet(set_id, init_id, axis, world, groups, local, capacity, timeout_s, "ipc", exchange)
        if exchange is not None:
            fields = {"axis": axis, "groups": [list(k) for k in s.devices_key],
                      "capacity": capacity, "transport": "ipc", "timeout_s": timeout_s,
                      "version": _version()}
            _bootstrap.agree(exchange, fields)
        created: list[int] = []
        try:
            for dev, gi, r in local:
                # One process: cuMem buffers mapped for the peers only (no context-wide peer
                # access, which let XLA's module loading on one GPU wait on a busy peer).
                mod.comm_create(set_id, gi, r, world, dev, capacity, timeout_s,
                                local_only=exchange is None)
                created.append(dev)
            _connect(s, tag="connect")
        except BaseException:
            mod.comm_destroy_set(set_id)
            raise
        _sets[axis] = s
        log.info("jax_ub: initialized axis %r: %d group(s) of %d, %d local member(s), %d MiB buffers",
                 axis, len(groups), world, len(local), capacity // _MIB)
        return s


def _version() -> str:
    from jax_ub import __version__

    return __version__


def _connect(s: CommSet, tag: str) -> None:
    """Wires every local member to every peer (local pointers or IPC handles)."""
    mod = _ext.extension()
    host = socket.gethostname()
    if s.exchange is not None:
        mine = {f"{gi}/{r}": mod.comm_export_ipc(s.set_id, dev).hex() for dev, gi, r in s.local}
        import json

        blobs = s.exchange.all_gather(tag, json.dumps({"host": host, "members": mine}).encode())
        remote: dict[str, tuple[str, bytes]] = {}
        for p, blob in enumerate(blobs):
            info = json.loads(blob.decode())
            if p == jax.process_index():
                continue
            for key, hexblob in info["members"].items():
                remote[key] = (info["host"], bytes.fromhex(hexblob))
    else:
        remote = {}
    local_by_rank = {(gi, r): dev for dev, gi, r in s.local}
    for dev, gi, r in s.local:
        for q in range(s.world):
            if q == r:
                continue
            if (gi, q) in local_by_rank:
                mod.comm_connect_local(s.set_id, dev, q, local_by_rank[(gi, q)])
                continue
            entry = remote.get(f"{gi}/{q}")
            if entry is None:
                raise RuntimeError(f"jax_ub.initialize: no handles received for group {gi} rank {q}")
            peer_host, blob = entry
            if peer_host != host:
                raise NotImplementedError(
                    f"jax_ub.initialize: group {gi} spans hosts {host!r} and {peer_host!r}; "
                    "cross-host groups need the NCCL transport, which this version lacks")
            mod.comm_connect_ipc(s.set_id, dev, q, blob)


def ensure_capacity(s: CommSet, nbytes: int) -> None:
    """Grows every member's buffer to ``nbytes`` (collective; called when an op is traced)."""
    if nbytes <= s.capacity:
        return
    mod = _ext.extension()
    with s.lock:
        if nbytes <= s.capacity:
            return
        new = -(-nbytes // _MIB) * _MIB
        log.info("jax_ub: growing axis %r buffers from %d to %d MiB", s.axis, s.capacity // _MIB,
                 new // _MIB)
        mod.comm_drain(s.set_id)
        s.grow_count += 1
        if s.exchange is not None:
            s.exchange.barrier(f"grow{s.grow_count}-drained")
        for dev, _, _ in s.local:
            mod.comm_grow(s.set_id, dev, new)
        s.capacity = new
        _connect(s, tag=f"grow{s.grow_count}")


def get(axis_name: Any) -> CommSet | None:
    """The active communicator set for a mesh axis name, or None."""
    if not isinstance(axis_name, str):
        return None
    return _sets.get(axis_name)


def shutdown(axis: str | None = None) -> None:
    """Frees the communicators of ``axis`` (default: all). Collective; safe to call twice."""
    with _lock:
        axes = list(_sets) if axis is None else [axis]
        mod = _ext.extension()
        for a in axes:
            s = _sets.pop(a, None)
            if s is None or mod is None:
                continue
            error = None
            try:
                mod.comm_drain(s.set_id)
            except RuntimeError as e:
                error = e
            if s.exchange is not None:
                s.exchange.barrier("shutdown")
            mod.comm_destroy_set(s.set_id)
            if error is not None:
                raise error


def errors() -> dict[tuple[str, int], str]:
    """Sticky errors of local members (after a peer timeout), keyed by (axis, device)."""
    mod = _ext.extension()
    out = {}
    for a, s in _sets.items():
        for dev, _, _ in s.local:
            msg = mod.comm_error(s.set_id, dev)
            if msg:
                out[(a, dev)] = msg
    return out


def fingerprint(s: CommSet) -> str:
    return hashlib.sha256(repr((s.axis, s.devices_key, s.capacity)).encode()).hexdigest()[:16]
