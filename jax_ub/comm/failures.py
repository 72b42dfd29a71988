"""jax_ub's reason for a failed op, where the exception a program sees is XLA's.

When a jax_ub op fails on the GPU (a peer timed out, exited, or ran another op), the watchdog
aborts it and XLA raises its own error when the program next reads a result:
``CUDA_ERROR_LAUNCH_FAILED: unspecified launch failure`` on transport ``ipc``, an NCCL error on
``nccl``. That exception is raised by XLA's runtime, outside any jax_ub code, and the FFI handler
of a later call never runs (the CUDA context is unusable), so jax_ub cannot replace it. It keeps
the reason on the host instead (:func:`jax_ub.comm.errors`, also written to stderr when the op
fails), and brings it to the exception in two ways:

* :func:`raise_if_failed` — call it in an ``except`` around a step: it raises
  :class:`CommFailedError` with every local member's reason (chained from XLA's exception), or
  returns where jax_ub saw no failure (the exception was not jax_ub's)::

      try:
          loss = train_step(state, batch)
      except Exception as err:
          jax_ub.comm.raise_if_failed(err)  # jax_ub's reason, if it was a jax_ub op
          raise

* an uncaught exception: :func:`jax_ub.initialize` installs a ``sys.excepthook`` that, where
  jax_ub has a failure to tell, adds the reasons to the exception as a note (shown under XLA's
  traceback) and writes them first on stderr. XLA's exception stands as raised.

A helper rather than a rewrite of the exception: jax_ub sees XLA's exception only where the
program hands it over, and a program that catches XLA's errors to retry or checkpoint keeps the
type it catches.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["CommFailedError", "failure_reasons", "raise_if_failed"]


class CommFailedError(RuntimeError):
    """A jax_ub op failed on this process; ``reasons`` maps (axis, CUDA device) to jax_ub's
    reason (the watchdog's message: which peer, which op and epoch, and why)."""

    def __init__(self, message: str, reasons: dict[tuple[str, int], str]) -> None:
        super().__init__(message)
        self.reasons = dict(reasons)


def failure_reasons() -> dict[tuple[str, int], str]:
    """Every local member's sticky error, of the active communicator sets and of those that
    :func:`jax_ub.shutdown` had to leave allocated; empty where none failed or none exist. Never
    raises: a member that cannot be read is skipped."""
    try:
        return dict(_source())
    except Exception:  # nothing to tell then
        return {}


def _no_source() -> dict[tuple[str, int], str]:
    return {}


# Set by jax_ub.comm.lifecycle, which holds the communicator sets (it imports this module, not
# the other way round).
_source: Callable[[], dict[tuple[str, int], str]] = _no_source


def _no_peers() -> list[str]:
    return []


_peers: Callable[[], list[str]] = _no_peers


def set_source(
    source: Callable[[], dict[tuple[str, int], str]], peers: Callable[[], list[str]] | None = None
) -> None:
    """Where the reasons (and the exited peers) come from: jax_ub.comm.lifecycle's sets."""
    global _source, _peers
    _source = source
    _peers = peers or _no_peers


def exited_peers() -> list[str]:
    """The peer processes known to have exited (jax_ub.comm.liveness), one sentence each; the
    NCCL transport cannot say which peer an op missed, and this can. Never raises."""
    try:
        return list(_peers())
    except Exception:  # nothing to tell then
        return []


def _message(reasons: dict[tuple[str, int], str]) -> str:
    lines = [f"  axis {axis!r}, device {dev}: {why}" for (axis, dev), why in sorted(reasons.items())]
    gone = exited_peers()
    return (
        "jax_ub: a communication op failed on this process (the exception XLA raised for it says "
        "only that the GPU aborted); jax_ub's reason:\n"
        + "\n".join(lines)
        + ("\n  peers known to have exited: " + "; ".join(gone) if gone else "")
    )


def raise_if_failed(cause: BaseException | None = None) -> None:
    """Raises :class:`CommFailedError` with jax_ub's reasons where a jax_ub op failed on this
    process (chained from ``cause``, e.g. the XLA exception just caught); returns otherwise."""
    reasons = failure_reasons()
    if reasons:
        raise CommFailedError(_message(reasons), reasons) from cause


_hook_lock = threading.Lock()
_hook_installed = False


def install_excepthook() -> None:
    """Wraps ``sys.excepthook`` once (see the module's docstring); the previous hook still runs."""
    global _hook_installed
    with _hook_lock:
        if _hook_installed:
            return
        _hook_installed = True
        previous = sys.excepthook

        def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
            try:
                reasons = {} if isinstance(value, CommFailedError) else failure_reasons()
                if reasons:
                    text = _message(reasons)
                    sys.stderr.write(text + "\n")
                    sys.stderr.flush()
                    if hasattr(value, "add_note"):
                        value.add_note(text)
            except Exception:  # the original exception is what matters here
                pass
            previous(kind, value, tb)

        sys.excepthook = hook
