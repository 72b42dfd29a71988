"""jax_ub: tensor-parallel communication/GEMM overlap for JAX (Userbuffers-style), as XLA FFI calls.

Public API:

* :func:`all_gather_matmul` / :func:`matmul_reduce_scatter` — shard_map primitives (AG→GEMM, GEMM→RS),
  differentiable, with a pure-XLA reference path (:mod:`jax_ub.reference`).
* :func:`bulk_all_gather` / :func:`bulk_reduce_scatter` — a collective under an independent GEMM
  (backward-pass bulk overlap).
* :class:`FP8Recipe` — FP8 with current scaling in those ops (``fp8=``; float8 operands take
  ``scales=``), see :mod:`jax_ub.fp8`.
* :func:`matmul` — the cuBLASLt GEMM custom call (reference ``jnp.matmul`` off-GPU).
* :func:`initialize` / :func:`shutdown` — the Userbuffers communicators of a mesh axis.
* :func:`check_processes` — every process of a ``jax.distributed`` run stops together naming
  why (a process's own problem, or settings that differ), or goes on together.
* :func:`build_info` — which path is active and why; :func:`explain` — what a call runs
  (``method="auto"``'s choice, or the method asked for) and why.
* :func:`checkpoint_policy` — a ``jax.checkpoint`` policy that also keeps jax_ub's op outputs
  (named :data:`CHECKPOINT_NAMES`), which dot-based policies do not see on the CUDA path.
* :mod:`jax_ub.tuning` — record the shapes a program's ops run at, for ``python -m jax_ub.bench
  tune``, whose file (``JAX_UB_TUNING_FILE``) ``method="auto"`` then chooses from.
* :func:`overlap_tp` — ``f``'s ``all_gather → dot`` and ``dot → psum_scatter`` run by jax_ub's ops.
* :func:`tp_dot_general` — a ``dot_general=`` for Flax's dense layers that runs those ops.
* :func:`summary` — what the ops ran (CUDA or reference, by method), host µs per op, failures.
* :mod:`jax_ub.config` — every knob (``JAX_UB_*`` environment variables).
* :mod:`jax_ub.nn` (Flax NNX) and :mod:`jax_ub.linen` (Flax linen) — TP/SP dense layers.
"""

from jax_ub import (
    config,
    overlap,
    reference,
    tuning,
)
from jax_ub._ext import build_info
from jax_ub.bulk import bulk_all_gather, bulk_reduce_scatter
from jax_ub.comm import initialize, shutdown
from jax_ub.comm.bootstrap import AgreementError, PeerFailedError, PeerTimeoutError
from jax_ub.comm.processes import ProcessCheckError, check_processes
from jax_ub.fp8 import FP8Recipe
from jax_ub.gemm import matmul
from jax_ub.inject import tp_dot_general
from jax_ub.ops import CHECKPOINT_NAMES, all_gather_matmul, checkpoint_policy, matmul_reduce_scatter
from jax_ub.overlap import explain
from jax_ub.transform import overlap_tp
from jax_ub.usage import summary

__version__ = "0.1.0"

__all__ = [
    "CHECKPOINT_NAMES",
    "AgreementError",
    "FP8Recipe",
    "PeerFailedError",
    "PeerTimeoutError",
    "ProcessCheckError",
    "__version__",
    "all_gather_matmul",
    "build_info",
    "bulk_all_gather",
    "bulk_reduce_scatter",
    "check_processes",
    "checkpoint_policy",
    "config",
    "explain",
    "initialize",
    "matmul",
    "matmul_reduce_scatter",
    "overlap",
    "overlap_tp",
    "reference",
    "shutdown",
    "summary",
    "tp_dot_general",
    "tuning",
]
