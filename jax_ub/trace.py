"""Timeline hooks of the CUDA ops (``python -m jax_ub.bench ... --timeline``): a CUDA-event span
per copy, GEMM and reduction of every overlap op."""

from __future__ import annotations

from jax_ub import _ext


def trace_enable(on: bool) -> None:
    """Records a CUDA-event timeline of every overlap op from now on (``bench --timeline``)."""
    _ext.extension().trace_enable(bool(on))


def trace_collect() -> list[dict]:
    """The spans recorded since :func:`trace_enable` (waits for them): one dict per copy, GEMM or
    reduction with ``device, rank, op, epoch, name, chunk, stream, start_ms, end_ms`` (ms from the
    start of that op on that device) and ``op_start_ms`` (that start, in ms from the start of the
    first op traced on that device since :func:`trace_enable`)."""
    return list(_ext.extension().trace_collect())
