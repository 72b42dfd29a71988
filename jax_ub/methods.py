"""The one home of jax_ub's methods: the op families, the method names, which schedule each method
runs per op, and the rules ``method="auto"`` chooses by.

Nothing here imports jax or another jax_ub module, so every layer can use it (:mod:`jax_ub.config`
validates ``JAX_UB_METHOD`` against :data:`METHODS`). The layers above, one way:

* :mod:`jax_ub.choice` — auto's pick at a shape, from the measured tables;
* :mod:`jax_ub.resolve` — what one call runs (``None``/``"auto"``/a name, the CUDA path's
  availability, the axis's communicator) and why (:func:`jax_ub.explain`);
* :mod:`jax_ub.ops` / :mod:`jax_ub.bulk` — validation, autodiff and dispatch;
* :mod:`jax_ub.overlap`, :mod:`jax_ub.bulk`, :mod:`jax_ub.collectives` — the CUDA implementations,
  with :mod:`jax_ub.schedule`'s models of the schedules.

Schedules (``csrc/overlap/ag_gemm.h``, ``csrc/overlap/gemm_rs.h``):

* all-gather: ``ring`` pulls peers' shards one after another (r+1, r+2, ...) by copy engine;
  ``all_peer`` pulls all at once; ``push`` has every rank push its shard straight from its input
  into every peer's registered buffer (no publish copy); ``push_merge`` is ``push`` whose peer
  chunks are multiplied as at most two GEMMs over their contiguous rows of the buffer (ranks
  r+1..tp-1, then 0..r-1), each once its chunks have landed (below :data:`PUSH_MERGE_MIN_TP`
  there is one peer chunk: it is ``push``).
* reduce-scatter: ``ring`` pushes each destination's partial on one comm stream as soon as it is
  computed; ``pipeline`` gives every push its own stream. Both end with one fp32 sum of the
  partials after the last GEMM. ``chain`` has no final sum: each rank adds the partial sum
  received from its ring neighbour in the GEMM's epilogue (fp32) and passes it on, the last step
  writing the output; partial sums travel in the op's dtype (one rounding per hop, like NCCL's
  ring). ``columns`` runs the GEMM over all rows in column blocks (w read once): each block's rows
  go to their owners while the next block is computed, and each owner sums block by block (fp32).

Every method name is accepted by every op: a name that is no schedule of an op runs the schedule
:data:`RUNS` gives it there (AG ``pipeline`` is ``ring``, RS ``push`` is ``ring``), so the
backward, which runs the dual op under the same name, always has a CUDA schedule.
"""

from __future__ import annotations

import difflib
import warnings

# ------------------------------------------------------------------------------------------------
# Op families

AG = "ag"  # all_gather_matmul: y = all_gather(x) @ w
RS = "rs"  # matmul_reduce_scatter: y = reduce_scatter(x @ w)
BULK_AG = "bulk_ag"  # bulk_all_gather: (all_gather(x), a @ b)
BULK_RS = "bulk_rs"  # bulk_reduce_scatter: (psum_scatter(x), a @ b)
ALL_GATHER = "all_gather"  # the bare collectives over jax_ub's transport
REDUCE_SCATTER = "reduce_scatter"
OPS = (AG, RS, BULK_AG, BULK_RS, ALL_GATHER, REDUCE_SCATTER)

PUBLIC_NAME = {
    AG: "all_gather_matmul",
    RS: "matmul_reduce_scatter",
    BULK_AG: "bulk_all_gather",
    BULK_RS: "bulk_reduce_scatter",
    ALL_GATHER: "all_gather",
    REDUCE_SCATTER: "reduce_scatter",
}

# The AG<->RS duality of tensor parallelism, written once: the backward of each op is its dual op
# applied to (dy, wᵀ) along the same axis.
DUAL = {AG: RS, RS: AG}

# The collective each family's kernel runs: an all-gather (AG) or a reduce-scatter (RS).
COLLECTIVE = {AG: AG, RS: RS, BULK_AG: AG, BULK_RS: RS, ALL_GATHER: AG, REDUCE_SCATTER: RS}

# ------------------------------------------------------------------------------------------------
# Methods

AUTO = "auto"  # the measured fastest per shape (jax_ub.choice), or XLA's where no communicator
XLA = "xla"  # the pure-XLA reference (jax_ub.reference)
RING = "ring"
ALL_PEER = "all_peer"
PUSH = "push"
PUSH_MERGE = "push_merge"
PIPELINE = "pipeline"
CHAIN = "chain"
COLUMNS = "columns"
# The CUDA methods, each accepted by every op.
CUDA_METHODS = (RING, ALL_PEER, PUSH, PUSH_MERGE, PIPELINE, CHAIN, COLUMNS)

# Deprecated method names (accepted for one release, with a DeprecationWarning) and what to use.
NCCL = "nccl"
DEPRECATED = {
    NCCL: "NCCL is a transport, not a method: use jax_ub.initialize(..., transport='nccl') "
    "(JAX_UB_TRANSPORT=nccl), on which every method runs the NCCL schedule"
}

# What ``method=`` and ``JAX_UB_METHOD`` accept (jax_ub.config.METHODS).
METHODS = (AUTO, XLA, *CUDA_METHODS, NCCL)

