"""The recorder behind :func:`jax_ub.summary` (:mod:`jax_ub.usage`): what the jax_ub ops of this
process ran, per path (CUDA or the pure-XLA reference) and method, the host time the CUDA ops'
FFI handlers took, and the failures; :func:`jax_ub.shutdown` logs it in one line.

Ops are counted when they are traced (a ``jax.jit`` function counts once per trace, not per run):
the public ops (:mod:`jax_ub.ops`) and the bulk ops (:mod:`jax_ub.bulk`) record the method they
resolved to; ``method="auto"`` is counted again, as ``auto->X``, where its per-call choice X is
made (:mod:`jax_ub.resolve`; that includes the backward's dual ops). Host time comes from the
communicators (:func:`jax_ub.comm.host_stats`): live ones at :func:`jax_ub.summary`, freed ones as
:func:`jax_ub.shutdown` last saw them (:func:`at_shutdown`).

This module imports no jax_ub module but :mod:`jax_ub.methods`: the ops, the resolver and the
communicators' lifecycle all call into it.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from jax_ub import methods

log = logging.getLogger("jax_ub")

CUDA, REFERENCE = "cuda", "reference"
AUTO_PENDING = "auto"  # the path of an "auto" op is known where auto chooses (auto->X)

_lock = threading.Lock()
_ops: collections.Counter[tuple[str, str, str]] = collections.Counter()  # (op, path, method)
_failures: list[str] = []
_host_freed: dict[tuple[str, int], dict[str, float]] = {}  # (axis, device) -> ops, host_s
_gpu_reference: list[int] = [0]  # ops that ran the reference on a CUDA GPU mesh (JAX_UB_ALLOW_REFERENCE)
_last_line = [""]  # what at_shutdown logged last
_MAX_FAILURES = 100  # the first ones; the count goes on


def path_of(method: str) -> str:
    """``"reference"`` for the pure-XLA method, ``"auto"`` while auto has not chosen, else ``"cuda"``."""
    if method == methods.XLA:
        return REFERENCE
    if method == methods.AUTO:
        return AUTO_PENDING
    return CUDA


def record(op: str, method: str) -> None:
    """One traced call of ``op`` (``"ag"``, ``"rs"``, ``"bulk_ag"``, ``"bulk_rs"``, ...) that
    resolved to ``method``."""
    with _lock:
        _ops[(op, path_of(method), method)] += 1


def record_auto(op: str, chosen: str) -> None:
    """``method="auto"`` chose ``chosen`` for one call of ``op``."""
    with _lock:
        _ops[(op, path_of(chosen), f"auto->{chosen}")] += 1


def record_gpu_reference() -> None:
    """An ``"auto"`` op runs the reference on a CUDA GPU mesh, allowed by ``JAX_UB_ALLOW_REFERENCE``."""
    with _lock:
        _gpu_reference[0] += 1


_failure_count = 0


def record_failure(what: str) -> None:
    """An op that failed (refused to run, or a communicator's error), in words."""
    global _failure_count
    with _lock:
        _failure_count += 1
        if len(_failures) < _MAX_FAILURES:
            _failures.append(" ".join(str(what).split()))


def note_freed(host: Mapping[tuple[str, int], Mapping[str, float]]) -> None:
    """The host stats of communicators about to be freed (their totals since initialize)."""
    with _lock:
        for key, h in host.items():
            _host_freed[key] = {"ops": float(h["ops"]), "host_s": float(h["host_s"])}


def reset() -> None:
    """Forgets everything recorded so far (tests; a new phase of a program)."""
    global _failure_count
    with _lock:
        _ops.clear()
        _failures.clear()
        _host_freed.clear()
        _gpu_reference[0] = 0
        _last_line[0] = ""
        _failure_count = 0


@dataclasses.dataclass(frozen=True)
class Summary:
    """What :func:`jax_ub.summary` returns; ``str()`` formats it.

    ``ops``: ``{(op, path, method): traced calls}`` (path ``"cuda"``, ``"reference"``, or
    ``"auto"`` for a call whose choice is counted under ``auto->X``); ``host``: ``{(axis, device):
    {"ops", "host_s", "host_us_per_op"}}`` from the CUDA ops' FFI handlers (none where no
    communicator ran an op); ``failures``: the first failures in words; ``failure_count``: all;
    ``gpu_reference``: traced ``"auto"`` ops that ran the reference on a CUDA GPU mesh because
    ``JAX_UB_ALLOW_REFERENCE=1`` allowed it.
    """

    ops: dict[tuple[str, str, str], int]
    host: dict[tuple[str, int], dict[str, float]]
    failures: list[str]
    failure_count: int
    gpu_reference: int = 0

    def per_path(self) -> dict[str, int]:
        """Traced calls per path (``"cuda"``, ``"reference"``); auto's counted where it chose."""
        out = {CUDA: 0, REFERENCE: 0}
        for (_, path, _), n in self.ops.items():
            if path in out:
                out[path] += n
        return out

    def host_us_per_op(self) -> float | None:
        """Mean host µs per CUDA op over every member, or None where none ran."""
        ops = sum(h["ops"] for h in self.host.values())
        return None if not ops else sum(h["host_s"] for h in self.host.values()) / ops * 1e6

    def line(self) -> str:
        """One line: ops per path, host µs per op, failures."""
        p = self.per_path()
        us = self.host_us_per_op()
        ran = sum(int(h["ops"]) for h in self.host.values())
        host = f"{ran} CUDA op runs at {us:.1f} host us/op" if us is not None else "no CUDA op ran"
        methods_ = ", ".join(
            f"{m}={n}" for m, n in sorted(_by_method(self.ops).items(), key=lambda kv: (-kv[1], kv[0]))
        )
        gpu = (
            f" ({self.gpu_reference} on a CUDA GPU mesh, JAX_UB_ALLOW_REFERENCE=1)"
            if self.gpu_reference
            else ""
        )
        return (
            f"jax_ub: traced ops: {p[CUDA]} cuda, {p[REFERENCE]} reference{gpu}"
            f"{f' ({methods_})' if methods_ else ''}; {host}; {self.failure_count} failure(s)"
        )

    def __str__(self) -> str:
        lines = [self.line()]
        if self.ops:
            lines.append("traced calls (op, path, method: count):")
            for (op, path, m), n in sorted(self.ops.items()):
                lines.append(f"  {op:8s} {path:9s} {m:18s} {n}")
        for (axis, dev), h in sorted(self.host.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
            lines.append(
                f"host: axis {axis!r} device {dev}: {int(h['ops'])} ops, "
                f"{h['host_us_per_op']:.1f} us/op on the host"
            )
        for f in self.failures:
            lines.append(f"failure: {f}")
        if self.failure_count > len(self.failures):
            lines.append(f"... and {self.failure_count - len(self.failures)} more failure(s)")
        return "\n".join(lines)


def _by_method(ops: Mapping[tuple[str, str, str], int]) -> dict[str, int]:
    out: collections.Counter[str] = collections.Counter()
    for (_, _, m), n in ops.items():
        out[m] += n
    return dict(out)


def snapshot(
    live_host: Mapping[tuple[str, int], Mapping[str, float]] | None = None,
    live_errors: Mapping[tuple[str, int], str] | None = None,
) -> Summary:
    """The recorded counts with the host stats of the live communicators (``live_host``, which
    replace a freed set's of the same key) and their sticky errors (``live_errors``)."""
    with _lock:
        host = {k: dict(v) for k, v in _host_freed.items()}
        for k, h in (live_host or {}).items():
            host[k] = {"ops": float(h["ops"]), "host_s": float(h["host_s"])}
        for h in host.values():
            h["host_us_per_op"] = h["host_s"] / h["ops"] * 1e6 if h["ops"] else 0.0
        failures = list(_failures)
        count = _failure_count
        for (axis, dev), msg in sorted((live_errors or {}).items(), key=lambda kv: str(kv[0])):
            failures.append(f"communicator of axis {axis!r} device {dev}: {' '.join(msg.split())}")
            count += 1
        return Summary(dict(_ops), host, failures, count, _gpu_reference[0])


def at_shutdown(
    host_stats: Callable[[], Mapping[tuple[str, int], Mapping[str, float]]],
    errors: Callable[[], Mapping[tuple[str, int], str]] | None = None,
) -> None:
    """Called by :func:`jax_ub.shutdown` before it frees anything: keeps the communicators' host
    stats and logs the summary's line: at INFO level (``JAX_UB_LOG=INFO`` shows it), at WARNING
    where an op failed or ran the reference on a CUDA GPU mesh (``JAX_UB_ALLOW_REFERENCE=1``).
    Never raises: shutdown must go on."""
    try:
        try:
            host = dict(host_stats())
            errs = dict(errors()) if errors is not None else {}
        except Exception as e:  # no extension, or a set half gone: the counts still stand
            log.debug("jax_ub: no host stats at shutdown: %s", e)
            host, errs = {}, {}
        note_freed(host)
        s = snapshot(live_errors=errs)
        line = s.line()
        if (s.ops or s.host or s.failure_count) and line != _last_line[0]:  # a second shutdown: once
            _last_line[0] = line
            loud = s.failure_count or s.gpu_reference
            log.log(logging.WARNING if loud else logging.INFO, "%s", line)
    except Exception as e:  # a report must not stop a shutdown
        log.debug("jax_ub: usage summary at shutdown failed: %s", e)


def as_dict(s: Summary) -> dict[str, Any]:
    """``s`` as plain data (JSON-friendly keys)."""
    return {
        "ops": [{"op": o, "path": p, "method": m, "count": n} for (o, p, m), n in sorted(s.ops.items())],
        "per_path": s.per_path(),
        "host": [{"axis": a, "device": d, **h} for (a, d), h in sorted(s.host.items(), key=str)],
        "host_us_per_op": s.host_us_per_op(),
        "failures": list(s.failures),
        "failure_count": s.failure_count,
        "gpu_reference": s.gpu_reference,
    }
