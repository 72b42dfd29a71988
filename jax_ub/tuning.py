"""Tune ``method="auto"`` for your own model: record the shapes your program's jax_ub ops run at,
measure every method at exactly those shapes on your machine, and let ``auto`` choose from that.

``auto`` otherwise chooses by the *nearest* shape of the records jax_ub ships (measured on H200s
at benchmark shapes, :mod:`jax_ub.choice`); your model's shapes and your GPUs may differ from
both. Three steps::

    JAX_UB_RECORD_SHAPES=shapes.json python train.py ...     # 1. any run that traces the ops
    python -m jax_ub.bench tune shapes.json --out tuning    # 2. on the GPUs you train on
    JAX_UB_TUNING_FILE=tuning/<machine>-<date>-tune.json python train.py ...   # 3.

Step 1 needs no GPU: the shapes are recorded when the ops are *traced* (also on the reference
path, e.g. on a CPU machine with ``XLA_FLAGS=--xla_force_host_platform_device_count=N``), so
``jax.jit(step).lower(...)`` is enough. In code, :func:`record` does the same for a ``with`` block::

    with jax_ub.tuning.record() as rec:
        jax.jit(train_step).lower(state, batch)
    rec.save("shapes.json")

Each recorded shape is the global (M, K, N) of one op as the bench names it (AG: x[M/tp, K] @
w[K, N/tp]; RS: x[M, K/tp] @ w[K/tp, N]), with tp, dtype and how many calls were traced at it
("forward"). Its backward runs the dual op at (M, N, K) (the dgrad of an AG->GEMM is a GEMM->RS and
vice versa), recorded beside it as a "backward" shape unless the call re-gathers in its backward
(``recompute_gathered``: bulk ops, which ``auto`` does not choose for). ``bench tune`` measures
every shape of the file (``--forward-only``: only the forward ones).

With several processes (``jax.distributed``), each writes its own file, ``<stem>.process<i>.json``
(:func:`env_path`), since pipeline stages trace different ops; ``bench tune`` takes them all. A
process that ends with ``JAX_UB_RECORD_SHAPES`` set but no op recorded (e.g. tp=1 on a CPU machine
without simulated devices) says so in a WARNING and writes an empty file if none exists.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import glob
import json
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from jax_ub import choice, config

__all__ = ["OpShape", "Recording", "load", "record"]

_log = logging.getLogger("jax_ub")

FORMAT = "jax_ub_shapes"  # the key (with the format version as value) that marks a shapes file
VERSION = 1
ROLES = ("forward", "backward")


OpShape = choice.OpShape  # one op at one global shape: op, tp, dtype, M, K, N


class Recording:
    """The op shapes seen while recording: ``shapes()`` lists them, ``save(path)`` writes them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (shape, role) -> traced calls at it; insertion order is first-seen order.
        self._calls: dict[tuple[OpShape, str], int] = {}

    def note(self, shape: OpShape, role: str) -> None:
        """Counts one traced call at ``shape`` in ``role``."""
        with self._lock:
            self._calls[(shape, role)] = self._calls.get((shape, role), 0) + 1

    def shapes(self, roles: Sequence[str] = ROLES) -> list[dict[str, Any]]:
        """``[{"op", "tp", "dtype", "M", "K", "N", "role", "calls"}, ...]`` in first-seen order."""
        with self._lock:
            items = list(self._calls.items())
        return [
            {**dataclasses.asdict(s), "role": role, "calls": n} for (s, role), n in items if role in roles
        ]

    def save(self, path: str, *, quiet: bool = False) -> None:
        """Writes the shapes file ``bench tune`` reads (atomically: a concurrent reader sees a
        whole file); an empty one with a WARNING unless ``quiet``."""
        doc = {FORMAT: VERSION, "shapes": self.shapes()}
        if not doc["shapes"] and not quiet:
            # Only ops traced while recording count: a function jitted (traced) before, or ops on an
            # axis of size 1 or with empty operands, leave nothing to tune.
            _log.warning(
                "jax_ub: %s gets no shapes: no jax_ub op over an axis of size > 1 was traced "
                "while recording (a function already traced is not traced again; "
                "jax.clear_caches() forces it)",
                path,
            )
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(doc, f, indent=1)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


