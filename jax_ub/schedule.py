"""Host-side models of the CUDA schedules and their tunable constants: how many pieces a GEMM->RS,
a bare reduce-scatter or a push AG->GEMM's last chunk is cut into, whether the chain cuts columns,
whether push merges its GEMMs, and how many rows of a bulk op's GEMM run beside its copies.

Each constant has a ``### NAME`` section in ``docs/performance.md`` with the measurements behind
it and the command that reproduces them; a ``config`` field overrides most of them.
"""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp

from jax_ub import config, methods

# Row pieces per step of the chain GEMM->RS (config.rs_chain_pieces): docs/performance.md#rs_chain_pieces
RS_CHAIN_PIECES = 2
# Column blocks of the columns GEMM->RS (config.rs_column_pieces): docs/performance.md#rs_column_pieces
RS_COLUMN_PIECES = 4
# SMs of the final fp32 sum, 0: all (it runs after the last GEMM): docs/performance.md#reduce_blocks
REDUCE_BLOCKS = 0
# Most row pieces of a bare reduce-scatter (config.rs_pieces): docs/performance.md#rs_pieces
RS_PIECES = 4
# A bare reduce-scatter's piece per this many bytes of a peer's rows: docs/performance.md#rs_piece_bytes
RS_PIECE_BYTES = 32 << 20
# Partial sizes a GEMM->RS sends in two row pieces (ipc): docs/performance.md#rs_split_bytes
RS_SPLIT_BYTES = (16 << 20, 64 << 20)
# ... only where the copy takes at least this share of its GEMM: docs/performance.md#rs_split_min_copy
RS_SPLIT_MIN_COPY = 0.75
# Widest output whose chain pieces are columns (rs_chain_split auto): docs/performance.md#rs_chain_cols_max_n
RS_CHAIN_COLS_MAX_N = 8192
# The push model's peer copy rate, GB/s: docs/performance.md#ag_push_copy_gbps
AG_PUSH_COPY_GBPS = 335.0
# The push model's cost of each extra piece, ms: docs/performance.md#ag_push_piece_ms
AG_PUSH_PIECE_MS = 0.02
# The push model's shortest piece GEMM, ms: docs/performance.md#ag_push_piece_min_ms
AG_PUSH_PIECE_MIN_MS = 0.03
# Pieces only where the model ends the op this share sooner: docs/performance.md#ag_push_pieces_gain
AG_PUSH_PIECES_GAIN = 0.05
# A same-device copy's rate per SM beside a GEMM, GB/s: docs/performance.md#bulk_copy_gbps_per_sm
BULK_COPY_GBPS_PER_SM = 32.0
# The 16-bit GEMM rate every model assumes, TFLOP/s: docs/performance.md#gemm_tflops
GEMM_TFLOPS = 700.0
# A bulk all-gather's side rows outlast its copies by this factor: docs/performance.md#bulk_side_margin
BULK_SIDE_MARGIN = 1.5


def gemm_flops_per_s(itemsize: int) -> float:
    """The GEMM rate the schedule estimates assume: GEMM_TFLOPS for 16-bit operands, a quarter
    of it for float32."""
    return GEMM_TFLOPS * 1e12 * (1.0 if itemsize <= 2 else 0.25)


def _copy_ms(nbytes: float) -> float:
    """A peer copy's modelled time (ms) at AG_PUSH_COPY_GBPS."""
    return nbytes / (AG_PUSH_COPY_GBPS * 1e9) * 1e3


def _gemm_ms(m: int, k: int, n: int, itemsize: int) -> float:
    """An [m, k] @ [k, n] GEMM's modelled time (ms) at :func:`gemm_flops_per_s`."""
    return 2.0 * m * k * n / gemm_flops_per_s(itemsize) * 1e3


