"""Check that every process of a ``jax.distributed`` run is fit to go on, before its first collective.

A multi-process program that validates its configuration on each process (flags, divisibility, a
CUDA method where the extension is missing) and exits on the process that fails leaves its peers
waiting for it in their next collective, until jax.distributed's heartbeat timeout (100 s) aborts
them with a message about a missing task rather than the cause. And processes started with
different settings (``--steps``, a seed, a dtype) run different programs: they hang in a collective
or quietly train something else. :func:`check_processes` is the step in between: every process
passes its own verdict (``problem``: None, or why it cannot run) and the settings that must be
equal; then every process goes on, or every process stops with the same message, naming each
process that failed and why, and each setting that differs::

    problem = validate(args)            # None, or "--heads (6) must be divisible by tp (4)"
    if problem:
        print(f"error: {problem}", file=sys.stderr)   # said here, whatever the others do
    try:
        jax_ub.check_processes({"steps": args.steps, "seed": args.seed}, problem=problem)
    except (jax_ub.ProcessCheckError, jax_ub.AgreementError, jax_ub.PeerTimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        os._exit(2)

It runs over jax.distributed's key-value store (no device, no collective, no backend), so it works
before any mesh exists and on every backend. Every process of the run must make the same calls:
the calls are numbered, counting only those made after ``jax.distributed.initialize()`` in a run of
several processes.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import threading
from collections.abc import Mapping
from typing import Any, cast

from jax_ub import config
from jax_ub.comm import bootstrap

__all__ = ["ProcessCheckError", "check_processes"]

_WHO = "jax_ub.check_processes"


class ProcessCheckError(RuntimeError):
    """Some process of the run passed a ``problem`` to :func:`check_processes`: the same message
    on every process, naming each such process and its problem. ``problems`` maps each such
    process index to its problem; ``differences``: one line per process whose settings differ
    from process 0's as well; ``missing``: the processes that never came (then only this
    process's own problem is known)."""

    def __init__(
        self,
        message: str,
        problems: Mapping[int, str],
        differences: list[str] | None = None,
        missing: list[int] | None = None,
    ) -> None:
        super().__init__(message)
        self.problems = dict(problems)
        self.differences = list(differences or [])
        self.missing = list(missing or [])


_calls = itertools.count(1)
_lock = threading.Lock()
_NEARBY = 8  # on a timeout, how many call numbers around this one to look at for a peer
_GAVE_UP = "gave-up"  # the key a process that timed out leaves: {namespace}/gave-up/{process}


def _distributed() -> tuple[Any, int, int] | None:
    """(jax.distributed's client, this process, the process count), or None without
    jax.distributed or with one process. From jax.distributed's own state, not
    ``jax.process_count()``: that one starts the backend, and on CPU with several processes
    starting it is a collective (Gloo's), which would wait for the very process that failed its
    checks before reaching any backend."""
    try:
        from jax._src import distributed
    except ImportError:  # pragma: no cover - jax without the module: no jax.distributed either
        return None
    state = distributed.global_state
    client = getattr(state, "client", None)
    count = int(getattr(state, "num_processes", 1) or 1)
    if client is None and count > 1:
        # jax.distributed.shutdown() keeps the process count and drops the client: a run of several
        # processes whose key-value service is gone, not a run of one.
        raise RuntimeError(
            f"{_WHO}: jax.distributed was shut down in this run of {count} processes (this is process "
            f"{int(getattr(state, 'process_id', 0) or 0)}), so the processes cannot be compared any "
            f"more: call {_WHO}() before jax.distributed.shutdown()"
        )
    if client is None or count == 1:
        return None
    return client, int(getattr(state, "process_id", 0) or 0), count


def _namespace(call: int) -> str:
    return f"jax_ub/check{call}/processes"