_active: list[Recording] = []  # record() blocks, innermost last
_env: tuple[str, Recording] | None = None  # JAX_UB_RECORD_SHAPES: (path, its recording)
_env_lock = threading.Lock()


@contextlib.contextmanager
def record() -> Iterator[Recording]:
    """Records the shape of every jax_ub op traced inside the ``with`` block (blocks may nest;
    each sees every op traced while it is open)."""
    rec = Recording()
    _active.append(rec)
    try:
        yield rec
    finally:
        _active.remove(rec)


_launch: tuple[int, int] | None = None  # (process index, count) last seen while jax.distributed was up


def _process() -> tuple[int, int] | None:
    """(index, count) of this process in its ``jax.distributed`` launch, None without one. Also
    after ``jax.distributed.shutdown()`` (scripts call it before exit, and :func:`_at_exit` runs
    later): the layout seen while it was up, or the one jax keeps after shutdown."""
    global _launch
    import jax

    if jax.distributed.is_initialized():
        _launch = (jax.process_index(), jax.process_count())
        return _launch
    if _launch is not None:
        return _launch
    try:  # jax keeps the arguments of jax.distributed.initialize() after shutdown
        from jax._src import distributed

        index, count = distributed.global_state.process_id, distributed.global_state.num_processes
    except (ImportError, AttributeError):
        return None
    return (index, count) if isinstance(index, int) and isinstance(count, int) else None


def env_path(path: str) -> str:
    """The file ``JAX_UB_RECORD_SHAPES=path`` names in this process: ``path`` itself, or with
    several processes (``jax.distributed``), ``<stem>.process<i><ext>`` for process i, so that no
    process replaces the shapes another traced (pipeline stages trace different ones); give
    ``bench tune`` all of them. A process of such a launch names its own file also after
    ``jax.distributed.shutdown()``."""
    launch = _process()
    if launch is None or launch[1] == 1:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}.process{launch[0]}{ext or '.json'}"


def _env_recording() -> tuple[str, Recording] | None:
    global _env
    path = config.get().record_shapes
    if not path:
        return None
    with _env_lock:
        if _env is None or _env[0] != path:
            _env = (path, Recording())
        return _env


def note_call(
    op: str, tp: int, dtype: Any, x_shape: Sequence[int], w_shape: Sequence[int], *, backward: bool
) -> None:
    """Called by :mod:`jax_ub.ops` for each traced op call (after validation): records its shape,
    and with ``backward`` the dual op's shape that its backward runs. Cheap when nothing records."""
    env = _env_recording()
    if not _active and env is None:
        return
    M, K, N = choice.global_shape(op, tp, x_shape, w_shape)
    shape = OpShape(op, int(tp), np.dtype(dtype).name, M, K, N)
    notes = [(shape, "forward")] + ([(shape.dual(), "backward")] if backward else [])
    for rec in [*_active, *([env[1]] if env else [])]:
        for s, role in notes:
            rec.note(s, role)
    if env is not None:
        # Rewritten at every traced call (trace time only, so rarely): a crashed run keeps its
        # shapes, and the call counts are never stale.
        path = env_path(env[0])
        try:
            env[1].save(path)
        except OSError as e:
            _log.warning(
                "jax_ub: JAX_UB_RECORD_SHAPES=%r: cannot write the shapes file %r: %s", env[0], path, e
            )