def rs_pieces(rows: int, row_bytes: int) -> int:
    """Row pieces of a bare reduce-scatter with ``rows`` output rows of ``row_bytes`` per rank
    (what each peer receives from each other), each summed as soon as every peer's piece has
    landed: ``config.rs_pieces``, or one per ``RS_PIECE_BYTES`` up to ``RS_PIECES``; 1..8 and at
    most ``rows``."""
    want = config.get().rs_pieces or min(RS_PIECES, rows * row_bytes // RS_PIECE_BYTES)
    return max(1, min(want, rows, 8))


def rs_splits(method: str, rows: int, n: int, itemsize: int, k: int = 0) -> int:
    """Pieces per partial of a GEMM->RS whose output has ``rows`` x ``n`` per rank and whose local
    inner dimension is ``k`` (chain: row or column pieces per step; columns: column blocks of the
    whole GEMM; ring/pipeline: 1 or 2, see RS_SPLIT_BYTES; ``k`` 0 skips the copy/GEMM test;
    nccl: 1, the NCCL schedule runs whole partials)."""
    if method == methods.NCCL:
        return 1
    sched = methods.runs(methods.RS, method)
    if sched == methods.CHAIN:
        want = config.get().rs_chain_pieces or RS_CHAIN_PIECES
        return next(p for p in range(want, 0, -1) if rows % p == 0)
    if sched == methods.COLUMNS:  # equal column blocks of whole 16-byte vectors
        want = config.get().rs_column_pieces or RS_COLUMN_PIECES
        return next((p for p in range(want, 1, -1) if n % p == 0 and (n // p * itemsize) % 16 == 0), 1)
    part = rows * n * itemsize
    if not (RS_SPLIT_BYTES[0] <= part < RS_SPLIT_BYTES[1] and rows % 2 == 0):
        return 1
    if k > 0 and _copy_ms(part) < RS_SPLIT_MIN_COPY * _gemm_ms(rows, k, n, itemsize):
        return 1  # the copy hides under the next chunk's GEMM whole
    return 2


def rs_chain_cols(pieces: int, n: int, itemsize: int) -> bool:
    """Whether the chain GEMM->RS cuts each step (output width ``n``) into column blocks rather
    than row blocks (the kernel needs equal, 16-byte aligned blocks)."""
    if pieces < 2 or n % pieces or (n // pieces * itemsize) % 16:
        return False
    want = config.get().rs_chain_split
    return want == "cols" or (want == "auto" and n <= RS_CHAIN_COLS_MAX_N)


def _push_end(world: int, copy_ms: float, gemm_ms: float, pieces: int) -> float:
    """Modelled end (ms) of a push AG->GEMM: the local chunk's GEMM first; peer chunk i lands at
    ring step i (i copies in), the last one in ``pieces`` row pieces; one GEMM at a time."""
    t = gemm_ms
    for i in range(1, world - 1):
        t = max(t, i * copy_ms) + gemm_ms
    for j in range(pieces):
        landed = (world - 2) * copy_ms + copy_ms * (j + 1) / pieces
        piece_ms = gemm_ms if pieces == 1 else max(gemm_ms / pieces, AG_PUSH_PIECE_MIN_MS)
        t = max(t, landed) + piece_ms + (AG_PUSH_PIECE_MS if j else 0.0)
    return t


# The method names whose push AG->GEMM cuts its last chunk into pieces (columns runs push's
# kernel without them).
_PIECES_METHODS = (methods.PUSH, methods.CHAIN)


def ag_push_pieces(method: str, rows: int, n: int, k: int, itemsize: int, world: int) -> int:
    """Row pieces of the last peer chunk (``rows`` local rows of ``k``) of a push AG->GEMM with
    local output width ``n`` over ``world`` ranks: ``config.ag_push_pieces``, or 1, 2 or 4 by the
    model of :func:`_push_end` (pieces pay off only where a chunk's copy outlasts its GEMM: the
    op then ends one piece's GEMM after the last copy instead of one chunk's); a divisor of
    ``rows`` (1 for the other algorithms)."""
    if method not in _PIECES_METHODS:
        return 1
    want = config.get().ag_push_pieces
    if not want and world > 1 and rows > 0:
        copy_ms = _copy_ms(rows * k * itemsize)
        gemm_ms = _gemm_ms(rows, k, n, itemsize)
        ends = {p: _push_end(world, copy_ms, gemm_ms, p) for p in (1, 2, 4)}
        best = min(ends, key=ends.__getitem__)
        want = best if ends[best] <= ends[1] * (1 - AG_PUSH_PIECES_GAIN) else 1
    return next(p for p in range(max(want, 1), 0, -1) if rows % p == 0)


def ag_push_merge(method: str, world: int, pieces: int) -> bool:
    """Whether a push AG->GEMM over ``world`` ranks multiplies the peers' chunks as at most two
    GEMMs over their contiguous rows of the buffer (ranks r+1..world-1, then 0..r-1), each once its
    chunks have landed, instead of one GEMM per chunk: method ``push_merge``, or
    ``config.ag_push_merge`` for the other names of the push algorithm; without pieces (the two
    exclude each other; push_merge asks for none) and with more than one peer."""
    sched = methods.runs(methods.AG, method)
    asked = sched == methods.PUSH_MERGE or (config.get().ag_push_merge and sched == methods.PUSH)
    return bool(asked and pieces == 1 and world >= methods.PUSH_MERGE_MIN_TP)


def bulk_side(kind: int | str, x_bytes: int, m: int, k: int, n: int, dtype: Any) -> tuple[int, int]:
    """``(side_sms, side_rows)`` of a bulk op: its GEMM ``[m, k] @ [k, n]`` runs its first
    ``side_rows`` rows on every SM but ``side_sms``, which the collective's SM work gets.

    ``kind``: ``"ag"`` (or 0) or ``"rs"`` (or 1). All-gather (``x_bytes``: the local shard): its
    two same-device copies of the shard run on ``config.bulk_copy_sms`` SMs beside the GEMM's
    first rows, enough rows to outlast the copies (at ``BULK_COPY_GBPS_PER_SM`` per SM, the GEMM
    at ``GEMM_TFLOPS``) times ``BULK_SIDE_MARGIN``, in multiples of 128 rows. Reduce-scatter: the
    whole GEMM leaves ``config.bulk_reduce_sms`` SMs to the fp32 sum.
    """
    cfg = config.get()
    if kind in (1, methods.RS):
        return (cfg.bulk_reduce_sms, m) if cfg.bulk_reduce_sms > 0 else (0, 0)
    sms = cfg.bulk_copy_sms
    if sms <= 0 or m <= 0:
        return 0, 0
    t_copy = 2 * x_bytes / (sms * BULK_COPY_GBPS_PER_SM * 1e9)
    flops_per_row = 2 * k * n
    rows = BULK_SIDE_MARGIN * t_copy * gemm_flops_per_s(jnp.dtype(dtype).itemsize) / max(flops_per_row, 1)
    return sms, min(m, max(128, -(-math.ceil(rows) // 128) * 128))
