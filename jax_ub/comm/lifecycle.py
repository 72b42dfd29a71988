"""Communicator lifecycle: :func:`initialize` / :func:`shutdown`.

``initialize(mesh, axis="tp")`` creates one Userbuffers communicator per TP group of ``mesh`` (the
devices that differ only along ``axis``) for every local device, and wires each to its peers:

* peers in this process: peer access and direct pointers (no exchange at all);
* peers in other processes of this host: CUDA IPC handles exchanged through jax.distributed's
  key-value store (no MPI, no files), one process-wide exchange per ``initialize()``, or, with
  ``bootstrap="nccl"``, through an NCCL all-gather (unique id via the key-value store);
* transport ``nccl`` (chosen when a group spans hosts or two of its GPUs cannot map each other's
  memory, or cannot be checked, or when asked for): ncclSend/ncclRecv, no peer mapping at all.
  Which pairs can map each other is surveyed across processes by PCI bus id (:mod:`jax_ub.comm.p2p`).

Every process calls ``initialize``/``shutdown`` collectively with the same mesh. All ranks first
agree on (group layout, buffer size, transport, version); any difference fails every rank with the
same message. Buffers grow collectively when a larger op is traced (never mid-step).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import threading
import time
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np

from jax_ub import _ext, _ffi, _usage, _validate, choice, config
from jax_ub.comm import bootstrap as _bootstrap  # initialize's argument `bootstrap` takes the plain name
from jax_ub.comm import failures, liveness, nccl, p2p
from jax_ub.comm.transport import choose_transport, device_ordinal, survey

log = logging.getLogger("jax_ub")

_MIB = 1 << 20
# NCCL communicator keys (jax_ub.comm.nccl's table): transport comms are attached to the members under
# key = set id; bootstrap comms (IPC blobs) stay in the table under this offset + set id.
_BOOTSTRAP_KEY = 1 << 20


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
    bootstrap: str = "kv"  # how IPC handles travel between processes: "kv" or "nccl"
    transport_reason: str = ""
    hosts: list[str] = dataclasses.field(default_factory=list)  # host id of each process (p2p)
    grow_count: int = 0
    rolled: list[int] | None = None  # after a failed op (nccl): the processes that did not report one
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @property
    def devices_key(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(d.id for d in g) for g in self.groups)


_sets: dict[str, CommSet] = {}
_named_axes: set[str] = set()  # every axis initialize() accepted (shutdown of another is a slip)
_next_set_id = 1
_lock = threading.RLock()
_warned_axes: set[Any] = set()  # axes warn_no_communicator has warned about


def _number(name: str, value: Any, kind: type) -> Any:
    """``kind(value)`` for initialize's numeric arguments, or a message naming the argument."""
    if (
        isinstance(value, (bool, str, bytes))
        or not isinstance(value, numbers.Real)
        or (kind is int and isinstance(value, float) and not value.is_integer())
    ):
        raise TypeError(f"initialize: {name} must be a{'n int' if kind is int else ' number'}; got {value!r}")
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise TypeError(
            f"initialize: {name} must be a{'n int' if kind is int else ' number'}; got {value!r}"
        ) from None


def _tp_groups(mesh: Any, axis: str) -> list[list[Any]]:
    names = tuple(mesh.axis_names)
    if axis not in names:
        raise ValueError(f"initialize: axis {axis!r} is not an axis of the mesh; mesh axes are {names}")
    devs = np.asarray(mesh.devices)
    i = names.index(axis)
    moved = np.moveaxis(devs, i, -1).reshape(-1, devs.shape[i])
    return [list(row) for row in moved]


def _process_exchange(init_id: int, timeout_s: float) -> _bootstrap.KVExchange | None:
    if jax.process_count() == 1:
        return None
    names = [f"process {p}" for p in range(jax.process_count())]
    return _bootstrap.KVExchange(
        _bootstrap.group_namespace(init_id, "all"),
        jax.process_index(),
        jax.process_count(),
        timeout_s,
        peer_names=names,
        processes=range(jax.process_count()),
    )


