"""CUDA implementations of the TP primitives (``csrc/ffi/overlap.cc``), registered with
:mod:`jax_ub.ops` under the method names ``auto``, ``ring``, ``all_peer``, ``push``, ``push_merge``,
``pipeline``, ``chain``, ``columns`` and ``nccl``, plus the
bare collectives over jax_ub's transport (:func:`all_gather`, :func:`reduce_scatter`), the bulk
forms (:func:`bulk_all_gather`, :func:`bulk_reduce_scatter`: a collective under an independent
GEMM) and the timeline hooks (:func:`trace_enable`, :func:`trace_collect`).

Algorithms (``csrc/overlap/schedules.h``):

* all-gather: ``ring`` pulls peers' shards one after another (r+1, r+2, ...) by copy engine;
  ``all_peer`` pulls all at once; ``push`` has every rank push its shard straight from its input
  into every peer's registered buffer (no publish copy); ``push_merge`` is ``push`` whose peer
  chunks are multiplied as at most two GEMMs over their contiguous rows of the buffer (ranks
  r+1..tp-1, then 0..r-1), each once its chunks have landed (fewer, larger GEMMs for a later start:
  measured fastest at AG 2048,8192,28672 tp=4, slower at larger M; tp=2 has one peer chunk, so it is
  ``push`` there). ``pipeline`` is ``ring``.
* reduce-scatter: ``ring`` pushes each destination's partial on one comm stream as soon as it is
  computed; ``pipeline`` (= ``all_peer``) gives every push its own stream. ``push`` and
  ``push_merge`` are ``ring``.
  Both end with one fp32 sum of the partials after the last GEMM. ``chain`` has no final sum: each
  rank adds the partial sum received from its ring neighbour in the GEMM's epilogue (fp32) and
  passes it on, the last step writing the output; partial sums travel in the op's dtype (one
  rounding per hop, like NCCL's ring). ``columns`` runs the GEMM over all rows in column blocks
  (w read once): each block's rows go to their owners while the next block is computed, and each
  owner sums block by block (fp32). For the all-gather ``chain`` and ``columns`` are ``push``.

These run only when the extension is loaded, a CUDA GPU is present and :func:`jax_ub.initialize`
was called for the mesh axis; :mod:`jax_ub.ops` falls back to the reference otherwise (``auto``) or
raises (an explicit CUDA method).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_ub import _ext, _ffi, _mesh_check, _validate, choice, comm, config, ops

_log = logging.getLogger("jax_ub")

# "nccl": any algorithm on a communicator set with transport nccl runs the NCCL schedule.
AG_ALGOS = {"ring": 0, "all_peer": 1, "push": 2, "pipeline": 0, "chain": 2, "columns": 2, "nccl": 2,
            "push_merge": 2}
RS_ALGOS = {"ring": 0, "pipeline": 1, "all_peer": 1, "push": 0, "chain": 2, "columns": 3, "nccl": 0,
            "push_merge": 0}
# AG methods that land every peer's shard in the registered buffer by push (the gathered x is an
# output only where someone uses it). push_merge is push with its peers' chunks merged
# (ag_push_merge): a schedule of its own, under its own name in explain.
AG_PUSH = ("push", "push_merge")
# Row pieces per step of the chain GEMM->RS: a piece is pushed, and the neighbour's next step
# starts on it, while the next piece is computed (config.rs_chain_pieces overrides).
RS_CHAIN_PIECES = 2
# Column blocks of the "columns" GEMM->RS (config.rs_column_pieces overrides): the op ends one
# block's push and sum after its GEMM. Measured on 4xH200 (tp 4, bf16) it lost to ring and chain
# at every bench shape (8192,8192,8192: 0.73 ms against chain's 0.51-0.57): a GPU's three 2-D
# pushes of a block run one after another although each has its own stream, and a block's sum
# gets SMs only when a GEMM block ends (scripts/columns_probe.py). An explicit method, and a
# candidate for method="auto" where a bench file measures it faster.
RS_COLUMN_PIECES = 4
REDUCE_BLOCKS = 0  # the final fp32 sum runs after the last GEMM: let it use the whole GPU
# A bare reduce-scatter (ipc transport) pushes in row pieces, each summed as soon as every peer's
# piece has landed, so only the last piece's sum follows the last push: one piece per
# RS_PIECE_BYTES of a peer's rows, at most RS_PIECES (config.rs_pieces sets the count instead; at
# most the rows per rank). Each piece costs ~10-15 us (flag waits, a copy and a sum launch).
# Measured on 2xH200 (tp 2, bf16, scripts/rs_pieces_probe.py, 7 interleaved rounds, two runs), ms
# for 1 / 2 / 4 pieces: 16.8 MB per peer 0.107 / 0.108 / 0.133 and 0.116 / 0.120 / 0.145;
# 33.6 MB 0.171 / 0.164 / 0.181 and 0.171 / 0.166 / 0.180; 67.1 MB 0.310 / 0.301 / 0.315 and
# 0.293 / 0.282 / 0.325; 134 MB 0.547 / 0.488 / 0.481 and 0.536 / 0.503 / 0.487 (NCCL 0.62).
# The bulk reduce-scatter keeps one piece: its sums wait for the GEMM's SMs either way, and in
# pieces they trickle in beside it (scripts/bulk_probe.py: 0.796 -> 0.822 ms at 8192,8192,8192).
RS_PIECES = 4
RS_PIECE_BYTES = 32 << 20
# GEMM->RS computes and pushes each peer's partial in two row pieces when a partial's size is in
# this range (ipc transport): the first push starts after half a partial's GEMM. Measured on 4xH200,
# bf16, tp 4: 32 MiB partials 0.554 -> 0.519 ms, 28 MiB 0.535 -> 0.501 ms; 96 and 112 MiB
# partials were not faster (1.996 -> 2.025, 1.604 -> 1.611 ms), so they stay whole.
RS_SPLIT_BYTES = (16 << 20, 64 << 20)
# ... and only when a partial's copy (at AG_PUSH_COPY_GBPS) takes at least RS_SPLIT_MIN_COPY of
# its GEMM (at GEMM_TFLOPS): a copy shorter than the next chunk's GEMM hides under it whole, and
# the half-size GEMMs only cost. The ratio is itemsize * rate / (2 * k * copy rate), k the local
# inner dimension: about 1.0 at k 2048 (tp 4's measurements above) and 0.5 at k 4096. Measured on
# 2xH200 (tp 2, bf16, scripts/rs_split_probe.py, two interleaved runs), ms whole / split:
#   2048,8192,28672 (56 MiB, k 4096): ring 0.832 / 0.876 and 0.841 / 0.893,
#                                     pipeline 0.849 / 0.874 and 0.840 / 0.877;
#   16384,8192,2048 and 8192,8192,4096 (32 MiB, k 4096), 8192,4096,4096 (32 MiB, k 2048): equal
#   within the runs' spread (0.01-0.02).
RS_SPLIT_MIN_COPY = 0.75
# The chain's pieces are column blocks (each piece's GEMM reads a column block of w, not all of w)
# when the output width n is at most this; config.rs_chain_split overrides. Measured with 2 pieces
# per step (bf16, scripts/piece_probe.py, interleaved), ms for rows / cols:
#   2xH200 tp 2: 8192,4096,4096 0.278 / 0.243 and 0.274 / 0.267; 4096,4096,4096 0.142 / 0.139;
#   16384,4096,1024 0.149 / 0.146; 8192,8192,4096 0.464 / 0.457; 16384,8192,2048 0.448 / 0.434;
#   2048,8192,8192 0.226 / 0.220; 8192,8192,8192 0.848 / 0.859; 8192,8192,28672 3.049 / 3.101.
#   4xH200 tp 4: 8192,8192,8192 0.549 / 0.530 and 0.567 / 0.505; 8192,8192,28672 1.637 / 1.670
#   and 1.714 / 1.756; 16384,12288,12288 and 2048,8192,28672 mixed.
RS_CHAIN_COLS_MAX_N = 8192
# AG->GEMM push: the last peer chunk to land goes in 2 or 4 row pieces where a model of the
# schedule says that ends the op at least AG_PUSH_PIECES_GAIN sooner (config.ag_push_pieces sets
# the count instead). The model (_push_end): chunk copies at AG_PUSH_COPY_GBPS one ring step after
# another, chunk GEMMs at GEMM_TFLOPS one at a time, a piece's GEMM at least AG_PUSH_PIECE_MIN_MS
# (scripts/piece_gemm_probe.py: 128-512-row pieces at K 8192 take 0.028-0.044 ms alone),
# AG_PUSH_PIECE_MS per extra piece. Pieces
# pay off only where a chunk's copy outlasts its GEMM: the op then ends one piece's GEMM after the
# last copy instead of one chunk's. Measured on 2xH200 (tp 2, bf16, scripts/piece_probe.py with
# PROBE_OPS=ag, two interleaved runs), ms for 1 / 2 / 4 pieces:
#   16384,8192,2048   0.599 / 0.525 / 0.492 and 0.586 / 0.496 / 0.471  (model: 4)
#   32768,4096,2048   0.602 / 0.513 / 0.480 and 0.589 / 0.506 / 0.472  (model: 4)
#   8192,8192,2048    0.333 / 0.297 / 0.298 and 0.304 / 0.271 / 0.266  (model: 2)
#   16384,8192,1024   0.487 / 0.447 / 0.445                            (model: 4)
#   16384,8192,4096   0.821 / 0.806 / 0.832 and 0.823 / 0.816 / 0.826  (model: 1)
#   8192,8192,8192    0.813 / 0.814 / 0.826 and 0.809 / 0.820 / 0.836  (model: 1)
#   2048,8192,8192    0.206 / 0.214 / 0.254                            (model: 1)
#   16384,4096,1024   0.264 / 0.264 / 0.288                            (model: 1)
# At the tp-4 bench shapes the model gives 1, as measured there (9th session: 2 or 4 pieces gained
# nothing beyond run-to-run noise).
AG_PUSH_COPY_GBPS = 335.0
AG_PUSH_PIECE_MS = 0.02
AG_PUSH_PIECE_MIN_MS = 0.03
AG_PUSH_PIECES_GAIN = 0.05
# The bulk all-gather's same-device copies (publish, own rows; SM work) run beside the first rows
# of the GEMM, which leave config.bulk_copy_sms SMs to them (cuBLASLt's SM-count target): enough
# rows to outlast the copies by the estimate below (copies on k SMs at BULK_COPY_GBPS_PER_SM
# each, the GEMM at GEMM_TFLOPS), times BULK_SIDE_MARGIN, in multiples of 128 rows.
# Measured on 2xH200 (scripts/bulk_probe.py traces): beside the GEMM a copy block moves ~32 GB/s
# whatever its loads (plain 16-byte loads or bulk TMA copies): 64 MiB took 0.48 / 0.25 / 0.14 ms
# on 4 / 8 / 16 SMs. The GEMM's L2 traffic is shared out per SM, so a copy needs many SMs.
BULK_COPY_GBPS_PER_SM = 32.0
GEMM_TFLOPS = 700.0
BULK_SIDE_MARGIN = 1.5


def _set_for(axis_name: Any, what: str, method: str | None = None) -> comm.CommSet:
    if _validate.one_axis(axis_name) is None:
        how = f"method={method!r}" if method else "the CUDA path"
        raise ValueError(f"{what}: {how} runs over one mesh axis, and axis_name {axis_name!r} "
                         f"names several: a jax_ub communicator spans one mesh axis. Use "
                         f"method='auto' or 'xla' (XLA's collective over these axes), or build the "
                         f"mesh with one axis for the TP group")
    axis = _validate.one_axis(axis_name)
    s = comm.get(axis)
    if s is None:
        ok, why = _ext.cuda_path_available()
        if not ok:
            raise ValueError(f"{what}: no jax_ub communicator for mesh axis {axis!r}: the CUDA "
                             f"path is unavailable here ({why}), so jax_ub.initialize created "
                             f"none. The public ops (all_gather_matmul, ...) run XLA's reference "
                             f"there; this transport-level call has none")
        raise ValueError(f"{what}: no jax_ub communicator for mesh axis {axis!r}: call "
                         f"jax_ub.initialize(mesh, axis={axis!r}) before tracing")
    if not _validate.bound_by_shard_map(axis):
        how = f"method={method!r}" if method else "the CUDA path"
        raise ValueError(f"{what}: axis_name {axis!r} is bound here by jax.vmap (or pmap), not by a "
                         f"jax.shard_map over the mesh given to jax_ub.initialize; {how} needs "
                         f"the shard_map. Use method='auto' or 'xla' (XLA's collective over the "
                         f"vmap axis)")
    if method == "nccl" and s.transport != "nccl":
        raise ValueError(f"{what}: method='nccl' needs jax_ub.initialize(mesh, axis={axis!r}, "
                         f"transport='nccl'); this axis was initialized with transport "
                         f"{s.transport!r}")
    size = jax.lax.axis_size(axis)
    if size != s.world:
        raise ValueError(f"{what}: axis {axis!r} has size {size} here but the communicator "
                         f"was initialized with groups of {s.world}")
    return s


def _checked(x: jax.Array, s: comm.CommSet, what: str) -> jax.Array:
    """``x`` as the custom call's operand; lowering it inside shard_map checks that the program's
    mesh groups and orders the axis's devices as ``initialize`` did (:mod:`jax_ub._mesh_check`)."""
    return _mesh_check.check(x, what=what, axis=s.axis, groups=s.devices_key)