def _at_exit() -> None:
    """With ``JAX_UB_RECORD_SHAPES`` set and no op recorded, says so (the file is otherwise
    written at each traced op, so a missing file would be the only sign) and writes the empty
    shapes file, unless one exists (another process's, or an earlier run's: not replaced)."""
    cfg = config._active  # not config.get(): a process that never read its configuration used no op
    if cfg is None or not cfg.record_shapes:
        return
    env = _env
    if env is not None and env[0] == cfg.record_shapes and env[1].shapes():
        return
    try:
        path = env_path(cfg.record_shapes)
    except Exception:  # jax half torn down: name the configured path
        path = cfg.record_shapes
    exists = os.path.exists(path)
    _log.warning(
        "jax_ub: JAX_UB_RECORD_SHAPES=%r: no jax_ub op over a mesh axis of size > 1 was "
        "traced in this process, so no shape was recorded (on a CPU machine, simulate the "
        "devices: XLA_FLAGS=--xla_force_host_platform_device_count=N; an axis of size 1, "
        "tp=1, runs a plain GEMM with nothing to tune)%s",
        cfg.record_shapes,
        f"; {path!r} exists and is left as it was" if exists else f"; wrote {path!r} without shapes",
    )
    if not exists:
        with contextlib.suppress(OSError):
            Recording().save(path, quiet=True)


atexit.register(_at_exit)


def load(path: str) -> list[tuple[OpShape, str, int]]:
    """The ``(shape, role, calls)`` entries of a shapes file, validated (a ValueError says what is
    wrong with which entry)."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        stem, ext = os.path.splitext(path)
        per_process = sorted(glob.glob(f"{glob.escape(stem)}.process*{glob.escape(ext or '.json')}"))
        hint = (
            f" (a run of several processes writes one file each: {', '.join(per_process)}; give them all)"
            if not os.path.exists(path) and per_process
            else ""
        )
        raise ValueError(f"shapes file {path!r}: cannot read it as JSON: {e}{hint}") from None
    if not isinstance(doc, dict) or FORMAT not in doc:
        raise ValueError(
            f"shapes file {path!r}: not a jax_ub shapes file (no {FORMAT!r} key); write "
            f"one with JAX_UB_RECORD_SHAPES=PATH or jax_ub.tuning.record()"
        )
    if doc[FORMAT] != VERSION:
        raise ValueError(
            f"shapes file {path!r}: format version {doc[FORMAT]!r}; this jax_ub reads version {VERSION}"
        )
    shapes = doc.get("shapes")
    if not isinstance(shapes, list):
        raise ValueError(f"shapes file {path!r}: 'shapes' must be a list; got {type(shapes).__name__}")
    out = []
    for i, entry in enumerate(shapes):
        where = f"shapes file {path!r}, entry {i}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: must be an object; got {entry!r}")
        missing = [k for k in ("op", "tp", "dtype", "M", "K", "N") if k not in entry]
        if missing:
            raise ValueError(f"{where}: missing {', '.join(map(repr, missing))}")
        if entry["op"] not in (choice.AG, choice.RS):
            raise ValueError(f"{where}: op must be {choice.AG!r} or {choice.RS!r}; got {entry['op']!r}")
        role = entry.get("role", "forward")
        if role not in ROLES:
            raise ValueError(f"{where}: role must be one of {ROLES}; got {role!r}")
        dims = {k: entry[k] for k in ("tp", "M", "K", "N", *(("calls",) if "calls" in entry else ()))}
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in dims.values()):
            raise ValueError(f"{where}: tp, M, K, N (and calls) must be positive integers; got {dims}")
        tp = entry["tp"]
        if tp < 2:
            raise ValueError(
                f"{where}: tp must be >= 2 (an op over one device communicates nothing: "
                f"there is nothing to tune); got {tp}"
            )
        if (
            entry["M"] % tp
            or (entry["op"] == choice.AG and entry["N"] % tp)
            or (entry["op"] == choice.RS and entry["K"] % tp)
        ):
            split = "M and N" if entry["op"] == choice.AG else "M and K"
            raise ValueError(
                f"{where}: {split} of an {entry['op']} shape must be divisible by tp={tp}; "
                f"got M={entry['M']}, K={entry['K']}, N={entry['N']}"
            )
        dtype = choice.dtype_name(entry["dtype"])
        if dtype is None:
            raise ValueError(
                f"{where}: dtype must be one of {', '.join(choice.DTYPES)} (the dtypes "
                f"jax_ub's ops take); got {entry['dtype']!r}"
            )
        out.append(
            (
                OpShape(entry["op"], tp, dtype, entry["M"], entry["K"], entry["N"]),
                role,
                int(entry.get("calls", 1)),
            )
        )
    return out