def _checked_arguments(
    mesh: Any,
    axis: Any,
    bootstrap: str | None,
    transport: str | None,
    timeout_s: float | None,
    buffer_mib: int | None,
) -> tuple[config.Config, str, str, str, float, int, list[list[Any]]]:
    """initialize()'s arguments and JAX_UB_* settings, checked, with the TP groups of ``mesh``."""
    cfg = config.get()
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(
            f"initialize: `mesh` must be a jax.sharding.Mesh (e.g. jax.make_mesh((4,), "
            f"('tp',))); got {type(mesh).__name__}"
        )
    bootstrap = cfg.bootstrap if bootstrap is None else bootstrap
    transport = cfg.transport if transport is None else transport
    timeout_s = cfg.timeout_s if timeout_s is None else _number("timeout_s", timeout_s, float)
    buffer_mib = cfg.buffer_mib if buffer_mib is None else _number("buffer_mib", buffer_mib, int)
    if not (math.isfinite(timeout_s) and timeout_s >= config.MIN_TIMEOUT_S):
        raise ValueError(
            f"initialize: timeout_s must be a finite number of seconds >= "
            f"{config.MIN_TIMEOUT_S}; got {timeout_s!r}"
        )
    if timeout_s > config.MAX_TIMEOUT_S:
        raise ValueError(
            f"initialize: timeout_s must be a number of seconds from {config.MIN_TIMEOUT_S} to "
            f"{config.MAX_TIMEOUT_S:g} (one week); got {timeout_s!r}"
        )
    if not 0 <= buffer_mib <= config.MAX_MIB:
        raise ValueError(
            f"initialize: buffer_mib must be in [0, {config.MAX_MIB}] (MiB per GPU; "
            f"{config.MAX_MIB} is 1 TiB); got {buffer_mib!r}"
        )
    if isinstance(axis, tuple) and len(axis) == 1:  # ("tp",) names the axis "tp", as in the ops
        axis = axis[0]
    if bootstrap not in config.BOOTSTRAPS:
        raise ValueError(f"initialize: bootstrap must be one of {config.BOOTSTRAPS}; got {bootstrap!r}")
    if transport not in config.TRANSPORTS:
        raise ValueError(f"initialize: transport must be one of {config.TRANSPORTS}; got {transport!r}")
    if not isinstance(axis, str):
        raise TypeError(
            f"initialize: `axis` must be the name of one mesh axis (a str); got "
            f"{axis!r}. A communicator spans one mesh axis: for a TP group over several "
            f"axes, build the mesh with one axis for that group"
        )
    groups = _tp_groups(mesh, axis)
    return cfg, axis, bootstrap, transport, timeout_s, buffer_mib, groups


def _announce_refused_call(err: BaseException) -> None:
    """initialize() refused its arguments or a JAX_UB_* setting on this process: where there are
    peers, they hear it at once (their first wait in this initialize() call raises with it) instead
    of waiting their timeout for a process that never comes. Takes this call's init id, as every
    initialize() call does, so later calls stay numbered alike on every process."""
    if jax.process_count() == 1:
        return
    try:
        exchange = _process_exchange(_bootstrap.next_init_id(), config.Config.timeout_s)
        assert exchange is not None  # several processes
        exchange.announce_failure(
            f"jax_ub.initialize() refused its arguments or JAX_UB_* "
            f"settings on process "
            f"{jax.process_index()}: {type(err).__name__}: {err}"
        )
    except Exception as e:  # best effort: the peers' timeout still bounds their wait
        log.warning("jax_ub.initialize: could not tell the peers why this process failed: %s", e)


def initialize(
    mesh: Any,
    axis: str = "tp",
    *,
    bootstrap: str | None = None,
    transport: str | None = None,
    timeout_s: float | None = None,
    buffer_mib: int | None = None,
) -> CommSet | None:
    """Creates the communicators of every TP group of ``mesh`` along ``axis`` (collective).

    Args:
      mesh: a ``jax.sharding.Mesh`` of GPUs (any shape, e.g. ``("dp", "tp")``, device ids in any
        order).
      axis: the tensor-parallel mesh axis; ops inside ``shard_map`` use it as ``axis_name``.
      bootstrap: how buffer handles travel between processes: ``"auto"``/``"kv"`` (jax.distributed's
        key-value store) or ``"nccl"`` (NCCL unique id through the key-value store,
        ``ncclCommInitRankConfig``, handles by ``ncclAllGather``). One process needs no exchange.
      transport: ``"auto"`` (``ipc`` when every pair of GPUs of each group can map each other's
        memory, else ``nccl``; logged with the reason), ``"ipc"`` (copy engine over peer-mapped
        memory, no SMs) or ``"nccl"`` (ncclSend/ncclRecv, works across hosts).
      timeout_s: bound on every wait for a peer (default ``JAX_UB_TIMEOUT``, 120 s).
      buffer_mib: registered buffer size per GPU at start (default ``JAX_UB_BUFFER_MIB``; buffers
        also grow when a larger op is traced).

    Idempotent: calling it again with the same mesh and axis returns the existing set.

    Where the CUDA path cannot run (no CUDA GPU or extension, ``JAX_UB_DISABLE=1``) it does nothing
    and returns None, logging the reason at INFO: the ops run the pure-XLA reference there, and
    :func:`shutdown` has nothing to free. Nor does it on an axis of size 1 (a mesh without
    tensor parallelism): there is nothing to communicate, and every method runs a plain GEMM.
    """
    try:
        cfg, axis, bootstrap, transport, timeout_s, buffer_mib, groups = _checked_arguments(
            mesh, axis, bootstrap, transport, timeout_s, buffer_mib
        )
    except Exception as err:
        _announce_refused_call(err)
        raise
    _named_axes.add(axis)
    devices_key = tuple(tuple(d.id for d in g) for g in groups)
    ok, why = _ext.cuda_path_available()
    if not ok:
        _without_cuda_path(cfg, axis, groups, devices_key, timeout_s, why)
        return None
    if len(groups[0]) == 1:
        _on_axis_of_size_one(axis, devices_key, timeout_s)
        return None
    capacity = max(buffer_mib, 1) * _MIB
    with _lock:
        return _create_or_keep(cfg, axis, groups, devices_key, bootstrap, transport, timeout_s, capacity)


