"""What the GPU workers' persistent-compilation-cache cases measure (imported by _op_worker.py and
_mp_worker.py, which run as scripts from this folder)."""

from __future__ import annotations

import hashlib

import jax
import numpy as np


def count_cache_events() -> dict[str, int]:
    """Live counts of this process's persistent-cache ``hits`` and ``misses`` from now on (jax
    counts a miss where it writes an entry)."""
    events = {"hits": 0, "misses": 0}

    def on_event(event, **_):
        for key in events:
            if event == f"/jax/compilation_cache/cache_{key}":
                events[key] += 1

    jax.monitoring.register_event_listener(on_event)
    return events


def digest(arrays) -> str:
    """A short hash of the bytes of this process's shards of ``arrays``, in order."""
    data = b"".join(np.asarray(s.data).tobytes() for a in arrays for s in a.addressable_shards)
    return hashlib.sha256(data).hexdigest()[:16]