def _argument_errors(fields: Any, problem: Any, timeout_s: Any) -> dict[str, Exception]:
    """What is wrong with each argument ("fields", "problem", "timeout_s"): an exception to raise
    once the others know; the arguments not named here are fine and are used."""
    out: dict[str, Exception] = {}
    if fields is not None and not isinstance(fields, Mapping):
        out["fields"] = TypeError(
            f"{_WHO}: `fields` must be a mapping of setting names to values "
            f"(e.g. vars(args)); got {type(fields).__name__}"
        )
    elif fields is not None and not all(isinstance(k, str) for k in fields):
        out["fields"] = TypeError(
            f"{_WHO}: the names in `fields` must be str; got {sorted(map(repr, fields))}"
        )
    elif fields is not None:
        try:
            bootstrap._canonical(dict(fields))
        except (TypeError, ValueError) as e:  # a tuple-keyed dict inside, a cycle
            out["fields"] = TypeError(
                f"{_WHO}: `fields` cannot be encoded as JSON (values are "
                f"compared as JSON; keys inside must be str): {e}"
            )
    if problem is not None and not isinstance(problem, str):
        out["problem"] = TypeError(
            f"{_WHO}: `problem` must be None or a str saying why this process "
            f"cannot go on; got {type(problem).__name__}"
        )
    elif problem is not None and not problem.strip():
        out["problem"] = ValueError(
            f"{_WHO}: `problem` must say why this process cannot go on; got "
            f"an empty string (pass None where there is no problem)"
        )
    if timeout_s is not None and (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, (int, float))
        or not (math.isfinite(timeout_s) and timeout_s > 0)
    ):
        out["timeout_s"] = ValueError(
            f"{_WHO}: timeout_s must be a finite number of seconds > 0; got {timeout_s!r}"
        )
    elif timeout_s is not None and not config.MIN_TIMEOUT_S <= timeout_s <= config.MAX_TIMEOUT_S:
        out["timeout_s"] = ValueError(
            f"{_WHO}: timeout_s must be a number of seconds from {config.MIN_TIMEOUT_S} to "
            f"{config.MAX_TIMEOUT_S:g} (one week); got {timeout_s!r}"
        )
    return out


def _default_timeout() -> float:
    try:
        return config.get().timeout_s
    except ValueError:  # a bad JAX_UB_* setting: likely this process's problem; still take part
        return config.Config.timeout_s