def _without_cuda_path(
    cfg: config.Config, axis: str, groups: list[list[Any]], devices_key: tuple, timeout_s: float, why: str
) -> None:
    """initialize() where the CUDA path cannot run: says why, and the processes still agree."""
    # On GPUs (and not disabled on purpose) this is most likely a missing build: say it loudly.
    on_gpu = any(d.platform == "gpu" for g in groups for d in g) and not cfg.disable
    (log.warning if on_gpu else log.info)(
        "jax_ub: initialize(axis=%r) does nothing: the CUDA path is unavailable (%s); the ops "
        "run the pure-XLA reference",
        axis,
        why,
    )
    _agree_without_communicators(axis, devices_key, timeout_s, "reference path")


def _on_axis_of_size_one(axis: str, devices_key: tuple, timeout_s: float) -> None:
    """initialize() on an axis of size 1: nothing to gather or scatter (the ops run a plain dot
    on such an axis, ops.py), so no registered buffer is worth its memory. A set from an earlier,
    larger mesh goes away."""
    # This call's init id first, so a failing shutdown cannot leave this process one id behind
    # its peers; they hear of the failure at once.
    exchange = _process_exchange(_bootstrap.next_init_id(), timeout_s)
    try:
        shutdown(axis)
    except Exception as err:
        if exchange is not None:
            exchange.announce_failure(f"{type(err).__name__}: {err}", wait_for_readers=not _peers_know(err))
        raise
    _agree_without_communicators(axis, devices_key, timeout_s, "axis of size 1", exchange)
    log.info(
        "jax_ub: initialize(axis=%r) creates no communicator: the axis has size 1, so the "
        "ops run a plain GEMM without communication",
        axis,
    )


def _create_or_keep(
    cfg: config.Config,
    axis: str,
    groups: list[list[Any]],
    devices_key: tuple,
    bootstrap: str,
    transport: str,
    timeout_s: float,
    capacity: int,
) -> CommSet:
    """initialize()'s communicators (under ``_lock``): the existing set where the processes agree
    to keep it, else a new one, created in steps that every process takes in the same order."""
    global _next_set_id
    existing = _sets.get(axis)
    keep = (
        existing is not None
        and existing.devices_key == devices_key
        and transport in ("auto", existing.transport)
        and (bootstrap in ("auto", existing.bootstrap) or existing.exchange is None)
        and existing.timeout_s == timeout_s
        and existing.capacity >= capacity
    )
    init_id = _bootstrap.next_init_id()
    exchange = _process_exchange(init_id, timeout_s)
    mod = _ext.extension()
    set_id = _next_set_id
    world = len(groups[0])
    local = _local_members(groups)
    s: CommSet | None = None
    try:
        if exchange is not None:
            _agree_to_keep(exchange, cfg, axis, devices_key, existing, keep)
        if keep and existing is not None:  # keep implies an existing set
            return existing
        if existing is not None:
            shutdown(axis)
        for g in groups:
            if any(d.platform != "gpu" for d in g):
                raise ValueError(f"initialize: mesh devices must be GPUs; got {g}")
        _next_set_id += 1
        hosts, bad_pairs, unverified = survey(exchange, groups)
        transport, reason = choose_transport(transport, groups, hosts, bad_pairs, unverified)
        if bootstrap == "auto":
            bootstrap = "kv"
        _check_nccl_loads(transport, bootstrap)
        if exchange is not None:
            _bootstrap.agree(
                exchange,
                {
                    "axis": axis,
                    "groups": [list(k) for k in devices_key],
                    "capacity": capacity,
                    "transport": transport,
                    "bootstrap": bootstrap,
                    "timeout_s": timeout_s,
                    "version": _version(),
                    "schedule": _schedule(cfg),
                },
            )
        s = CommSet(
            set_id,
            init_id,
            axis,
            world,
            groups,
            local,
            capacity,
            timeout_s,
            transport,
            exchange,
            bootstrap=bootstrap,
            transport_reason=reason,
            hosts=hosts,
        )
        _create_members(mod, s, abort_on_stall=cfg.on_stall == "abort")
    except BaseException as err:
        # The peers' waits on this exchange end at once with this error instead of timing out.
        if exchange is not None:
            exchange.announce_failure(f"{type(err).__name__}: {err}", wait_for_readers=not _peers_know(err))
        if s is not None:
            _destroy_quietly(s)
        raise
    if exchange is not None:
        _confirm_outcome(exchange, s)
    _sets[axis] = s
    failures.install_excepthook()  # an uncaught XLA error after a failed op shows jax_ub's reason
    log.info(
        "jax_ub: initialized axis %r: %d group(s) of %d, %d local member(s), %d MiB buffers, "
        "transport %s (%s), bootstrap %s",
        axis,
        len(groups),
        world,
        len(local),
        capacity // _MIB,
        transport,
        reason,
        bootstrap if exchange is not None else "none",
    )
    return s