def _front(x: jax.Array, axis: int) -> jax.Array:
    return x if axis == 0 else jnp.moveaxis(x, axis, 0)


def _back(x: jax.Array, axis: int) -> jax.Array:
    return x if axis == 0 else jnp.moveaxis(x, 0, axis)


def _warm(s: comm.CommSet, m: int, n: int, k: int, dtype: Any, precision: Any,
          accumulate: bool = False, reserve_sms: int = 0, ld: int = 0) -> None:
    """Prepares (and tunes, ``JAX_UB_GEMM_TUNE``) the chunk GEMM on every local GPU at trace time:
    a kernel loaded lazily inside an op can stall the whole process (the
    context-wide module load waits for a peer GPU that waits in this op)."""
    from jax_ub import gemm

    ws = _ffi.workspace_bytes()  # one GEMM at a time
    gemm.warm([dev for dev, _, _ in s.local], m, n, k, dtype, precision, workspace_bytes=ws,
              accumulate=accumulate, reserve_sms=reserve_sms, ld=ld)


def ag_gemm(x, w, *, axis_name, axis, precision, method="ring", need_full: bool = True):
    """(y, x_gathered) of ``all_gather(x, axis) @ w`` through the CUDA overlap kernel."""
    _ext.ensure_registered()
    s = _set_for(axis_name, "all_gather_matmul", method)
    x2 = _front(x, axis)
    es = jnp.dtype(x.dtype).itemsize
    comm.ensure_capacity(s, s.world * math.prod(x2.shape) * es)  # push lands every shard
    _warm(s, math.prod(x2.shape[:-1]), w.shape[1], x2.shape[-1], x.dtype, precision)
    rows = (s.world * x2.shape[0], *x2.shape[1:-1])
    y_t = _ffi.result_type((*rows, w.shape[1]), x.dtype, x2, w)
    # The gathered x is an output only when someone uses it: push and nccl land peers' chunks in
    # the registered buffer, and a zero-row result tells the kernel to skip the copies into it.
    keep = need_full or (method not in AG_PUSH and s.transport != "nccl")
    xg_t = _ffi.result_type((*rows, x2.shape[-1]) if keep else (0, x2.shape[-1]), x.dtype, x2, w)
    pieces = (ag_push_pieces(method, math.prod(x2.shape[:-1]), w.shape[1], x2.shape[-1], es, s.world)
              if s.transport != "nccl" else 1)
    if pieces > 1:  # the last chunk's pieces are shorter GEMMs: prepare that shape too
        _warm(s, math.prod(x2.shape[:-1]) // pieces, w.shape[1], x2.shape[-1], x.dtype, precision)
    merge = s.transport != "nccl" and ag_push_merge(method, s.world, pieces)
    if merge:  # the peers' rows of every rank: 1 to world-1 chunks in one GEMM
        for c in range(2, s.world):
            _warm(s, c * math.prod(x2.shape[:-1]), w.shape[1], x2.shape[-1], x.dtype, precision)
    y, xg, _ = _ffi.call("jax_ub_ag_gemm", (y_t, xg_t, _ffi.workspace_type(x2, w)))(
        _checked(x2, s, "all_gather_matmul"), w, set_id=s.set_id, algo=np.int32(AG_ALGOS[method]),
        tf32=_ffi.tf32_allowed(precision), pieces=np.int32(pieces), merge=merge)
    return _back(y, axis), (_back(xg, axis) if keep else None)


def gemm_rs(x, w, *, axis_name, axis, precision, method="ring", need_full: bool = True):
    """(y, x) of ``reduce_scatter(x @ w, axis)`` through the CUDA overlap kernel."""
    _ext.ensure_registered()
    s = _set_for(axis_name, "matmul_reduce_scatter", method)
    if s.transport == "nccl":  # RsBodyNccl runs whatever is named: no staging or GEMM pieces of ipc's
        method = "nccl"
    x2 = _front(x, axis)
    es = jnp.dtype(x.dtype).itemsize
    M, n = x2.shape[0], w.shape[1]
    inner = math.prod(x2.shape[1:-1])
    comm.ensure_capacity(s, M * inner * n * es)
    _warm(s, (M // s.world) * inner, n, x2.shape[-1], x.dtype, precision)
    out_shape = (M // s.world, *x2.shape[1:-1], n)
    y_t = _ffi.result_type(out_shape, x.dtype, x2, w)
    staged = s.world if method == "columns" else s.world - 1  # columns stages all M rows
    staging = max(staged * (M // s.world) * inner * n * es, 256)
    st_t = _ffi.result_type((staging,), jnp.uint8, x2, w)
    rows = (M // s.world) * inner
    splits = rs_splits(method, rows, n, es, x2.shape[-1])
    cols = method == "chain" and s.transport != "nccl" and rs_chain_cols(splits, n, es)
    # The pieces' GEMMs are other shapes: prepare (tune) them too.
    pm, pn, ld = (rows, n // splits, n) if cols else (rows // splits, n, 0)
    if method == "columns":  # one GEMM per column block over all M rows
        pm, pn, ld = M * inner, n // splits, n
    if splits > 1 or method == "columns":  # columns: a GEMM over all M rows, even in one block
        _warm(s, pm, pn, x2.shape[-1], x.dtype, precision, ld=ld)
    if method == "chain" and s.transport != "nccl":  # every step after the first adds an addend
        _warm(s, pm, pn, x2.shape[-1], x.dtype, precision, accumulate=True, ld=ld)
    y, _, _ = _ffi.call("jax_ub_gemm_rs", (y_t, st_t, _ffi.workspace_type(x2, w)))(
        _checked(x2, s, "matmul_reduce_scatter"), w, set_id=s.set_id, algo=np.int32(RS_ALGOS[method]),
        tf32=_ffi.tf32_allowed(precision), reduce_blocks=np.int32(REDUCE_BLOCKS), splits=np.int32(splits), split_cols=cols)
    return _back(y, axis), x


def rs_splits(method: str, rows: int, n: int, itemsize: int, k: int = 0) -> int:
    """Pieces per partial of a GEMM->RS whose output has ``rows`` x ``n`` per rank and whose local
    inner dimension is ``k`` (chain: row or column pieces per step; columns: column blocks of the
    whole GEMM; ring/pipeline: 1 or 2, see RS_SPLIT_BYTES; ``k`` 0 skips the copy/GEMM test;
    nccl: 1, RsBodyNccl runs whole partials)."""
    if method == "nccl":
        return 1
    if method == "chain":
        want = config.get().rs_chain_pieces or RS_CHAIN_PIECES
        return next(p for p in range(want, 0, -1) if rows % p == 0)
    if method == "columns":  # equal column blocks of whole 16-byte vectors
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


def ag_push_pieces(method: str, rows: int, n: int, k: int, itemsize: int, world: int) -> int:
    """Row pieces of the last peer chunk (``rows`` local rows of ``k``) of a push AG->GEMM with
    local output width ``n`` over ``world`` ranks: ``config.ag_push_pieces``, or 1, 2 or 4 by the
    model above; a divisor of ``rows`` (1 for the other algorithms)."""
    if method not in ("push", "chain"):
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
    asked = method == "push_merge" or (config.get().ag_push_merge
                                       and AG_ALGOS.get(method) == AG_ALGOS["push"])
    return bool(asked and pieces == 1 and world >= choice.PUSH_MERGE_MIN_TP)


def all_gather(x: jax.Array, axis_name: Any, *, axis: int = 0, method: str = "push") -> jax.Array:
    """``lax.all_gather(x, axis_name, axis=axis, tiled=True)`` over jax_ub's copy-engine transport.

    x: `[..., m, ...]` local shard (any dtype of bfloat16/float16/float32); inside ``shard_map``
    over ``axis_name`` after :func:`jax_ub.initialize`. On an axis of size 1 it returns ``x``
    (one shard is the whole; :func:`jax_ub.initialize` makes no communicator there).
    """
    _validate.check_array("all_gather", "x", x)
    axis = _validate.normalize_axis("all_gather", "axis", axis, x.shape, last_ok=True)
    _check_algo("all_gather", method, AG_ALGOS)
    if _validate.bound_axis_size("all_gather", axis_name) == 1:  # nothing to gather
        return x
    _ext.ensure_registered()
    s = _set_for(axis_name, "all_gather")
    x2 = _front(x, axis)
    x3 = x2.reshape(x2.shape[0], -1)
    comm.ensure_capacity(s, s.world * math.prod(x2.shape) * jnp.dtype(x.dtype).itemsize)
    xg_t = _ffi.result_type((s.world * x3.shape[0], x3.shape[1]), x.dtype, x3)
    xg = _ffi.call("jax_ub_all_gather", xg_t)(_checked(x3, s, "all_gather"), set_id=s.set_id,
                                              algo=np.int32(AG_ALGOS[method]))
    return _back(xg.reshape(s.world * x2.shape[0], *x2.shape[1:]), axis)


def _check_algo(what: str, method: Any, algos: dict) -> None:
    if not isinstance(method, str) or method not in algos:
        raise ValueError(f"{what}: `method` must be one of {tuple(algos)}; got {method!r}")


def rs_pieces(rows: int, row_bytes: int) -> int:
    """Row pieces of a bare reduce-scatter with ``rows`` output rows of ``row_bytes`` per rank
    (what each peer receives from each other): ``config.rs_pieces``, or one per
    ``RS_PIECE_BYTES`` up to ``RS_PIECES``; 1..8 and at most ``rows``."""
    want = config.get().rs_pieces or min(RS_PIECES, rows * row_bytes // RS_PIECE_BYTES)
    return max(1, min(want, rows, 8))


def reduce_scatter(x: jax.Array, axis_name: Any, *, axis: int = 0, method: str = "ring") -> jax.Array:
    """``lax.psum_scatter(x, axis_name, scatter_dimension=axis, tiled=True)`` over jax_ub's
    transport, accumulating in float32. On an axis of size 1 it returns ``x``, as ``all_gather``."""
    _validate.check_array("reduce_scatter", "x", x)
    axis = _validate.normalize_axis("reduce_scatter", "axis", axis, x.shape, last_ok=True)
    _check_algo("reduce_scatter", method, RS_ALGOS)
    tp = _validate.bound_axis_size("reduce_scatter", axis_name)
    if tp == 1:  # nothing to sum
        return x
    _validate.check_divisible("reduce_scatter", "axis", axis, x.shape, axis_name, tp)
    _ext.ensure_registered()
    s = _set_for(axis_name, "reduce_scatter")
    x2 = _front(x, axis)
    x3 = x2.reshape(x2.shape[0], -1)
    comm.ensure_capacity(s, math.prod(x2.shape) * jnp.dtype(x.dtype).itemsize)
    y_t = _ffi.result_type((x3.shape[0] // s.world, x3.shape[1]), x.dtype, x3)
    y = _ffi.call("jax_ub_reduce_scatter", y_t)(
        _checked(x3, s, "reduce_scatter"), set_id=s.set_id, algo=np.int32(RS_ALGOS[method]),
        reduce_blocks=np.int32(REDUCE_BLOCKS),
        splits=np.int32(rs_pieces(x3.shape[0] // s.world, x3.shape[1] * jnp.dtype(x.dtype).itemsize)))
    return _back(y.reshape(x2.shape[0] // s.world, *x2.shape[1:]), axis)


def bulk_side(kind: int, x_bytes: int, m: int, k: int, n: int, dtype: Any) -> tuple[int, int]:
    """``(side_sms, side_rows)`` of a bulk op: its GEMM ``[m, k] @ [k, n]`` runs its first
    ``side_rows`` rows on every SM but ``side_sms``, which the collective's SM work gets.

    All-gather (``x_bytes``: the local shard): its two same-device copies of the shard run on
    ``config.bulk_copy_sms`` SMs beside the GEMM's first rows (see ``BULK_COPY_GBPS_PER_SM``).
    Reduce-scatter: the whole GEMM leaves ``config.bulk_reduce_sms`` SMs to the fp32 sum.
    """
    cfg = config.get()
    if kind == 1:
        return (cfg.bulk_reduce_sms, m) if cfg.bulk_reduce_sms > 0 else (0, 0)
    sms = cfg.bulk_copy_sms
    if sms <= 0 or m <= 0:
        return 0, 0
    t_copy = 2 * x_bytes / (sms * BULK_COPY_GBPS_PER_SM * 1e9)
    flops_per_row = 2 * k * n
    rows = BULK_SIDE_MARGIN * t_copy * gemm_flops_per_s(jnp.dtype(dtype).itemsize) / max(flops_per_row, 1)
    return sms, min(m, max(128, -(-math.ceil(rows) // 128) * 128))


def _bulk(kind: int, x, a, b, axis_name, axis, precision, method, what):
    _ext.ensure_registered()
    s = _set_for(axis_name, what)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0] or a.dtype != b.dtype:
        raise ValueError(f"{what}: the independent GEMM must be a[m, k] @ b[k, n] of one dtype; "
                         f"got a {a.shape} {a.dtype}, b {b.shape} {b.dtype}")
    x2 = _front(x, axis % x.ndim)
    x3 = x2.reshape(x2.shape[0], -1)
    es = jnp.dtype(x.dtype).itemsize
    comm.ensure_capacity(s, (s.world if kind == 0 else 1) * math.prod(x2.shape) * es)
    side_sms, side_rows = bulk_side(kind, math.prod(x2.shape) * es, a.shape[0], a.shape[1],
                                    b.shape[1], a.dtype)
    if kind == 0 and s.transport == "nccl":  # no same-device copies: NCCL's kernels go first
        side_sms, side_rows = 0, 0
    if side_rows > 0:  # both GEMMs of the op: its first rows beside the collective, then the rest
        _warm(s, side_rows, b.shape[1], a.shape[1], a.dtype, precision, reserve_sms=side_sms)
    if side_rows < a.shape[0]:
        _warm(s, a.shape[0] - side_rows, b.shape[1], a.shape[1], a.dtype, precision)
    if kind == 0:
        out_t = _ffi.result_type((s.world * x3.shape[0], x3.shape[1]), x.dtype, x3)
        algo = AG_ALGOS[method]
    else:
        if x3.shape[0] % s.world:
            raise ValueError(f"{what}: dimension {axis} of x ({x3.shape[0]}) is not divisible by "
                             f"the axis size {s.world}")
        out_t = _ffi.result_type((x3.shape[0] // s.world, x3.shape[1]), x.dtype, x3)
        algo = RS_ALGOS[method]
    gy_t = _ffi.result_type((a.shape[0], b.shape[1]), a.dtype, a, b)
    out, gy, _ = _ffi.call("jax_ub_bulk", (out_t, gy_t, _ffi.workspace_type(a, b)))(
        _checked(x3, s, what), a, b, set_id=s.set_id, kind=np.int32(kind), algo=np.int32(algo),
        tf32=_ffi.tf32_allowed(precision), side_sms=np.int32(side_sms), side_rows=np.int64(side_rows))
    rows = s.world * x2.shape[0] if kind == 0 else x2.shape[0] // s.world
    return _back(out.reshape(rows, *x2.shape[1:]), axis % x.ndim), gy


def bulk_all_gather_cuda(x, a, b, axis_name, *, axis=0, precision=None, method="ring"):
    """(all_gather(x), a @ b) in one custom call: the gather runs by copy engine under the GEMM; its
    same-device copies run beside the GEMM's first rows (``config.bulk_copy_sms``)."""
    return _bulk(0, x, a, b, axis_name, axis, precision, method, "bulk_all_gather")


def bulk_reduce_scatter_cuda(x, a, b, axis_name, *, axis=0, precision=None, method="ring"):
    """(psum_scatter(x), a @ b) in one custom call: pushes by copy engine under the GEMM, the fp32
    sum after the GEMM, or beside it on ``config.bulk_reduce_sms`` SMs kept from it."""
    return _bulk(1, x, a, b, axis_name, axis, precision, method, "bulk_reduce_scatter")


def trace_enable(on: bool) -> None:
    """Records a CUDA-event timeline of every overlap op from now on (``bench --timeline``)."""
    _ext.extension().trace_enable(bool(on))


def trace_collect() -> list[dict]:
    """The spans recorded since :func:`trace_enable` (waits for them): one dict per copy, GEMM or
    reduction with ``device, rank, op, epoch, name, chunk, stream, start_ms, end_ms`` (ms from the
    start of that op on that device) and ``op_start_ms`` (that start, in ms from the start of the
    first op traced on that device since :func:`trace_enable`)."""
    return list(_ext.extension().trace_collect())


def choose(op: str, x_shape: tuple[int, ...], w_shape: tuple[int, ...], dtype: Any,
           axis_name: Any) -> str:
    """The algorithm ``method="auto"`` uses for one call: a CUDA one (``"nccl"`` on an axis with
    transport nccl), or ``"xla"`` when the axis has no communicator. See :func:`explain` and
    :mod:`jax_ub.choice`."""
    c = _choice(op, x_shape, w_shape, dtype, axis_name)
    return "xla" if c is None else c.method


def _choice(op, x_shape, w_shape, dtype, axis_name) -> choice.Choice | None:
    s = comm.get(axis_name)
    if s is None:
        return None
    if s.transport == "nccl":  # AgBodyNccl/RsBodyNccl run whatever algorithm is named
        return choice.Choice("nccl", _NCCL_WHY.format(axis=axis_name))
    tp = max(s.world, 1)
    M, K, N = choice.global_shape(op, tp, x_shape, w_shape)
    return choice.choose(op, tp, jnp.dtype(dtype).name, M, K, N, config.get().tuning_file)


_NCCL_WHY = ("the NCCL schedule runs: axis {axis!r} has transport nccl (not every GPU pair of a group "
             "can map each other's memory, or transport='nccl' was asked for), on which every method "
             "runs it; no measurement compares it with xla")


def _algorithm(op: str, method: str) -> str:
    """The algorithm a CUDA method name runs for ``op`` on transport ipc: the first name of
    ``AG_ALGOS``/``RS_ALGOS`` with the same kernel algorithm (AG ``chain`` runs ``push``)."""
    algos = AG_ALGOS if op == ops.AG else RS_ALGOS
    if method not in algos:  # an implementation registered by name (ops.register_impl)
        return method
    if op == ops.AG and method == "push_merge":  # the push kernel, scheduled otherwise
        return method
    return next(m for m, a in algos.items() if a == algos[method])


def explain(op: str, x: Any, w: Any, axis_name: Any = "tp", *, axis: int = 0,
            method: str | None = None) -> str:
    """Says what a call of ``op`` ("ag": :func:`jax_ub.all_gather_matmul`, "rs":
    :func:`jax_ub.matmul_reduce_scatter`) on these operands runs, and why: ``"<what runs>: <why>;
    global MxKxN, tp=T (call x ... @ w ...)"``.

    ``x`` and ``w`` are one device's shards, as the op sees them inside ``shard_map`` (arrays or
    ``jax.ShapeDtypeStruct``): AG x `[..., m, k]` @ w `[k, n_local]`, RS x `[..., M, k_local]` @ w
    `[k_local, n]`; ``axis`` is the op's ``gather_axis``/``scatter_axis``. ``method`` is the call's
    (``None``: ``JAX_UB_METHOD``, as a call without ``method=`` does). ``axis_name``: the op's mesh
    axis. It checks the operands as the op does and raises the op's error where the call would
    fail, as far as it can know the axis: the global shape, tp and the divisibility of an RS input
    need a communicator for ``axis_name`` (``jax_ub.initialize``); without one (the reference path)
    the answer names the local shapes only.
    """
    if op not in (ops.AG, ops.RS):
        raise ValueError(f"explain: op must be {ops.AG!r} (all_gather_matmul) or {ops.RS!r} "
                         f"(matmul_reduce_scatter); got {op!r}")
    fn = f"explain({op!r})"
    layouts = {ops.AG: ("[..., m, k]", "[k, n_local]"), ops.RS: ("[..., M, k_local]", "[k_local, n]")}
    _validate.check_operands(fn, x, w, *layouts[op], abstract_ok=True)
    kw, coll = ("gather_axis", "all-gather") if op == ops.AG else ("scatter_axis", "reduce-scatter")
    axis = _validate.normalize_axis(fn, kw, axis, tuple(x.shape))
    _validate.check_nonempty_axis(fn, kw, axis, tuple(x.shape), coll)
    requested = ops._requested(method, fn)
    asked = f"method={method!r}" if method is not None else f"JAX_UB_METHOD={requested}"
    _validate.check_axis_name(fn, axis_name)  # as the op checks it
    axis_name = _validate.one_axis(axis_name) or axis_name  # ("tp",) is "tp"
    s = comm.get(axis_name)
    call = f"(call x {_validate.shape_str(tuple(x.shape))} @ w {_validate.shape_str(tuple(w.shape))})"
    if s is not None:
        tp = max(s.world, 1)
        if op == ops.RS:
            _validate.check_divisible(fn, kw, axis, tuple(x.shape), axis_name, tp)
        M, K, N = choice.global_shape(op, tp, tuple(x.shape), tuple(w.shape))
        call = f"; global {M}x{K}x{N}, tp={tp} {call}"
    else:
        call = " " + call
    empty = [_validate.shape_str(tuple(a.shape)) for a in (x, w) if 0 in a.shape]
    if empty:
        return f"xla: zero-size operand {', '.join(empty)} (nothing to overlap: the reference runs){call}"
    name = ops._resolve_method(method, fn)  # raises as the op does (a CUDA method without the CUDA path)
    if name == "xla":
        why = ("JAX_UB_DISABLE=1 forces the pure-XLA reference path" if config.get().disable
               else f"requested ({asked})" if requested == "xla" else _ext.cuda_path_available()[1])
        return f"xla: {why}{call}"
    if s is None:
        many = _validate.one_axis(axis_name) is None
        if many:
            why = f"axis_name {axis_name!r} names several mesh axes, and a jax_ub communicator spans one"
        else:
            why = (f"no jax_ub communicator for axis {axis_name!r} (call jax_ub.initialize(mesh, "
                   f"axis={axis_name!r}); an axis of size 1 gets none: nothing to communicate)")
        if name == "auto":
            return f"xla: {why}{call}"
        raise ValueError(f"{fn}: {asked} needs a jax_ub communicator, and the call would fail: {why}")
    c = _choice(op, tuple(x.shape), tuple(w.shape), x.dtype, axis_name)
    if name == "auto":
        return f"{c.method}: {c.why}{call}"
    if name == "nccl" and s.transport != "nccl":
        raise ValueError(f"{fn}: {asked} needs jax_ub.initialize(mesh, axis={axis_name!r}, "
                         f"transport='nccl'); this axis was initialized with transport {s.transport!r}")
    if s.transport == "nccl":
        return f"nccl: requested {name} ({asked}), but {_NCCL_WHY.format(axis=axis_name)}{call}"
    runs = _algorithm(op, name)
    alias = f" (for {ops._PUBLIC_NAME[op]}, {name} is the {runs} algorithm)" if runs != name else ""
    return f"{runs}: requested ({asked}){alias}; auto would run {c.method}{call}"


def _auto(op: str):
    def impl(x, w, *, axis_name, axis, precision, need_full=True):
        if not _validate.bound_by_shard_map(axis_name):
            # A jax.vmap (or pmap) axis of that name: XLA's collective over it, no CUDA path.
            _log.debug("auto %s: axis_name %r is a vmap/pmap axis here: xla", op, axis_name)
            return ops._IMPLS[(op, "xla")](x, w, axis_name=axis_name, axis=axis,
                                           precision=precision, need_full=need_full)
        c = _choice(op, tuple(x.shape), tuple(w.shape), x.dtype, axis_name)
        algo = "xla" if c is None else c.method
        if c is None:
            comm.warn_no_communicator(ops._PUBLIC_NAME[op], axis_name)
        _log.debug("auto %s %s @ %s: %s", op, tuple(x.shape), tuple(w.shape),
                   "xla (no communicator)" if c is None else f"{algo}: {c.why}")
        return ops._IMPLS[(op, algo)](x, w, axis_name=axis_name, axis=axis, precision=precision,
                                      need_full=need_full)

    return impl


def _register() -> None:
    ops.register_impl(ops.AG, "auto")(_auto(ops.AG))
    ops.register_impl(ops.RS, "auto")(_auto(ops.RS))
    for name in ("ring", "all_peer", "push", "push_merge", "pipeline", "chain", "columns", "nccl"):
        ops.register_impl(ops.AG, name)(
            lambda x, w, *, axis_name, axis, precision, need_full=True, _m=name: ag_gemm(
                x, w, axis_name=axis_name, axis=axis, precision=precision, method=_m,
                need_full=need_full))
        ops.register_impl(ops.RS, name)(
            lambda x, w, *, axis_name, axis, precision, need_full=True, _m=name: gemm_rs(
                x, w, axis_name=axis_name, axis=axis, precision=precision, method=_m,
                need_full=need_full))


_register()
