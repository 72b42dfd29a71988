"""``jax_ub.summary()``: what the jax_ub ops of this process ran, per path (CUDA or the pure-XLA
reference) and method, the host µs per CUDA op, and the failures (:mod:`jax_ub._usage` records
them; :func:`jax_ub.shutdown` logs the same summary in one line)."""

from __future__ import annotations

import logging
from typing import Any

from jax_ub import _usage, comm

log = logging.getLogger("jax_ub")

Summary = _usage.Summary


def summary(*, print_it: bool = False) -> _usage.Summary:
    """What jax_ub ran so far in this process, as a :class:`Summary` (``str()`` formats it; its
    ``line()`` is the one line :func:`jax_ub.shutdown` logs). ``print_it``: also print it.

    * ``ops``: traced calls per ``(op, path, method)``: path ``"cuda"`` or ``"reference"``;
      ``method="auto"`` calls appear as ``("ag", "auto", "auto")`` and again under the choice
      made for them, ``auto->ring`` (forward and backward);
    * ``host``: per live communicator (and those :func:`jax_ub.shutdown` freed), the CUDA ops run
      and the host µs each took in the FFI handler (``host_us_per_op``);
    * ``failures``: ops that refused to run (e.g. a CUDA GPU mesh without the CUDA path) and
      communicators' errors.

    Counts are per trace: a ``jax.jit`` function called many times counts once.
    """
    live_host: dict[Any, Any] = {}
    live_errors: dict[Any, Any] = {}
    if comm._sets:  # live communicators (host_stats needs the extension, which they imply)
        try:
            live_host, live_errors = dict(comm.host_stats()), dict(comm.errors())
        except Exception as e:  # the extension is not loaded: no communicator can run an op
            log.debug("jax_ub.summary: no host stats: %s", e)
    s = _usage.snapshot(live_host, live_errors)
    if print_it:
        print(s)
    return s


def reset() -> None:
    """Forgets what was recorded (e.g. between a warm-up and the measured phase)."""
    _usage.reset()
