"""NCCL for ``bootstrap="nccl"`` and the nccl transport: the library of jax's own nvidia-nccl wheel.

The extension dlopen()s ``libnccl.so.2`` at run time (the wheel's path comes from
:func:`jax_ub._ext.find_libraries`), so nothing here needs NCCL at import or build time, and a
missing library is reported, never a crash::

    uid = bootstrap_unique_id(exchange, key=g)        # root creates it, the others read it
    create_comm(g, uid, rank, world, device, timeout_s)
    blobs = allgather_bytes(g, device, my_ipc_blob)  # world * len(blob) bytes, rank order
    ...
    destroy_comm(g)

Communicators live in the extension, in a process-wide table keyed by ``(key, device)``; Python
only ever sees the key. Every blocking call releases the GIL and is bounded by ``timeout_s``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

from jax_ub import _ext
from jax_ub.comm import bootstrap

__all__ = [
    "UNIQUE_ID_BYTES",
    "allgather_bytes",
    "bootstrap_unique_id",
    "comm_error",
    "create_comm",
    "create_comms",
    "destroy_comm",
    "library",
    "load_error",
    "unique_id",
    "version",
]

UNIQUE_ID_BYTES = 128  # sizeof(ncclUniqueId)


def _extension() -> tuple[Any | None, str]:
    """(extension with NCCL support, "") or (None, why not)."""
    mod = _ext.extension()
    if mod is None:
        return None, _ext._load()[1] or "the jax_ub CUDA extension is unavailable"
    if not hasattr(mod, "nccl_version"):
        return None, (
            "the installed jax_ub CUDA extension predates NCCL support; rebuild it "
            "(pip install . from the jax_ub checkout)"
        )
    return mod, ""


def _require() -> Any:
    mod, reason = _extension()
    if mod is None:
        raise RuntimeError(f"jax_ub NCCL unavailable: {reason}")
    return mod


def version() -> int:
    """``ncclGetVersion()`` of the NCCL that jax_ub loads (e.g. 23203 for 2.32.3), or -1.

    Never raises: -1 when the extension is missing or NCCL cannot be loaded (:func:`load_error`
    says why).
    """
    mod, _ = _extension()
    if mod is None:
        return -1
    try:
        return int(mod.nccl_version())
    except Exception:
        return -1


def library() -> str:
    """Path of the NCCL library jax_ub loads, or ``""`` when it cannot be loaded."""
    mod, _ = _extension()
    if mod is None:
        return ""
    try:
        return str(mod.nccl_library())
    except Exception:
        return ""


def load_error() -> str:
    """``""`` when NCCL is usable, else why not (no extension, no library, missing symbols)."""
    mod, reason = _extension()
    if mod is None:
        return reason
    try:
        return str(mod.nccl_load_error())
    except Exception as err:
        return f"{type(err).__name__}: {err}"


def unique_id() -> bytes:
    """A fresh ``ncclUniqueId`` (128 bytes) from this process.

    This process then hosts NCCL's bootstrap root: it must stay alive until every rank has created
    its communicator.
    """
    uid = bytes(_require().nccl_unique_id())
    if len(uid) != UNIQUE_ID_BYTES:
        raise RuntimeError(
            f"jax_ub NCCL: ncclGetUniqueId returned {len(uid)} bytes, expected {UNIQUE_ID_BYTES}"
        )
    return uid


def bootstrap_unique_id(
    exchange: bootstrap.KVExchange,
    key: int | str,
    *,
    root: int = 0,
    make_id: Callable[[], bytes] | None = None,
) -> bytes:
    """The NCCL unique id of communicator ``key``, identical on every rank of ``exchange``.

    The exchange's rank ``root`` creates it (``make_id()``, default :func:`unique_id`) and publishes
    it through the exchange's key-value store (:meth:`KVExchange.broadcast`, tag
    ``nccl_uid_{key}``); every other rank waits for it, at most ``exchange.timeout_s``.

    Call it once per ``key`` on each rank of the exchange that needs the id (each tag is used
    once per exchange); a process holding several ranks of the communicator calls it once and
    passes the id to each of its ranks.

    Raises:
      PeerTimeoutError: ``root`` did not publish within ``exchange.timeout_s``.
      RuntimeError: the id has the wrong size (ranks running different jax_ub builds?) or NCCL is
        unavailable on ``root``.
    """
    tag = f"nccl_uid_{key}"
    if exchange.rank == root:
        uid = bytes((make_id or unique_id)())
        if len(uid) != UNIQUE_ID_BYTES:
            raise RuntimeError(
                f"jax_ub NCCL: the unique id made for {tag} has {len(uid)} bytes, expected {UNIQUE_ID_BYTES}"
            )
        return exchange.broadcast(tag, uid, root=root)
    uid = exchange.broadcast(tag, None, root=root)
    if len(uid) != UNIQUE_ID_BYTES:
        raise RuntimeError(
            f"jax_ub NCCL bootstrap ({exchange.namespace}): rank {exchange.rank} received a "
            f"{len(uid)}-byte unique id for {tag} from rank {root}, expected {UNIQUE_ID_BYTES}; "
            "do all processes run the same jax_ub build?"
        )
    return uid


def create_comm(key: int, uid: bytes, rank: int, world: int, device: int, timeout_s: float) -> None:
    """Create rank ``rank`` of the ``world``-rank NCCL communicator ``key`` on local CUDA ``device``.

    Blocks (GIL released) until every rank has joined, at most ``timeout_s``; then raises naming
    this rank. Ranks of one process must be created concurrently: use :func:`create_comms`.
    """
    if len(uid) != UNIQUE_ID_BYTES:
        raise ValueError(f"uid must have {UNIQUE_ID_BYTES} bytes; got {len(uid)}")
    _require().nccl_comm_create(int(key), bytes(uid), int(rank), int(world), int(device), float(timeout_s))


def create_comms(
    key: int, uid: bytes, ranks: Sequence[int], world: int, devices: Sequence[int], timeout_s: float
) -> None:
    """Create several local ranks of communicator ``key`` at once (one thread per rank).

    ``ranks[i]`` lives on ``devices[i]``. On failure every rank created here is destroyed again
    and one RuntimeError lists each rank's error.
    """
    if len(ranks) != len(devices):
        raise ValueError(f"ranks and devices differ in length: {len(ranks)} vs {len(devices)}")
    if len(ranks) == 1:
        create_comm(key, uid, ranks[0], world, devices[0], timeout_s)
        return
    errors: dict[int, BaseException] = {}

    def body(rank: int, device: int) -> None:
        try:
            create_comm(key, uid, rank, world, device, timeout_s)
        except BaseException as err:  # reported below, on the calling thread
            errors[rank] = err

    threads = [
        threading.Thread(target=body, args=(r, d), daemon=True, name=f"jax_ub-nccl-init-{key}-r{r}")
        for r, d in zip(ranks, devices, strict=True)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()  # each create_comm returns within timeout_s
    if errors:
        with contextlib.suppress(Exception):  # the creation errors below are what matters
            destroy_comm(key)
        detail = "\n".join(f"  rank {r}: {errors[r]}" for r in sorted(errors))
        raise RuntimeError(
            f"jax_ub NCCL: creating local ranks {list(ranks)} of communicator {key} failed:\n{detail}"
        )


def allgather_bytes(key: int, device: int, data: bytes, timeout_s: float = 0.0) -> bytes:
    """All-gather ``data`` (the same length on every rank) over communicator ``key``.

    Returns ``world * len(data)`` bytes in rank order. Bounded by ``timeout_s`` (<= 0: the
    communicator's own); on timeout the communicator is aborted and this raises.
    """
    return bytes(_require().nccl_allgather_bytes(int(key), int(device), bytes(data), float(timeout_s)))


def comm_error(key: int, device: int) -> str:
    """``""`` while communicator ``key`` on ``device`` is healthy, else its error."""
    return str(_require().nccl_comm_error(int(key), int(device)))


def destroy_comm(key: int) -> int:
    """Destroy every local rank of communicator ``key``; returns how many there were.

    A no-op (returns 0) when the extension or NCCL is unavailable, since nothing can exist then.
    """
    mod, _ = _extension()
    if mod is None:
        return 0
    return int(mod.nccl_comm_destroy(int(key)))
