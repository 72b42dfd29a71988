"""Timeline hooks of the CUDA ops (``python -m jax_ub.bench ... --timeline``): a CUDA-event span
per copy, GEMM and reduction of every overlap op."""

from __future__ import annotations

from typing import Any

from jax_ub import _ext


def _extension() -> Any:
    mod = _ext.extension()
    if mod is None:
        raise RuntimeError(f"jax_ub CUDA extension unavailable, so there is no timeline: {_ext._load()[1]}")
    return mod


def trace_enable(on: bool) -> None:
    """Records a CUDA-event timeline of every overlap op from now on (``bench --timeline``)."""
    _extension().trace_enable(bool(on))


def trace_collect() -> list[dict]:
    """The spans recorded since :func:`trace_enable` (waits for them): one dict per copy, GEMM or
    reduction with ``device, rank, op, epoch, name, chunk, stream, start_ms, end_ms`` (ms from the
    start of that op on that device) and ``op_start_ms`` (that start, in ms from the start of the
    first op traced on that device since :func:`trace_enable`)."""
    return list(_extension().trace_collect())
