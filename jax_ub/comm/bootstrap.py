"""Rendezvous for :func:`jax_ub.initialize`: small blobs between the ranks of one TP group.

Communicators need each rank to learn a few bytes from its peers (CUDA IPC handles, an NCCL
unique id, rank tables) and to check that every rank was configured the same way. This module does
that over a key-value store:

* across processes: jax.distributed's store (``jax._src.distributed.global_state.client``), which
  exists once ``jax.distributed.initialize()`` has been called — no MPI, no files;
* within one process (one thread per rank): a :class:`LocalStore`, so the same protocol code
  serves single-process, many-GPU runs and the tests.

Every rank of a group builds one :class:`KVExchange` on the group's namespace and calls the same
collective operations in the same order::

    init_id = next_init_id()                      # once per jax_ub.initialize(), in every process
    ex = KVExchange(group_namespace(init_id, g), rank, world, timeout_s=cfg.timeout_s)
    agree(ex, {"layout": ..., "version": jax_ub.__version__})
    handles = ex.all_gather("handles", my_handle)  # list[bytes], indexed by rank

Every wait is bounded by ``timeout_s``; a peer that never publishes raises
:class:`PeerTimeoutError` naming it, and ranks configured differently raise
:class:`AgreementError` with the same message on every rank. Importing this module imports only
the standard library; jax is looked up when a :class:`KVExchange` first needs its client.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import inspect
import itertools
import json
import re
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from jax_ub.comm import liveness

__all__ = [
    "AgreementError",
    "KVExchange",
    "LocalStore",
    "PeerExitedError",
    "PeerFailedError",
    "PeerTimeoutError",
    "agree",
    "group_namespace",
    "next_init_id",
]


class PeerTimeoutError(RuntimeError):
    """A peer did not publish its part of a bootstrap step within ``timeout_s``."""


class PeerFailedError(RuntimeError):
    """A peer announced (:meth:`KVExchange.announce_failure`) that its part of the bootstrap
    failed; the message carries its error."""


class PeerExitedError(PeerFailedError, PeerTimeoutError):
    """A peer's process exited before it published its part (:mod:`jax_ub.comm.liveness`): seen at
    once instead of at the timeout. Both a :class:`PeerFailedError` and a
    :class:`PeerTimeoutError`, so that code written for a missing peer catches it too."""


class AgreementError(RuntimeError):
    """The ranks of a group were not configured identically (same message on every rank)."""


# ------------------------------------------------------------------------------------------------
# Namespaces

_init_counter = itertools.count(1)
_init_lock = threading.Lock()


def next_init_id() -> int:
    """Number this process's next ``jax_ub.initialize()`` call: 1, 2, 3, ...

    Call it exactly once per ``initialize()`` (not once per group or per rank): every process
    calls ``initialize()`` the same number of times, so the ids agree across processes even when
    a process holds several ranks, several groups, or different groups from one call to the next.
    """
    with _init_lock:
        return next(_init_counter)


def group_namespace(init_id: int, group: int | str) -> str:
    """The key prefix of one group in one ``initialize()`` call: ``jax_ub/init{init_id}/group{group}``.

    ``group`` is the TP group index, or a name such as ``"all"`` for a process-wide exchange.
    """
    return f"jax_ub/init{init_id}/group{group}"


# ------------------------------------------------------------------------------------------------
# Stores: a minimal interface over jax.distributed's client and the in-process LocalStore


class _Store(Protocol):
    def set(self, key: str, value: bytes) -> None: ...

    def wait(self, key: str, timeout_s: float) -> bytes | None:
        """The value of ``key``, waiting up to ``timeout_s``; None if it did not appear."""

    def try_get(self, key: str) -> bytes | None:
        """The value of ``key`` if present now, else None."""


class LocalStore:
    """A thread-safe in-process key-value store standing in for jax.distributed's.

    Share one instance between the :class:`KVExchange` objects of ranks living in one process
    (one thread per rank). Keys are write-once, like in jax.distributed's store.
    """

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._cv = threading.Condition()

    def set(self, key: str, value: bytes) -> None:
        with self._cv:
            if key in self._data:
                raise KeyError(f"LocalStore: key {key!r} already exists")
            self._data[key] = bytes(value)
            self._cv.notify_all()

    def wait(self, key: str, timeout_s: float) -> bytes | None:
        with self._cv:
            self._cv.wait_for(lambda: key in self._data, timeout=max(0.0, timeout_s))
            return self._data.get(key)

    def try_get(self, key: str) -> bytes | None:
        with self._cv:
            return self._data.get(key)

    def list_keys(self) -> list[str]:
        """Every key stored so far (sorted); for tests and debugging."""
        with self._cv:
            return sorted(self._data)


def _is_deadline(err: BaseException) -> bool:
    return isinstance(err, TimeoutError) or "DEADLINE_EXCEEDED" in str(err)


def _is_not_found(err: BaseException) -> bool:
    return isinstance(err, KeyError) or "NOT_FOUND" in str(err)


class _JaxClientStore:
    """Adapts jax.distributed's ``DistributedRuntimeClient`` (or anything with its methods).

    Uses the ``*_bytes`` methods when the client has them; otherwise stores base64 text through
    ``key_value_set`` / ``blocking_key_value_get``. ``try_get`` falls back from
    ``key_value_try_get[_bytes]`` to ``key_value_dir_get[_bytes]`` to a 1 ms blocking read.
    """

    def __init__(self, client: Any) -> None:
        self._client = client
        self._binary = all(
            hasattr(client, m) for m in ("key_value_set_bytes", "blocking_key_value_get_bytes")
        )
        for m in ("key_value_set", "blocking_key_value_get"):
            if not self._binary and not hasattr(client, m):
                raise TypeError(
                    f"jax_ub bootstrap: the key-value client {type(client).__name__} "
                    f"has neither {m} nor {m}_bytes"
                )

    def _decode(self, raw: bytes | str) -> bytes:
        if self._binary:
            return raw if isinstance(raw, bytes) else raw.encode("latin-1")
        return base64.b64decode(raw)

    def set(self, key: str, value: bytes) -> None:
        if self._binary:
            self._client.key_value_set_bytes(key, bytes(value))
        else:
            self._client.key_value_set(key, base64.b64encode(value).decode("ascii"))

    def wait(self, key: str, timeout_s: float) -> bytes | None:
        get = (
            self._client.blocking_key_value_get_bytes if self._binary else self._client.blocking_key_value_get
        )
        try:
            return self._decode(get(key, max(1, int(timeout_s * 1000))))
        except Exception as err:
            if _is_deadline(err) or _is_not_found(err):
                return None
            raise

    def try_get(self, key: str) -> bytes | None:
        suffix = "_bytes" if self._binary else ""
        try_get = getattr(self._client, "key_value_try_get" + suffix, None)
        if try_get is not None:
            try:
                return self._decode(try_get(key))
            except Exception as err:
                if _is_not_found(err):
                    return None
                raise
        dir_get = getattr(self._client, "key_value_dir_get" + suffix, None)
        if dir_get is not None:
            parent = key.rsplit("/", 1)[0] + "/"
            for k, v in dir_get(parent):
                if k == key:
                    return self._decode(v)
            return None
        return self.wait(key, 0.001)


def _default_client() -> Any:
    """jax.distributed's client, or None when ``jax.distributed.initialize()`` was not called."""
    try:
        from jax._src import distributed
    except ImportError:
        return None
    state = getattr(distributed, "global_state", None)
    return getattr(state, "client", None)