def _local_members(groups: list[list[Any]]) -> list[tuple[int, int, int]]:
    """(cuda ordinal, group, rank) of each of this process's devices in ``groups``."""
    me = jax.process_index()
    return [
        (device_ordinal(d), gi, r)
        for gi, g in enumerate(groups)
        for r, d in enumerate(g)
        if d.process_index == me
    ]


def _agree_to_keep(
    exchange: _bootstrap.KVExchange,
    cfg: config.Config,
    axis: str,
    devices_key: tuple,
    existing: CommSet | None,
    keep: bool,
) -> None:
    """The processes' first agreement of a call that creates communicators. Whether to keep the
    existing set is decided by each process from its own state: every process must decide alike (a
    process that keeps its set while its peers replace theirs would wait for them forever). The
    tables auto chooses from are agreed here too (also when the set is kept), and adopted only
    once agreed."""
    tables = choice.propose(cfg.tuning_file, cfg.auto_chain)
    _bootstrap.agree(
        exchange,
        {
            **_first_fields(
                axis,
                devices_key,
                "communicators",
                "none"
                if existing is None  # keep implies an existing set
                else f"keeps set {existing.set_id}"
                if keep
                else f"replaces set {existing.set_id} (other arguments)",
            ),
            "auto_tables": tables.value,
        },
        tag="keep",
        notes={"auto_tables": tables.note},
    )
    choice.adopt(tables)


def _check_nccl_loads(transport: str, bootstrap: str) -> None:
    if transport == "nccl" or bootstrap == "nccl":
        err = nccl.load_error()
        if err:
            raise RuntimeError(
                f"jax_ub.initialize: transport={transport!r}, "
                f"bootstrap={bootstrap!r} need NCCL, which cannot be "
                f"loaded: {err}"
            )


def _create_members(mod: Any, s: CommSet, *, abort_on_stall: bool) -> None:
    """Every local member's communicator and buffer, the NCCL communicators the set's transport or
    bootstrap needs, and the wiring of each member to its peers."""
    for dev, gi, r in s.local:
        # One process: cuMem buffers mapped for the peers only (no context-wide peer
        # access, which let XLA's module loading on one GPU wait on a busy peer).
        mod.comm_create(
            s.set_id,
            gi,
            r,
            s.world,
            dev,
            s.capacity,
            s.timeout_s,
            local_only=s.exchange is None,
            nccl=s.transport == "nccl",
            abort_on_stall=abort_on_stall,
        )
    if s.transport == "nccl" or (s.bootstrap == "nccl" and s.exchange is not None):
        _create_nccl(s, bootstrap_only=s.transport != "nccl")
    _connect(s, tag="connect")


def _confirm_outcome(exchange: _bootstrap.KVExchange, s: CommSet) -> None:
    """A step can succeed on some processes and fail on others (an NCCL init that timed out on one
    process just before its last peer joined): no process keeps a set that one of its peers gave
    up on, and each says which and why."""
    try:
        exchange.barrier("outcome", reached="finish jax_ub.initialize()")
    except Exception as err:
        _destroy_quietly(s)
        raise RuntimeError(
            f"jax_ub.initialize: process {jax.process_index()} set up its "
            f"communicators for axis {s.axis!r}, but a peer did not: {err}"
        ) from err


def _peers_know(err: BaseException) -> bool:
    """Whether the peers learn of ``err`` without this process's announcement: they disagreed
    (each raises the same AgreementError), one of them failed, or some never came."""
    return isinstance(
        err, (_bootstrap.AgreementError, _bootstrap.PeerFailedError, _bootstrap.PeerTimeoutError)
    )


