"""Shared by the CPU tests that run several ranks as threads in one process."""

import threading
from collections.abc import Callable


def run_ranks(world: int, fn: Callable[[int], object], *, ranks=None, join_s: float = 20.0):
    """Run ``fn(rank)`` in one thread per rank; return {rank: result or raised exception}.

    Every rank must report: a BaseException (pytest's ``Failed`` from a ``pytest.raises`` that did
    not raise, an assert) is kept as that rank's result too, so a rank that died cannot drop out of
    the result unnoticed, and a rank whose thread recorded nothing fails the test here.
    """
    out: dict[int, object] = {}
    started = list(range(world) if ranks is None else ranks)

    def body(r: int) -> None:
        try:
            out[r] = fn(r)
        except BaseException as err:
            out[r] = err

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in started]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_s)
        assert not t.is_alive(), "a rank thread hung"
    assert sorted(out) == sorted(started), f"ranks {sorted(set(started) - set(out))} reported nothing"
    failed = {r: v for r, v in out.items() if isinstance(v, BaseException) and not isinstance(v, Exception)}
    if failed:  # an assert or pytest.fail inside a rank: the test's own failure, not a result
        r, err = next(iter(failed.items()))
        raise AssertionError(f"rank {r} failed: {err!r}") from err
    return out