# ------------------------------------------------------------------------------------------------
# The exchange

_FAILED_TAG = "failed"  # announce_failure's key: {namespace}/failed/{rank}
_SEEN_TAG = "failed-seen-"  # + the failed rank: {namespace}/failed-seen-{failed}/{reader}
_FAILURE_POLL_S = 0.25  # how often a wait looks for an announced failure
_LIVENESS_S = 0.5  # how often a wait looks whether a pending peer's process has exited
# How long a rank that ends a step with an error (it failed, or the ranks disagree) waits for its
# peers to have read what tells them: it may exit at once after raising, and if it hosts
# jax.distributed's service (process 0), its exit takes the service, and their reads, with it.
# A peer that reads returns the wait at once, so the bound only matters for a peer that is slow to
# arrive (still importing or compiling on a loaded host: 5 s proved too short there) or gone.
_ACK_S = 30.0
# Then, once they have read it, a little longer: a peer that read the error still has to raise and
# report it, and jax.distributed ends every process at once when one of them exits.
_GRACE_S = 1.0


def _plural(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


class KVExchange:
    """Collective exchange of small byte strings among the ``world`` ranks of one group.

    Every rank of the group constructs one with the same ``namespace`` and ``world`` and its own
    ``rank``, and calls the same operations with the same tags in the same order. A tag names one
    operation and may be used once per exchange (keys are write-once); rank ``r`` publishes under
    ``{namespace}/{tag}/{r}``.

    Args:
      namespace: key prefix unique to this group and this ``initialize()`` call, e.g.
        ``group_namespace(next_init_id(), g)``.
      rank: this rank, ``0 <= rank < world``.
      world: number of ranks in the group.
      timeout_s: bound on each operation's wait for all its peers (overall, not per peer).
      client: a :class:`LocalStore` (ranks in threads of one process), a jax.distributed client,
        or None: jax.distributed's client if ``jax.distributed.initialize()`` was called, else
        (only when ``world == 1``) a private :class:`LocalStore`.
      peer_names: optional description of who holds each rank, used in error messages, e.g.
        ``["process 0", "process 0", "process 1", "process 1"]``.
      processes: the ``jax.distributed`` process index of each rank, where each rank is one
        process: then a wait for a rank whose process has exited ends at once with
        :class:`PeerFailedError` naming it (:mod:`jax_ub.comm.liveness`), not at the timeout.
    """

    def __init__(
        self,
        namespace: str,
        rank: int,
        world: int,
        timeout_s: float,
        client: Any = None,
        *,
        peer_names: Sequence[str] | None = None,
        processes: Sequence[int] | None = None,
    ) -> None:
        if not namespace or namespace.endswith("/"):
            raise ValueError(f"namespace must be non-empty without a trailing '/'; got {namespace!r}")
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"rank must be in [0, world) with world >= 1; got rank={rank}, world={world}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0; got {timeout_s!r}")
        if peer_names is not None and len(peer_names) != world:
            raise ValueError(f"peer_names must have world={world} entries; got {len(peer_names)}")
        if client is None:
            client = _default_client()
            if client is None:
                if world > 1:
                    raise RuntimeError(
                        f"jax_ub bootstrap ({namespace}): a group of {world} ranks needs "
                        "jax.distributed.initialize() to have been called in every process, or a "
                        "LocalStore shared by ranks living in one process"
                    )
                client = LocalStore()
        self.namespace = namespace
        self.rank = rank
        self.world = world
        self.timeout_s = float(timeout_s)
        self.peer_names = list(peer_names) if peer_names is not None else None
        self._store: _Store = client if isinstance(client, LocalStore) else _JaxClientStore(client)
        self._used_tags: set[str] = set()
        self.processes = (
            list(processes) if processes is not None and not isinstance(client, LocalStore) else None
        )
        if self.processes is not None:
            if len(self.processes) != world:
                raise ValueError(f"processes must have world={world} entries; got {len(self.processes)}")
            liveness.publish_identity(self._store, self.processes[rank])
        self._next_liveness_check = 0.0

    def __repr__(self) -> str:
        return (
            f"KVExchange({self.namespace!r}, rank={self.rank}, world={self.world}, "
            f"timeout_s={self.timeout_s})"
        )

    # -- helpers ---------------------------------------------------------------------------------

    def _key(self, tag: str, rank: int) -> str:
        return f"{self.namespace}/{tag}/{rank}"

    def _claim(self, tag: str) -> None:
        if not tag or "/" in tag or tag.startswith(_FAILED_TAG):
            raise ValueError(
                f"tag must be non-empty, contain no '/' and not start with "
                f"{_FAILED_TAG!r} (reserved for announce_failure); got {tag!r}"
            )
        if tag in self._used_tags:
            raise ValueError(
                f"jax_ub bootstrap ({self.namespace}): tag {tag!r} was already used on "
                "this exchange; every operation needs its own tag"
            )
        self._used_tags.add(tag)

    def _who(self, rank: int) -> str:
        return f"rank {rank} ({self.peer_names[rank]})" if self.peer_names else f"rank {rank}"

    def _timeout_error(
        self, op: str, tag: str, missing: Sequence[int], reached: str = "call jax_ub.initialize()"
    ) -> PeerTimeoutError:
        if self.peer_names:
            ranks = ", ".join(f"{r} ({self.peer_names[r]})" for r in missing)
            holders = list(dict.fromkeys(self.peer_names[r] for r in missing))
            one = len(holders) == 1
            question = (
                f"{'is' if one else 'are'} {' and '.join(holders)} running and did "
                f"{'it' if one else 'they'} {reached}?"
            )
        else:
            ranks = ", ".join(map(str, missing))
            one = len(missing) == 1
            question = (
                f"{'is the process' if one else 'are the processes'} holding "
                f"{'rank' if one else 'ranks'} {ranks} running and did "
                f"{'it' if one else 'they'} {reached}?"
            )
        return PeerTimeoutError(
            f"jax_ub bootstrap {op} '{tag}' ({self.namespace}): rank {self.rank} waited "
            f"{self.timeout_s:g} s for {'rank' if len(missing) == 1 else 'ranks'} {ranks} of "
            f"world {self.world}, which never published; {question} (timeout: JAX_UB_TIMEOUT)"
        )

    def _publish(self, op: str, tag: str, payload: bytes) -> None:
        key = self._key(tag, self.rank)
        try:
            self._store.set(key, payload)
        except Exception as err:
            raise RuntimeError(
                f"jax_ub bootstrap {op} '{tag}' ({self.namespace}): rank {self.rank} could not "
                f"publish key {key!r}: {err}. Either jax.distributed's service is gone "
                "(jax.distributed.shutdown() ran already: call jax_ub.shutdown() before it) or "
                "the key exists (a namespace is used by one exchange per rank: next_init_id() "
                "once per initialize())"
            ) from err

    def announce_failure(self, message: str, *, wait_for_readers: bool = True) -> None:
        """Tell the other ranks that this rank's part failed (``message``: why): their waits on this
        exchange for this rank then raise :class:`PeerFailedError` with it at once, instead of
        waiting ``timeout_s`` for a rank that will never publish. Best effort, at most once.

        ``wait_for_readers``: then wait (at most ``_ACK_S``) until every peer has read it, or
        announced a failure of its own. The caller may exit right after raising, and the exit of
        process 0 takes jax.distributed's service with it, before a slower peer could read why.
        (False where the peers know already: they disagreed, failed, or never came.)"""
        if _FAILED_TAG in self._used_tags:
            return
        self._used_tags.add(_FAILED_TAG)
        # The store itself may be what failed: the peers' timeout remains then.
        try:
            self._store.set(self._key(_FAILED_TAG, self.rank), message.encode(errors="replace"))
        except Exception:
            return
        if not wait_for_readers or self.world == 1:
            return
        deadline = time.monotonic() + min(_ACK_S, self.timeout_s)
        for r in range(self.world):
            while r != self.rank:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                try:
                    if (
                        self._store.wait(self._key(f"{_SEEN_TAG}{self.rank}", r), min(left, _FAILURE_POLL_S))
                        is not None
                        or self._store.try_get(self._key(_FAILED_TAG, r)) is not None
                    ):
                        break  # read it, or failed too (and will not read)
                except Exception:
                    return
        time.sleep(_GRACE_S)

    def _acknowledge(self, failed: int) -> None:
        """Tell rank ``failed`` that this rank has read its announced failure (see
        :meth:`announce_failure`). Best effort, once per failed rank."""
        tag = f"{_SEEN_TAG}{failed}"
        if tag in self._used_tags:
            return
        self._used_tags.add(tag)
        with contextlib.suppress(Exception):
            self._store.set(self._key(tag, self.rank), b"")

    def settle(self, tag: str) -> None:
        """A short barrier (at most ``_ACK_S``, never raising) that a step ending in the same error
        on every rank runs before raising it: every rank has then read what it needed, so none
        can take jax.distributed's service away (by exiting) while a peer still reads.

        The barrier's own reads may still be in flight on a peer when rank 0 leaves it, and
        rank 0 is (in jax_ub's groups) process 0, the service's host. So each other rank then
        publishes that it is through, its last call to the store, and returns at once; rank 0
        waits for all of them, then ``_GRACE_S`` more for them to raise (a peer still in a read
        when process 0 exited was aborted by jax instead: a loaded 2-core CI machine, once)."""
        if self.world == 1:
            return
        with contextlib.suppress(Exception):
            deadline = time.monotonic() + min(_ACK_S, self.timeout_s)
            self._all_gather("barrier", f"{tag}-settled", b"", timeout_s=min(_ACK_S, self.timeout_s))
            through = f"{tag}-settled-through"
            if self.rank != 0:
                self._store.set(self._key(through, self.rank), b"")
                return
            for r in range(1, self.world):
                if self._store.wait(self._key(through, r), max(0.0, deadline - time.monotonic())) is None:
                    break  # the deadline: do not wait for the others either
            time.sleep(_GRACE_S)

    def _failed_peer(self, op: str, tag: str, ranks: Sequence[int]) -> PeerFailedError | None:
        for r in ranks:
            try:
                why = self._store.try_get(self._key(_FAILED_TAG, r))
            except Exception:  # a failed probe: keep waiting (the deadline still bounds it)
                continue
            if why is not None:
                self._acknowledge(r)
                return PeerFailedError(
                    f"jax_ub bootstrap {op} '{tag}' ({self.namespace}): {self._who(r)} failed and "
                    f"will not take part: {why.decode(errors='replace')}"
                )
        return None

    def _exited_peer(self, op: str, tag: str, ranks: Sequence[int]) -> PeerExitedError | None:
        """A PeerExitedError for the first of ``ranks`` whose process is known to have exited
        (checked at most every ``_LIVENESS_S``), else None."""
        if self.processes is None or time.monotonic() < self._next_liveness_check:
            return None
        self._next_liveness_check = time.monotonic() + _LIVENESS_S
        for r in ranks:
            why = liveness.exited(self._store, self.processes[r])
            if why is not None:
                return PeerExitedError(
                    f"jax_ub bootstrap {op} '{tag}' ({self.namespace}): rank {self.rank} waited for "
                    f"{self._who(r)}, whose {why}: it can never publish its part, so this wait ends "
                    "now instead of at JAX_UB_TIMEOUT"
                )
        return None

    def _read(
        self,
        op: str,
        tag: str,
        ranks: Sequence[int],
        deadline: float,
        reached: str = "call jax_ub.initialize()",
    ) -> dict[int, bytes]:
        """Read the keys of ``ranks`` under ``tag``, all by ``deadline`` (time.monotonic()). Waits
        in slices of at most ``_FAILURE_POLL_S``, checking between them whether a pending rank
        announced a failure."""
        got: dict[int, bytes] = {}
        pending = list(ranks)
        while pending:
            r = pending[0]
            left = deadline - time.monotonic()
            try:
                value = self._store.wait(self._key(tag, r), min(left, _FAILURE_POLL_S))
            except Exception as err:
                gone = any(w in str(err) for w in ("CANCELLED", "UNAVAILABLE", "shut down"))
                raise RuntimeError(
                    f"jax_ub bootstrap {op} '{tag}' ({self.namespace}): rank {self.rank} could not "
                    f"read {self._who(r)}'s key {self._key(tag, r)!r}: {err}"
                    + (
                        ". jax.distributed's service is gone (if jax.distributed.shutdown() ran "
                        "already: call jax_ub.shutdown() before it)"
                        if gone
                        else ""
                    )
                ) from err
            if value is None:
                failed = self._failed_peer(op, tag, pending) or self._exited_peer(op, tag, pending)
                if failed is not None:
                    raise failed
                if left <= _FAILURE_POLL_S:
                    break
                continue
            got[r] = value
            pending.pop(0)
        if pending:
            # Timed out: find every rank still absent, to name them all.
            missing = []
            for r in pending:
                try:
                    value = self._store.try_get(self._key(tag, r))
                except Exception:  # a failed probe still means "not received"
                    value = None
                if value is None:
                    missing.append(r)
                else:
                    got[r] = value
            if missing:
                raise self._timeout_error(op, tag, missing, reached)
        return got

    # -- operations ------------------------------------------------------------------------------

    def all_gather(self, tag: str, payload: bytes) -> list[bytes]:
        """Every rank's ``payload``, indexed by rank (this rank's own included).

        Raises:
          PeerTimeoutError: some rank did not publish within ``timeout_s``; names every such rank.
          PeerFailedError: a rank that has not published announced a failure.
        """
        return self._all_gather("all_gather", tag, payload)

    def _all_gather(
        self,
        op: str,
        tag: str,
        payload: bytes,
        reached: str = "call jax_ub.initialize()",
        timeout_s: float | None = None,
    ) -> list[bytes]:
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise TypeError(f"payload must be bytes; got {type(payload).__name__}")
        self._claim(tag)
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        payload = bytes(payload)
        self._publish(op, tag, payload)
        peers = [r for r in range(self.world) if r != self.rank]
        got = self._read(op, tag, peers, deadline, reached)
        got[self.rank] = payload
        return [got[r] for r in range(self.world)]

    def broadcast(self, tag: str, payload: bytes | None, root: int = 0) -> bytes:
        """``root``'s ``payload`` on every rank; the other ranks pass None (ignored).

        Raises:
          PeerTimeoutError: ``root`` did not publish within ``timeout_s``.
        """
        if not 0 <= root < self.world:
            raise ValueError(f"root must be in [0, {self.world}); got {root}")
        self._claim(tag)
        if self.rank == root:
            if not isinstance(payload, (bytes, bytearray, memoryview)):
                raise TypeError(f"the root's payload must be bytes; got {type(payload).__name__}")
            payload = bytes(payload)
            self._publish("broadcast", tag, payload)
            return payload
        deadline = time.monotonic() + self.timeout_s
        return self._read("broadcast", tag, [root], deadline)[root]

    def barrier(self, tag: str, *, reached: str = "call jax_ub.initialize()") -> None:
        """Return once every rank has reached ``barrier(tag)``.

        ``reached`` completes the timeout error's question "... running and did it {reached}?",
        naming the call that should have brought the missing ranks here.

        Raises:
          PeerTimeoutError: some rank did not arrive within ``timeout_s``; names every such rank.
          PeerFailedError: a rank that has not arrived announced a failure.
        """
        self._all_gather("barrier", tag, b"", reached)


