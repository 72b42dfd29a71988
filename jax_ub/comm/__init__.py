"""Userbuffers communicators: :func:`initialize` / :func:`shutdown` and what they are built from.

* :mod:`~jax_ub.comm.lifecycle` — ``initialize`` / ``shutdown``, the communicator set of each mesh
  axis (:class:`CommSet`), buffer growth, sticky errors and host time per member;
* :mod:`~jax_ub.comm.bootstrap` — the key-value rendezvous and agreement between processes;
* :mod:`~jax_ub.comm.transport` — ``ipc`` or ``nccl`` for an axis, and why;
* :mod:`~jax_ub.comm.p2p` — which GPUs of a group can map each other's memory;
* :mod:`~jax_ub.comm.nccl` — NCCL communicators made from Python (bootstrap and transport nccl);
* :mod:`~jax_ub.comm.processes` — :func:`jax_ub.check_processes`;
* :mod:`~jax_ub.comm.liveness` — whether a peer process has exited, for the bootstrap's waits;
* :mod:`~jax_ub.comm.failures` — jax_ub's reason for a failed op, where XLA raised its own error.

Nothing here touches a GPU or another process at import time.
"""

# Beside the public names: internals the tests and jax_ub.doctor read as jax_ub.comm.<name> (the
# same objects as in the module that defines them; to rebind one with monkeypatch, patch it there).
from jax_ub.comm.failures import CommFailedError, failure_reasons, raise_if_failed
from jax_ub.comm.lifecycle import (  # noqa: F401
    _BOOTSTRAP_KEY,
    CommSet,
    _abandoned,
    _destroy_quietly,
    _inject_failure,
    _sets,
    _warned_axes,
    ensure_capacity,
    errors,
    get,
    host_stats,
    initialize,
    shutdown,
    warn_no_communicator,
)
from jax_ub.comm.transport import IMPLEMENTED_TRANSPORTS
from jax_ub.comm.transport import choose_transport as _choose_transport  # noqa: F401
from jax_ub.comm.transport import survey as _survey  # noqa: F401

__all__ = [
    "IMPLEMENTED_TRANSPORTS",
    "CommFailedError",
    "CommSet",
    "ensure_capacity",
    "errors",
    "failure_reasons",
    "get",
    "host_stats",
    "initialize",
    "raise_if_failed",
    "shutdown",
    "warn_no_communicator",
]
