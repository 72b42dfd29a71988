"""Which transport :func:`jax_ub.initialize` uses for a mesh axis, and why.

``ipc`` (peer-mapped memory, the copy engine) where every pair of GPUs of each TP group can map each
other's memory; ``nccl`` where a group spans hosts, where a pair cannot map each other's memory, or
where nobody could check it. Every process reports what it can check (:mod:`jax_ub.comm.p2p`) and
every process reads the same reports, so every process chooses alike.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import jax

from jax_ub import _ext
from jax_ub.comm import bootstrap, p2p

log = logging.getLogger("jax_ub")

# Transports initialize() can set up (jax_ub.doctor reads this).
IMPLEMENTED_TRANSPORTS = ("ipc", "nccl")


def device_ordinal(d: Any) -> int:
    """The CUDA ordinal of a jax device of this process (its id where jax gives none)."""
    hw = getattr(d, "local_hardware_id", None)
    return int(hw if hw is not None else d.id)


def survey(
    exchange: bootstrap.KVExchange | None, groups: list[list[Any]]
) -> tuple[list[str], list[tuple[Any, Any]], list[tuple[Any, Any, str]]]:
    """(host id of every process, pairs of devices of one group that cannot map each other, pairs
    nobody could check and why): every process reports what it can check (:mod:`jax_ub.comm.p2p`) and
    all read the same reports, so :func:`choose_transport` chooses the same on every process."""
    me = jax.process_index()
    members = {str(d.id): device_ordinal(d) for g in groups for d in g if d.process_index == me}
    report = p2p.local_report(_ext.extension(), members, use_nvml=exchange is not None)
    if exchange is None:
        return p2p.judge([report], groups)
    blobs = exchange.all_gather("survey", json.dumps(report).encode())
    return p2p.judge([json.loads(b.decode()) for b in blobs], groups)


def _gpu(d: Any, several_processes: bool) -> str:
    return f"GPU {d.id} (process {d.process_index})" if several_processes else f"GPU {d.id}"


def choose_transport(
    requested: str,
    groups: list[list[Any]],
    hosts: list[str],
    bad_pairs: list[tuple[Any, Any]],
    unverified: Sequence[tuple[Any, Any, str]] = (),
) -> tuple[str, str]:
    """(transport, one-line reason) for ``requested`` (``auto``, ``ipc`` or ``nccl``). ``hosts``:
    the host id of every process; ``bad_pairs``/``unverified``: from :func:`survey`."""
    label = p2p.host_labels(hosts)
    several = len(hosts) > 1
    spans = []
    for gi, g in enumerate(groups):
        gh = sorted({hosts[d.process_index] if d.process_index < len(hosts) else hosts[0] for d in g})
        if len(gh) > 1:
            spans.append(f"group {gi} spans hosts {', '.join(label[h] for h in gh)}")
    blockers = spans + [
        f"{_gpu(a, several)} and {_gpu(b, several)} cannot access each other" for a, b in bad_pairs
    ]
    unknown = [
        f"no process could check whether {_gpu(a, several)} and {_gpu(b, several)} can "
        f"access each other ({why})"
        for a, b, why in unverified
    ]
    if requested == "nccl":
        return "nccl", "requested"
    if requested == "ipc":
        if blockers:
            raise ValueError(
                f"initialize: transport='ipc' needs every pair of GPUs of a group to map "
                f"each other's memory, but {'; '.join(blockers)}: use transport='nccl' "
                "or 'auto'"
            )
        if unknown:
            log.warning("jax_ub.initialize: transport='ipc' as requested, although %s", "; ".join(unknown))
        return "ipc", "requested"
    if blockers or unknown:
        if unknown and not blockers:  # a slower transport for want of a check: say so
            log.warning(
                "jax_ub.initialize: transport 'auto' runs nccl, not ipc: %s. Pass "
                "transport='ipc' if these GPUs can map each other's memory",
                "; ".join(unknown),
            )
        return "nccl", "; ".join(blockers + unknown)
    return "ipc", "every pair of GPUs of each group can map each other's memory"