# ------------------------------------------------------------------------------------------------
# Agreement


def _jsonable(value: Any) -> Any:
    item = getattr(value, "item", None)  # numpy scalars
    if callable(item):
        try:
            return item()
        except (TypeError, ValueError):
            pass
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    if inspect.isroutine(value) or inspect.isclass(value):
        # A function (argparse's set_defaults(func=...)) or class is the same one on every process
        # when its module and qualified name are: its text holds a memory address, which is not.
        name = getattr(value, "__qualname__", None) or getattr(value, "__name__", "?")
        return f"<{type(value).__name__} {getattr(value, '__module__', None) or '?'}.{name}>"
    # Any other value compares by its text, without the memory address a default repr carries
    # (" at 0x7f89...": it differs from process to process for equal values).
    return _ADDRESS.sub("", str(value))


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=_jsonable)


def _decode_fields(blob: bytes, part: int = 1) -> dict[str, Any] | None:
    """Part 1 (the fields) or 2 (the notes) of an agreement payload ``digest\\nfields\\nnotes``."""
    try:
        out = json.loads(blob.split(b"\n", 2)[part])
    except (IndexError, ValueError):
        return None
    return out if isinstance(out, dict) else None


def _show(table: dict[str, Any], name: str) -> str:
    """A field's value as a difference line shows it; None (a flag or setting left out) is
    "not set", not JSON's null."""
    if name not in table:
        return "<absent>"
    return "not set" if table[name] is None else _canonical(table[name])