def check_processes(
    fields: Mapping[str, object] | None = None, *, problem: str | None = None, timeout_s: float | None = None
) -> None:
    """Collective over every process of a ``jax.distributed`` run: returns on every process, or
    raises on every process that takes part.

    Args:
      fields: settings that must be equal on every process (names to JSON-able values; tuples equal
        lists, other values compare by ``str``; None is no settings). Leave out what may differ:
        the process id, how a process was launched or reaches the coordinator.
      problem: None where this process can go on; else why it cannot (shown to every process as
        ``process i: problem``). Print it yourself too: should a peer never come, this process
        learns nothing from the others, and its peers may be aborted by jax before they read it.
      timeout_s: how long to wait for the other processes (default ``JAX_UB_TIMEOUT``; its own
        default where a JAX_UB_* setting cannot be read, so that a process whose problem is a bad
        setting still takes part).

    Raises:
      ProcessCheckError: some process passed a ``problem``; lists every such process and its
        problem, and any setting that differs as well. The same message on every process.
        Also raised, with this process's problem, where this process passed one and a peer did not
        come within ``timeout_s`` (its message names the peer).
      AgreementError: no problem, but the ``fields`` differ: names each process that differs from
        process 0 and each differing field with both values. The same message on every process.
      PeerTimeoutError: some process did not call within ``timeout_s``; names every such process,
        and its latest call of check_processes where it made another one (a later one: the
        processes did not make the same calls). Also raised on a process that arrives after a peer
        gave up waiting for it: it does not go on alone. Where a process has exited, at once
        (``PeerExitedError``, a PeerTimeoutError), not at the timeout.
      TypeError, ValueError: bad arguments, on the process that passed them, after it took part
        (the others get a ProcessCheckError naming it), so that none of them waits for it.
      RuntimeError: jax.distributed's key-value service failed or is gone (e.g.
        ``jax.distributed.shutdown()`` ran already); the message says which key could not be read.

    With one process (no ``jax.distributed``, or a run of one), it raises ProcessCheckError where
    ``problem`` is given and otherwise returns; there is nothing to compare. Such a call is not
    counted among the numbered calls.
    """
    refused = _argument_errors(fields, problem, timeout_s)
    bad_arguments = next(iter(refused.values()), None)
    if bad_arguments is not None:  # take part anyway, with what is usable, and say why
        fields = None if "fields" in refused else fields
        timeout_s = None if "timeout_s" in refused else timeout_s
        why = f"{_WHO}() refused its arguments here: " + str(bad_arguments).removeprefix(f"{_WHO}: ")
        problem = why if "problem" in refused or problem is None else f"{problem}; and {why}"
    timeout = _default_timeout() if timeout_s is None else float(timeout_s)
    where = _distributed()
    if where is None:
        if bad_arguments is not None:
            raise bad_arguments
        if problem is not None:
            raise ProcessCheckError(f"{_WHO}: process 0 cannot go on: {problem}", {0: problem})
        return
    client, me, count = where
    with _lock:
        call = next(_calls)
    exchange = bootstrap.KVExchange(
        _namespace(call),
        me,
        count,
        timeout,
        client=client,
        peer_names=[f"process {p}" for p in range(count)],
        processes=range(count),
    )
    text = bootstrap._canonical(dict(fields or {}))
    payload = json.dumps({"problem": problem, "fields": text}).encode()
    try:
        blobs = exchange._all_gather("check_processes", "answers", payload, reached=f"call {_WHO}()")
    except bootstrap.PeerExitedError as err:
        # A process exited before it answered: every process that waits for it learns it at once.
        with contextlib.suppress(Exception):
            exchange._store.set(exchange._key(_GAVE_UP, me), b"")
        message = str(err).split(": ", 1)[-1]
        if problem is not None:
            gone = _peers_with(exchange, "answers", present=False)
            raise ProcessCheckError(
                f"{_WHO}: process {me} cannot go on: {problem}; and {message}", {me: problem}, missing=gone
            ) from err
        raise bootstrap.PeerExitedError(f"{_WHO}: {message}") from err
    except bootstrap.PeerTimeoutError as err:
        # Say so before looking once more: a late process that then reads every answer sees this
        # mark and raises too, instead of going on alone into a collective.
        with contextlib.suppress(Exception):
            exchange._store.set(exchange._key(_GAVE_UP, me), b"")
        missing = _peers_with(exchange, "answers", present=False)
        if missing:
            message = _timeout_message(exchange, call, timeout_s is None, missing)
            if problem is not None:
                raise ProcessCheckError(
                    f"{_WHO}: process {me} cannot go on: {problem}; and {message}",
                    {me: problem},
                    missing=missing,
                ) from err
            raise bootstrap.PeerTimeoutError(f"{_WHO}: {message}") from err
        # Every answer came in the end; read them once more. A probe that fails now (the
        # service went away with a process that exited) leaves that process unread: it counts as
        # missing, with the timeout's message, not as an unreadable answer.
        peeked = [payload if p == me else _peek(exchange, exchange._key("answers", p)) for p in range(count)]
        unread = [p for p, blob in enumerate(peeked) if blob is None]
        if unread:
            message = _timeout_message(exchange, call, timeout_s is None, unread)
            if problem is not None:
                raise ProcessCheckError(
                    f"{_WHO}: process {me} cannot go on: {problem}; and {message}",
                    {me: problem},
                    missing=unread,
                ) from err
            raise bootstrap.PeerTimeoutError(f"{_WHO}: {message}") from err
        blobs = cast("list[bytes]", peeked)
    else:
        gave_up = _peers_with(exchange, _GAVE_UP)
        if gave_up:
            names = ", ".join(map(str, gave_up))
            raise bootstrap.PeerTimeoutError(
                f"{_WHO}: process {me} arrived after process{'es' if len(gave_up) > 1 else ''} "
                f"{names} had given up waiting for it (their timeout: JAX_UB_TIMEOUT or timeout_s), "
                f"so they have stopped and this process stops too"
            )
    answers = [_decode(blob) for blob in blobs]
    problems = {p: said for p, (said, _) in enumerate(answers) if said is not None}
    differing = _differences([table for _, table in answers])
    differ = [f"  {who}: {diffs}" for who, diffs in _grouped(differing)]  # alike: one line
    if problems or differ:
        exchange.settle("answers")  # every process has read the answers before any leaves
    if bad_arguments is not None:
        raise bad_arguments
    if problems:
        groups = _grouped(problems)  # 64 processes with one bad flag: one line, not 64
        many = len(groups) > 1
        body = "\n".join(f"{'  ' if many else ''}{who}: {_indent(said, many)}" for who, said in groups)
        also = ("\nThe processes' settings differ as well:\n" + "\n".join(differ)) if differ else ""
        raise ProcessCheckError(
            f"{_WHO}: {len(problems)} of {count} processes cannot go on"
            + (":\n" if many else ": ")
            + body
            + also,
            problems,
            differ,
        )
    if differ:
        bad = len(differing)
        raise bootstrap.AgreementError(
            f"{_WHO}: the {count} processes disagree; every process must be started with the same "
            f"settings. {bad} process{'es differ' if bad > 1 else ' differs'} from process 0:\n"
            + "\n".join(differ)
        )