def _agree_without_communicators(
    axis: str, devices_key: tuple, timeout_s: float, path: str, exchange: _bootstrap.KVExchange | None = None
) -> None:
    """Several processes, no communicators (the reference path, or an axis of size 1): they still
    check that they got the same mesh and axis, so a process launched with another layout fails
    here, naming the difference, instead of hanging in XLA's first collective. ``exchange``: this
    call's, where the caller took its init id already."""
    if jax.process_count() == 1:
        return
    if exchange is None:
        exchange = _process_exchange(_bootstrap.next_init_id(), timeout_s)
        assert exchange is not None  # several processes
    existing = _sets.get(axis)
    _bootstrap.agree(
        exchange,
        _first_fields(
            axis, devices_key, path, "none" if existing is None else f"frees set {existing.set_id}"
        ),
        tag="keep",
    )


def _first_fields(axis: str, devices_key: tuple, path: str, existing: str) -> dict[str, Any]:
    """What every process's initialize() first agrees on, on every path (``path``: with or without
    communicators, and why), so processes that took different paths fail naming the difference."""
    return {
        "axis": axis,
        "groups": devices_key,
        "path": path,
        "existing_set": existing,
        "version": _version(),
        "schedule": _schedule(config.get()),
    }


def _schedule(cfg: config.Config) -> dict[str, Any]:
    """The settings that decide which jax_ub ops and communication schedules a program runs: every
    process of a launch needs the same (the transport nccl cannot detect a mismatch; it would
    time out, or pair unrelated transfers).

    Where initialize() creates communicators, the processes also agree on ``auto_tables``, the
    digest of the tables ``method="auto"`` chooses from (the shipped ``jax_ub/data/measured.json``,
    ``JAX_UB_TUNING_FILE``'s) and its rules (:func:`jax_ub.choice.propose`); a difference names
    each process's file. Without communicators (the reference path, an axis of size 1) ``auto``
    runs XLA's path whatever the tables say, so a tuning file that differs there fails nothing."""
    return {
        "method": cfg.method,
        "auto_chain": cfg.auto_chain,
        "disable": cfg.disable,
        "recompute_gathered": cfg.recompute_gathered,
        "rs_chain_pieces": cfg.rs_chain_pieces,
        "rs_chain_split": cfg.rs_chain_split,
        "rs_column_pieces": cfg.rs_column_pieces,
        "rs_pieces": cfg.rs_pieces,
        "ag_push_pieces": cfg.ag_push_pieces,
        "ag_push_merge": cfg.ag_push_merge,
    }


def _destroy_quietly(s: CommSet) -> None:
    """Frees whatever :func:`initialize` created for ``s``; a failure here is logged, so the error
    that made initialize() give up is the one raised."""
    mod = _ext.loaded_extension()
    for what, free in (
        ("the communicators", lambda: mod.comm_destroy_set(s.set_id)),
        ("the NCCL bootstrap communicators", lambda: nccl.destroy_comm(_BOOTSTRAP_KEY + s.set_id)),
        ("the NCCL communicators", lambda: nccl.destroy_comm(s.set_id)),
    ):
        try:
            free()
        except Exception as err:  # logged: the original failure is the one raised
            log.error(
                "jax_ub.initialize: freeing %s of set %d after a failure also failed: %s", what, s.set_id, err
            )


