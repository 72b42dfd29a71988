"""Check that every process of a ``jax.distributed`` run is fit to go on, before its first collective.

A multi-process program that validates its configuration on each process (flags, divisibility, a
CUDA method where the extension is missing) and exits on the process that fails leaves its peers
waiting for it in their next collective, until jax.distributed's heartbeat timeout (100 s) aborts
them with a message about a missing task rather than the cause. And processes started with
different settings (``--steps``, a seed, a dtype) run different programs: they hang in a collective
or quietly train something else. :func:`check_processes` is the step in between: every process
passes its own verdict (``problem``: None, or why it cannot run) and the settings that must be
equal; every process then stops with the same message, naming each process that failed and why,
or each setting that differs, or goes on together::

    problem = validate(args)            # None, or "--heads (6) must be divisible by tp (4)"
    try:
        jax_ub.check_processes({"steps": args.steps, "seed": args.seed}, problem=problem)
    except jax_ub.ProcessCheckError as e:   # also AgreementError, PeerTimeoutError
        print(f"error: {e}", file=sys.stderr)
        os._exit(2)

It runs over jax.distributed's key-value store (no device, no collective), so it works before any
mesh exists and on every backend. Every process must call it the same number of times.
"""

from __future__ import annotations

import itertools
import json
import math
import threading
from collections.abc import Mapping

from jax_ub import _bootstrap, config

__all__ = ["ProcessCheckError", "check_processes"]


class ProcessCheckError(RuntimeError):
    """Some process of the run passed a ``problem`` to :func:`check_processes` (the same message on
    every process, naming each such process and its problem)."""


_calls = itertools.count(1)
_lock = threading.Lock()


def _exchange(timeout_s: float) -> _bootstrap.KVExchange | None:
    """This call's process-wide exchange; None without jax.distributed or with one process.

    From jax.distributed's own state, not ``jax.process_count()``: that one starts the backend,
    and on CPU with several processes starting it is a collective (Gloo's), which would wait for
    the very process that failed its checks before reaching any backend."""
    with _lock:
        call = next(_calls)
    try:
        from jax._src import distributed
    except ImportError:  # pragma: no cover - jax without the module: no jax.distributed either
        return None
    state = distributed.global_state
    count, index = int(getattr(state, "num_processes", 1) or 1), int(getattr(state, "process_id", 0) or 0)
    if getattr(state, "client", None) is None or count == 1:
        return None
    return _bootstrap.KVExchange(f"jax_ub/check{call}/processes", index, count, timeout_s,
                                 client=state.client,
                                 peer_names=[f"process {p}" for p in range(count)])


def check_processes(fields: Mapping[str, object] | None = None, *, problem: str | None = None,
                    timeout_s: float | None = None) -> None:
    """Collective over every process of a ``jax.distributed`` run: returns on every process, or
    raises on every process.

    Args:
      fields: settings that must be equal on every process (names to JSON-able values; tuples equal
        lists, other values compare by ``str``). Leave out what differs by design (the process id).
      problem: None where this process can go on; else why it cannot (one line, shown to every
        process as ``process i: problem``).
      timeout_s: how long to wait for the other processes (default ``JAX_UB_TIMEOUT``; its own
        default where a JAX_UB_* setting cannot be read, so that a process whose problem is a bad
        setting still takes part).

    Raises:
      ProcessCheckError: some process passed a ``problem``; lists every such process and its
        problem. Raised before the fields are compared (a process that failed its own checks has
        settings that may not mean anything).
      AgreementError: the ``fields`` differ; names each process that differs from process 0 and
        each differing field with both values.
      PeerTimeoutError: some process did not call within ``timeout_s``; names every such process.

    With one process (no ``jax.distributed``, or a run of one), it raises ProcessCheckError where
    ``problem`` is given and otherwise returns; there is nothing to compare.
    """
    if fields is not None and not isinstance(fields, Mapping):
        raise TypeError(f"check_processes: `fields` must be a mapping of setting names to values "
                        f"(e.g. vars(args)); got {type(fields).__name__}")
    if fields is not None and not all(isinstance(k, str) for k in fields):
        raise TypeError(f"check_processes: the names in `fields` must be str; got "
                        f"{sorted(map(repr, fields))}")
    if problem is not None and not isinstance(problem, str):
        raise TypeError(f"check_processes: `problem` must be None or a str saying why this process "
                        f"cannot go on; got {type(problem).__name__}")
    if problem is not None and not problem.strip():
        raise ValueError("check_processes: `problem` must say why this process cannot go on; got an "
                         "empty string (pass None where there is no problem)")
    if timeout_s is None:
        try:
            timeout_s = config.get().timeout_s
        except ValueError:  # a bad JAX_UB_* setting: likely this process's problem; still take part
            timeout_s = config.Config.timeout_s
    elif isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not (
            math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"check_processes: timeout_s must be a finite number of seconds > 0; "
                         f"got {timeout_s!r}")
    exchange = _exchange(float(timeout_s))
    if exchange is None:
        if problem is not None:
            raise ProcessCheckError(f"process 0: {problem}")
        return
    blobs = exchange._all_gather("check_processes", "problems",
                                 json.dumps({"problem": problem}).encode(),
                                 reached="call jax_ub.check_processes()")
    problems = {}
    for p, blob in enumerate(blobs):
        try:
            said = json.loads(blob)["problem"]
        except (ValueError, KeyError, TypeError):
            said = f"<unreadable answer {blob[:80]!r}: another jax_ub version?>"
        if said is not None:
            problems[p] = said
    if problems:
        exchange.settle("problems")  # every process has read the answers before any leaves
        many = len(problems) > 1
        raise ProcessCheckError(
            f"{len(problems)} of {exchange.world} processes cannot go on"
            + (":\n" if many else ": ")
            + "\n".join(f"{'  ' if many else ''}process {p}: {text}" for p, text in problems.items()))
    if fields is not None:
        _bootstrap.agree(exchange, dict(fields), tag="fields",
                         must="every process must be started with the same settings", unit="process",
                         caller="jax_ub.check_processes")