# The schedules of each op, each named by its method, in the order that breaks auto's ties
# (jax_ub.choice.TIE): the first one wins.
SCHEDULES = {AG: (PUSH, PUSH_MERGE, RING, ALL_PEER), RS: (RING, PIPELINE, CHAIN, COLUMNS)}

# The schedule each CUDA method runs where it is no schedule of the op. An all-gather's
# push_merge is push's kernel with merged GEMMs; a bulk or bare all-gather has no GEMMs to merge.
_OTHER = {
    AG: {PIPELINE: RING, CHAIN: PUSH, COLUMNS: PUSH},
    RS: {ALL_PEER: PIPELINE, PUSH: RING, PUSH_MERGE: RING},
}
RUNS = {
    op: {m: (m if m in SCHEDULES[COLLECTIVE[op]] else _OTHER[COLLECTIVE[op]][m]) for m in CUDA_METHODS}
    for op in OPS
}
for _op in (BULK_AG, ALL_GATHER):
    RUNS[_op][PUSH_MERGE] = PUSH
del _op

# The schedule a method runs when the op has no preference (auto without any measurement, the bare
# collectives' default), and the code the NCCL transport is handed (its schedule ignores it).
DEFAULT = {AG: PUSH, RS: RING}

# The schedule a bulk op's auto runs where the axis has a communicator (and a bulk op's deprecated
# "nccl", whose transport runs the NCCL schedule).
BULK_DEFAULT = RING

# ------------------------------------------------------------------------------------------------
# Rules of auto (jax_ub.choice)

# The methods each op's measured table may name, in the order that breaks a tie: the op's
# schedules, then XLA's own path, last, so that a tie goes to the overlap.
AUTO_CANDIDATES = {op: (*SCHEDULES[op], XLA) for op in SCHEDULES}
# push_merge merges the peers' chunks: below this group size there is one peer chunk, and it runs
# push's program (the CUDA path, the bench and the tables all go by this):
# docs/performance.md#push_merge_min_tp
PUSH_MERGE_MIN_TP = 3
# Methods that sum partials in the op's dtype, one rounding per hop, at tp >= 3: auto skips them
# there for narrower dtypes than float32 unless config.auto_chain.
DTYPE_SUMS = {RS: (CHAIN,)}


def runs(op: str, method: str) -> str:
    """The schedule CUDA ``method`` runs for ``op`` (one of :data:`OPS`); the deprecated ``"nccl"``
    runs the op's :data:`DEFAULT` code (the NCCL transport runs its own schedule whatever it is)."""
    if method == NCCL:
        return DEFAULT[COLLECTIVE[op]]
    try:
        return RUNS[op][method]
    except KeyError:
        raise ValueError(
            f"{PUBLIC_NAME.get(op, op)}: `method` must be one of {(*CUDA_METHODS, NCCL)}; got {method!r}"
        ) from None


def sums_in_dtype(op: str, method: str, tp: int, dtype: str) -> bool:
    """Whether ``method`` sums the partials of a call in its (narrower than fp32) dtype, rounding
    once per hop: ``chain`` at tp >= 3 in bfloat16/float16."""
    return method in DTYPE_SUMS.get(op, ()) and tp >= 3 and dtype != "float32"


def canonical(
    requested: object,
    where: str = "",
    *,
    configured: bool = False,
    accept: tuple[str, ...] = METHODS,
    warn: bool = True,
    stacklevel: int = 3,
) -> str:
    """``requested`` as a name of ``accept`` (any case and surrounding blanks, as
    ``JAX_UB_METHOD`` takes it); ``where`` names the caller in the error (``"fn: "``), and
    ``configured`` says it came from ``JAX_UB_METHOD``. A deprecated name warns
    (``DeprecationWarning``, unless not ``warn``) and is returned as it is."""
    if isinstance(requested, str) and requested.strip().lower() in accept:
        name = requested.strip().lower()
        if warn and name in DEPRECATED:
            asked = f"JAX_UB_METHOD={name}" if configured else f"method={name!r}"
            warnings.warn(
                f"{where}{asked} is deprecated and will be removed in the next release: {DEPRECATED[name]}",
                DeprecationWarning,
                stacklevel=stacklevel,
            )
        return name
    if not isinstance(requested, str):  # a wrong type, as Python's own calls say it
        raise TypeError(
            f"{where}`method` must be None or a str, one of {accept}; got "
            f"{requested!r} ({type(requested).__name__})"
        )
    near = difflib.get_close_matches(requested.strip().lower(), accept, n=1, cutoff=0.6)
    raise ValueError(
        f"{where}`method` must be None or one of {accept}; got {requested!r}"
        + (f" (did you mean {near[0]!r}?)" if near else "")
    )


def alias_note(op: str, method: str) -> str:
    """``" (for <op>, <method> is the <schedule> algorithm)"`` where ``method`` is no schedule of
    ``op`` itself, else ``""`` (what :func:`jax_ub.explain` adds)."""
    sched = runs(op, method)
    return f" (for {PUBLIC_NAME[op]}, {method} is the {sched} algorithm)" if sched != method else ""