def _create_nccl(s: CommSet, *, bootstrap_only: bool) -> None:
    """One NCCL communicator per group (unique id through the key-value store), every local member
    created concurrently. Transport nccl: attached to the members. Bootstrap nccl: kept in
    jax_ub.comm.nccl's table for the IPC-handle all-gathers of this set."""
    key = _BOOTSTRAP_KEY + s.set_id if bootstrap_only else s.set_id
    uids: dict[int, bytes] = {}
    for gi, g in enumerate(s.groups):
        if not any(lg == gi for _, lg, _ in s.local):
            continue
        if s.exchange is None:
            uids[gi] = nccl.unique_id()
        else:
            uids[gi] = nccl.bootstrap_unique_id(s.exchange, f"{s.set_id}-{gi}", root=g[0].process_index)
    errors: dict[tuple[int, int], BaseException] = {}

    def body(dev: int, gi: int, r: int) -> None:
        try:
            nccl.create_comm(key, uids[gi], r, s.world, dev, s.timeout_s)
        except BaseException as err:  # reported below
            errors[(gi, r)] = err

    threads = [
        threading.Thread(target=body, args=m, daemon=True, name=f"jax_ub-nccl-{m[1]}-{m[2]}") for m in s.local
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        nccl.destroy_comm(key)
        detail = "; ".join(f"group {gi} rank {r}: {e}" for (gi, r), e in sorted(errors.items()))
        raise RuntimeError(f"jax_ub.initialize: creating the NCCL communicators failed: {detail}")
    if not bootstrap_only:
        mod = _ext.loaded_extension()
        for dev, _, _ in s.local:
            mod.comm_attach_nccl(s.set_id, dev, key)


def _version() -> str:
    from jax_ub import __version__

    return __version__


def _nccl_blobs(s: CommSet) -> dict[str, bytes]:
    """Bootstrap nccl: every member's IPC handle blob, all-gathered over its group's NCCL
    communicator (one thread per local member: the ranks of one group progress together)."""
    mod = _ext.loaded_extension()
    key = _BOOTSTRAP_KEY + s.set_id
    out: dict[str, bytes] = {}
    errors: list[str] = []

    def body(dev: int, gi: int, r: int) -> None:
        try:
            blob = bytes(mod.comm_export_ipc(s.set_id, dev))
            size = len(blob)
            allb = nccl.allgather_bytes(key, dev, blob, s.timeout_s)
            for q in range(s.world):
                out[f"{gi}/{q}"] = allb[q * size : (q + 1) * size]
        except BaseException as err:  # reported below
            errors.append(f"group {gi} rank {r}: {err}")

    threads = [threading.Thread(target=body, args=m, daemon=True) for m in s.local]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(
            "jax_ub.initialize: the NCCL all-gather of buffer handles failed: " + "; ".join(errors)
        )
    return out


def _connect(s: CommSet, tag: str) -> None:
    """Wires every local member to every peer (local pointers or IPC handles; nothing to wire for
    transport nccl)."""
    if s.transport == "nccl":
        return
    mod = _ext.loaded_extension()
    host = p2p.host_identity()
    remote: dict[str, tuple[str, bytes]]
    if s.exchange is not None and s.bootstrap == "nccl":
        by_member = _nccl_blobs(s)
        proc_of: dict[tuple[int, ...], int] = {
            (gi, r): d.process_index for gi, g in enumerate(s.groups) for r, d in enumerate(g)
        }
        remote = {k: (s.hosts[proc_of[tuple(map(int, k.split("/")))]], v) for k, v in by_member.items()}
    elif s.exchange is not None:
        mine = {f"{gi}/{r}": mod.comm_export_ipc(s.set_id, dev).hex() for dev, gi, r in s.local}
        import json

        blobs = s.exchange.all_gather(tag, json.dumps({"host": host, "members": mine}).encode())
        remote = {}
        for p, blob in enumerate(blobs):
            info = json.loads(blob.decode())
            if p == jax.process_index():
                continue
            for key, hexblob in info["members"].items():
                remote[key] = (info["host"], bytes.fromhex(hexblob))
    else:
        remote = {}
    local_by_rank = {(gi, r): dev for dev, gi, r in s.local}
    unchecked: dict[str, list[int]] = {}
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
                label = p2p.host_labels([host, peer_host])
                raise ValueError(
                    f"jax_ub.initialize: group {gi} spans hosts {label[host]!r} and "
                    f"{label[peer_host]!r}, which "
                    "transport ipc cannot reach: use transport='nccl' or 'auto'"
                )
            why_not = mod.comm_connect_ipc(s.set_id, dev, q, blob)
            if why_not and tag == "connect":
                unchecked.setdefault(why_not, []).append(q)
    for why_not, ranks in unchecked.items():
        log.info(
            "jax_ub: axis %r: the processes of rank(s) %s cannot be watched for an exit (%s): "
            "if one dies, an op waiting for it fails after the timeout (%g s), not at once",
            s.axis,
            ", ".join(map(str, sorted(set(ranks)))),
            why_not,
            s.timeout_s,
        )


def ensure_capacity(s: CommSet, nbytes: int) -> None:
    """Grows every member's buffer to ``nbytes`` (collective; called when an op is traced)."""
    if nbytes <= s.capacity:
        return
    mod = _ext.loaded_extension()
    with s.lock:
        if nbytes <= s.capacity:
            return
        new = -(-nbytes // _MIB) * _MIB
        log.info("jax_ub: growing axis %r buffers from %d to %d MiB", s.axis, s.capacity // _MIB, new // _MIB)
        mod.comm_drain(s.set_id)
        s.grow_count += 1
        if s.exchange is not None:
            s.exchange.barrier(
                f"grow{s.grow_count}-drained",
                reached=f"trace the same program (buffers of axis {s.axis!r} grow to {new // _MIB} MiB "
                "when an op this large is traced: every process must trace the same jax_ub "
                "ops with the same shapes, in the same order)",
            )
        for dev, _, _ in s.local:
            mod.comm_grow(s.set_id, dev, new)
        s.capacity = new
        _connect(s, tag=f"grow{s.grow_count}")


def get(axis_name: Any) -> CommSet | None:
    """The active communicator set for a mesh axis name (or a tuple of one), or None."""
    axis = _validate.one_axis(axis_name)
    return None if axis is None else _sets.get(axis)


def warn_no_communicator(what: str, axis_name: Any) -> None:
    """Warns once per axis name that ``method="auto"`` found no communicator for a GPU mesh axis
    and so runs XLA's collective and dot without overlap: most likely a missing
    :func:`initialize`. On other platforms (a CPU mesh on a GPU host) it says nothing."""
    if _validate.mesh_platform() not in ("gpu", "cuda"):
        return
    with _lock:
        if axis_name in _warned_axes:
            return
        _warned_axes.add(axis_name)
    if _validate.one_axis(axis_name) is None:
        log.warning(
            "jax_ub %s: axis_name %r names several mesh axes, and a jax_ub communicator "
            "spans one, so method='auto' runs XLA's collective and dot (no overlap). Pass "
            "method='xla' where that is intended, or build the mesh with one axis for the "
            "TP group.",
            what,
            axis_name,
        )
        return
    log.warning(
        "jax_ub %s: GPU mesh axis %r has no jax_ub communicator, so method='auto' runs "
        "XLA's collective and dot (no overlap). Call jax_ub.initialize(mesh, axis=%r) "
        "before tracing, or pass method='xla' where that is intended.",
        what,
        axis_name,
        axis_name,
    )


def shutdown(axis: str | None = None) -> None:
    """Frees the communicators of ``axis`` (default: all). Collective; safe to call twice.

    Programs traced while a freed communicator existed name it in their custom calls, so where one
    was freed, JAX's in-memory caches are cleared (``jax.clear_caches()``): a ``jax.jit`` function
    called again is traced anew, for the communicator a later :func:`initialize` creates (or for
    XLA's path where there is none), instead of failing on the freed one. Executables the caller
    holds (``jit(f).lower(...).compile()``) fail with an error that names the freed set.
    """
    if axis is not None:
        axis = _validate.one_axis(axis) or axis  # ("tp",) is "tp", as for initialize and the ops
    if axis is not None and not isinstance(axis, str):
        raise TypeError(
            f"jax_ub.shutdown: axis must be a mesh axis name (str), a tuple of one, or "
            f"None (every axis); got {axis!r}"
        )
    if axis is not None and axis not in _sets and axis not in _named_axes:
        # Not an error (shutdown is safe to call twice), but a misspelt axis frees nothing.
        log.warning(
            "jax_ub.shutdown(axis=%r): no jax_ub.initialize() named this axis, so nothing "
            "is freed (initialized: %s)",
            axis,
            ", ".join(map(repr, sorted(_named_axes))) or "none",
        )
    _usage.at_shutdown(host_stats, errors)  # jax_ub.summary()'s line, before any set is freed
    freed = False
    try:
        with _lock:
            axes = list(_sets) if axis is None else [axis]
            mod = _ext.extension()
            for a in axes:
                s = _sets.pop(a, None)
                if s is None or mod is None:
                    continue
                freed = True
                error = None
                try:
                    mod.comm_drain(s.set_id)
                except RuntimeError as e:
                    error = e
                if s.exchange is not None:
                    try:
                        s.exchange.barrier("shutdown", reached="call jax_ub.shutdown()")
                    except Exception as err:
                        # A peer may still be inside an op that writes into this process's
                        # buffers: freeing them could corrupt whatever reuses the memory. Keep
                        # them (leaked on purpose, named in _abandoned) and say so.
                        _abandoned.append(s)
                        raise RuntimeError(
                            f"jax_ub.shutdown(axis={a!r}): {err}. The communicators of set "
                            f"{s.set_id} stay allocated (a peer that did not arrive may still "
                            "write into their buffers); they are freed when the process exits."
                            + (
                                f" Draining this process's ops had failed first: {error}"
                                if error is not None
                                else ""
                            )
                        ) from err
                mod.comm_destroy_set(s.set_id)  # also destroys attached NCCL communicators
                nccl.destroy_comm(_BOOTSTRAP_KEY + s.set_id)
                if error is not None:
                    raise error
    finally:
        if freed:
            jax.clear_caches()


# Sets whose shutdown() could not confirm that every peer was done with them: never freed.
_abandoned: list[CommSet] = []


def _failure_reasons() -> dict[tuple[str, int], str]:
    """Sticky errors of the local members of every set, the abandoned ones included (for
    :mod:`jax_ub.comm.failures`); a member that cannot be read is skipped."""
    mod = _ext.extension()
    if mod is None:
        return {}
    out = {}
    for s in [*_sets.values(), *_abandoned]:
        for dev, _, _ in s.local:
            try:
                msg = mod.comm_error(s.set_id, dev)
            except Exception:  # freed meanwhile
                continue
            if msg:
                out[(s.axis, dev)] = str(msg)
    return out


def _exited_peers() -> list[str]:
    """What is known of the peers of a failed op, one sentence each: every peer process of the
    sets' exchanges known to have exited (jax_ub.comm.liveness), and, on transport nccl, which
    cannot say which peer an op missed, the processes of the failed groups that did not report a
    failure of their own (:func:`_roll_call`)."""
    out: list[str] = []
    for s in [*_sets.values(), *_abandoned]:
        ex = s.exchange
        if ex is None or ex.processes is None:
            continue
        for r, p in enumerate(ex.processes):
            why = None if r == ex.rank else liveness.exited(ex._store, p)
            if why is not None and why not in out:
                out.append(why)
        silent = _roll_call(s) if s.transport == "nccl" else []
        if silent:
            out.append(
                f"process{'es' if len(silent) > 1 else ''} {', '.join(map(str, silent))} of the failed "
                f"group did not report a failure of {'their' if len(silent) > 1 else 'its'} own within "
                f"{min(_ROLL_CALL_S, s.timeout_s):g} s: alive but not in this op (stalled, or running "
                "other ops), or gone"
            )
    return out


_ROLL_CALL_S = 2.0  # how long a process whose op failed waits for the peers of its group to say so


def _roll_call(s: CommSet) -> list[int]:
    """Once per set, after an op of ``s`` failed on this process: publishes that it failed, and
    returns the processes of the failed groups that did not publish the same within
    ``_ROLL_CALL_S`` (the peers that ran into the same timeout publish it at once). Never raises;
    [] where it cannot tell."""
    if s.rolled is not None:
        return s.rolled
    s.rolled = []
    ex = s.exchange
    mod = _ext.extension()
    if ex is None or mod is None:
        return []
    try:
        failed_groups = {gi for dev, gi, _ in s.local if mod.comm_error(s.set_id, dev)}
    except Exception:  # freed meanwhile
        return []
    peers = sorted({d.process_index for gi in failed_groups for d in s.groups[gi]} - {ex.rank})
    try:
        ex._store.set(ex._key("op-failed", ex.rank), b"")
    except Exception:  # the service is gone: nothing to learn from it
        return []
    deadline = time.monotonic() + min(_ROLL_CALL_S, s.timeout_s)
    while peers:
        try:
            peers = [p for p in peers if ex._store.try_get(ex._key("op-failed", p)) is None]
        except Exception:
            return []
        if not peers or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    s.rolled = peers
    return peers


failures.set_source(_failure_reasons, _exited_peers)


def errors() -> dict[tuple[str, int], str]:
    """Sticky errors of local members (after a peer timeout), keyed by (axis, device)."""
    mod = _ext.loaded_extension()
    out = {}
    for a, s in _sets.items():
        for dev, _, _ in s.local:
            msg = mod.comm_error(s.set_id, dev)
            if msg:
                out[(a, dev)] = msg
    return out


def host_stats() -> dict[tuple[str, int], dict[str, float]]:
    """Host time of the jax_ub ops run so far, per local member, keyed by (axis, device): ``ops``,
    ``host_s`` (the FFI handlers' time enqueueing them, in total) and ``meet_s`` (of which waiting
    for same-process peers to enter the same op). Totals since ``initialize``; take differences
    around a step. Where ``host_s / ops`` nears the GPU time per op, the GPUs wait for the host.
    A large ``meet_s`` means the wait is for another device's handler thread."""
    mod = _ext.loaded_extension()
    out = {}
    for a, s in _sets.items():
        for dev, _, _ in s.local:
            ops, total_ns, meet_ns = mod.comm_host_stats(s.set_id, dev)
            out[(a, dev)] = {"ops": int(ops), "host_s": total_ns * 1e-9, "meet_s": meet_ns * 1e-9}
    return out


def _inject_failure(axis: str, when: str, devices: Iterable[int] | None = None) -> None:
    """Test hook: the next jax_ub op of ``axis`` on these local CUDA ordinals (default: all of this
    process) fails ``"before"`` it begins (as a refused op: the communicator stays usable if every
    rank refuses) or right ``"after"`` (as a failed enqueue: the communicator is abandoned).
    ``"stall_watchdog"``: the watchdog's reader thread sits as if blocked inside a CUDA call on
    these members until ``"none"`` clears it (the judge must still report timeouts).
    ``"drop_poison"``: the reader never copies the poison word to the GPU, as if the copy had not
    landed when the op's check runs (nccl: the op must still fail, through the abort mark)."""
    codes = _ffi.failure_codes()
    if when not in codes:
        raise ValueError(f"_inject_failure: when must be one of {sorted(codes)}; got {when!r}")
    if axis not in _sets:
        raise ValueError(f"_inject_failure: no communicators for axis {axis!r}; have {sorted(_sets)}")
    s = _sets[axis]
    mod = _ext.loaded_extension()
    wanted = None if devices is None else {int(d) for d in devices}
    for dev, _, _ in s.local:
        if wanted is None or dev in wanted:
            mod.comm_inject_failure(s.set_id, dev, codes[when])