def _decode(blob: bytes) -> tuple[str | None, dict[str, Any] | None]:
    """(problem, fields) of one process's answer; an unreadable answer is a problem."""
    try:
        answer = json.loads(blob)
        fields = json.loads(answer["fields"])
        said = answer["problem"]
        if said is not None and not isinstance(said, str):
            raise TypeError
        return said, fields if isinstance(fields, dict) else None
    except (ValueError, KeyError, TypeError):
        return f"<unreadable answer {blob[:80]!r}: another jax_ub version?>", None


def _differences(tables: list[dict[str, Any] | None]) -> dict[int, str]:
    """Each process whose fields differ from process 0's: each such field with both values."""
    base = tables[0]
    out = {}
    for p, table in enumerate(tables[1:], start=1):
        if base is None or table is None:
            continue  # its unreadable answer is listed among the problems
        diffs = bootstrap._diffs(base, table, unit="process")
        if diffs:
            out[p] = "; ".join(f"{name}={values}" for name, values in diffs)
    return out


def _grouped(texts: Mapping[int, str]) -> list[tuple[str, str]]:
    """("process 3" or "processes 0-2, 5", text) per distinct text (a problem, or how settings
    differ), in process order."""
    by_text: dict[str, list[int]] = {}
    for p, said in sorted(texts.items()):
        by_text.setdefault(said, []).append(p)
    out = []
    for said, procs in by_text.items():
        runs: list[str] = []
        start: int | None = procs[0]
        for a, b in zip(procs, [*procs[1:], None], strict=True):
            if b is None or b != a + 1:  # a run of consecutive processes ends at a
                runs.append(str(start) if start == a else f"{start}-{a}")
                start = b
        out.append((f"process{'es' if len(procs) > 1 else ''} {', '.join(runs)}", said))
    return out


def _indent(text: str, many: bool) -> str:
    return text.replace("\n", "\n    " if many else "\n  ")


def _peek(exchange: bootstrap.KVExchange, key: str) -> bytes | None:
    """The value of ``key`` if present now; None if not, or if the probe failed."""
    try:
        return exchange._store.try_get(key)
    except Exception:  # a failed probe: not seen
        return None


def _peers_with(exchange: bootstrap.KVExchange, tag: str, present: bool = True) -> list[int]:
    """The other processes whose ``tag`` key is present now (or, with ``present=False``, absent)."""
    return [
        p
        for p in range(exchange.world)
        if p != exchange.rank and (_peek(exchange, exchange._key(tag, p)) is not None) == present
    ]


def _timeout_message(exchange: bootstrap.KVExchange, call: int, default: bool, missing: list[int]) -> str:
    """Which processes did not call within the timeout, and where one of them is at another
    numbered call of check_processes, which (the processes did not make the same calls)."""
    me, count, timeout = exchange.rank, exchange.world, exchange.timeout_s
    elsewhere = []
    for p in missing:
        # Its latest call among the nearby numbers. Later than this one: the processes did not make
        # the same calls. Earlier: it may just be slow, or have stopped since.
        for other in range(call + _NEARBY, max(0, call - _NEARBY), -1):
            if other == call:
                continue
            if _peek(exchange, f"{_namespace(other)}/answers/{p}") is not None:
                elsewhere.append(
                    f"process {p} made its call {other} of {_WHO}() already, this process is at "
                    f"its call {call}: every process must make the same calls"
                    if other > call
                    else f"process {p}'s latest call of {_WHO}() was its call {other}"
                )
                break
    names = ", ".join(map(str, missing)) or "?"
    several = len(missing) > 1
    return (
        f"process {me} waited {timeout:g} s for process{'es' if several else ''} {names} of "
        f"{count}, which did not call {_WHO}() (this process's call {call}); "
        + ("; ".join(elsewhere) + "; " if elsewhere else "")
        + f"{'are they' if several else 'is it'} running, and did {'they' if several else 'it'} "
        f"stop before the check? (timeout: " + ("JAX_UB_TIMEOUT" if default else "timeout_s") + ")"
    )
