"""Shared by the CPU tests that run several ranks as threads in one process."""

import threading
from collections.abc import Callable


def run_ranks(world: int, fn: Callable[[int], object], *, ranks=None, join_s: float = 20.0):
    """Run ``fn(rank)`` in one thread per rank; return {rank: result or raised exception}."""
    out: dict[int, object] = {}

    def body(r: int) -> None:
        try:
            out[r] = fn(r)
        except Exception as err:
            out[r] = err

    threads = [threading.Thread(target=body, args=(r,), daemon=True)
               for r in (range(world) if ranks is None else ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_s)
        assert not t.is_alive(), "a rank thread hung"
    return out