def _diffs(
    base: dict[str, Any], table: dict[str, Any], prefix: str = "", unit: str = "rank"
) -> list[tuple[str, str]]:
    """(field, "rank r's value (rank 0: its value)") for every field that differs; a field whose
    values are both dicts (the schedule) names only its keys that differ (``schedule.rs_pieces``).
    ``unit``: what a rank is called ("process" for a process-wide check)."""
    out = []
    for name in sorted(set(base) | set(table)):
        a, b = base.get(name), table.get(name)
        if name in base and name in table and isinstance(a, dict) and isinstance(b, dict):
            out += _diffs(a, b, f"{prefix}{name}.", unit)
        elif _show(base, name) != _show(table, name):
            out.append((f"{prefix}{name}", f"{_show(table, name)} ({unit} 0: {_show(base, name)})"))
    return out


def agree(
    exchange: KVExchange,
    fields: Mapping[str, object],
    *,
    tag: str = "agree",
    notes: Mapping[str, str] | None = None,
) -> None:
    """Check that every rank of ``exchange`` passed equal ``fields``.

    Each rank publishes a canonical JSON of ``fields`` (keys sorted; tuples compare equal to
    lists; values JSON cannot hold compare by ``str``) prefixed by its SHA-256. On any mismatch
    every rank raises :class:`AgreementError` with the same message: in rank order, each rank
    whose fields differ from rank 0's, and each differing field with both values.

    ``notes``: per field name, what this rank found (a file's path, why it could not be read).
    Published with the fields but not compared (ranks may name one file by different paths);
    shown with both ranks' notes after a field that differs.

    Raises:
      AgreementError: the ranks disagree.
      PeerTimeoutError: some rank did not take part within ``exchange.timeout_s``.
    """
    if not all(isinstance(k, str) for k in fields):
        raise TypeError(f"agree() field names must be str; got {sorted(map(repr, fields))}")
    text = _canonical(dict(fields))
    digest = hashlib.sha256(text.encode()).hexdigest()
    blobs = exchange.all_gather(tag, f"{digest}\n{text}\n{_canonical(dict(notes or {}))}".encode())
    digests = [b.split(b"\n", 1)[0] for b in blobs]
    if all(d == digests[0] for d in digests):
        return

    tables = [_decode_fields(b) for b in blobs]
    said = [_decode_fields(b, 2) or {} for b in blobs]

    def note(name: str, r: int) -> str:
        if name not in said[r] and name not in said[0]:
            return ""
        return f" [rank {r}: {said[r].get(name, '<no note>')}; rank 0: {said[0].get(name, '<no note>')}]"

    lines = []
    for r in range(1, exchange.world):
        if digests[r] == digests[0]:
            continue
        base, table = tables[0], tables[r]
        if base is None or table is None:
            lines.append(f"  rank {r}: unreadable agreement payload from rank {0 if base is None else r}")
            continue
        diffs = [f"{name}={values}{note(name.split('.', 1)[0], r)}" for name, values in _diffs(base, table)]
        lines.append(
            f"  rank {r}: "
            + ("; ".join(diffs) or "equal fields, different hash (different jax_ub versions?)")
        )
    bad = [r for r in range(1, exchange.world) if digests[r] != digests[0]]
    exchange.settle(tag)  # every rank read every payload before any raises (and maybe exits)
    raise AgreementError(
        f"jax_ub bootstrap: the {exchange.world} ranks of {exchange.namespace} disagree; every "
        "process must call jax_ub.initialize() with the same mesh, arguments, configuration and "
        f"jax_ub version. {_plural(bad).capitalize()} {'differs' if len(bad) == 1 else 'differ'} "
        "from rank 0:\n" + "\n".join(lines)
    )
