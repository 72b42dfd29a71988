"""What the training-step benchmarks (``bench mlp``, ``bench layer``) share: the step, the check
printed per impl, and the remat policies.

The step is ``jax.value_and_grad`` of ``mean(y**2)`` (float32) w.r.t. the parameters and the input
(:func:`train_step`), so it runs every overlapped op forward and its dual backward. Both benches'
``no_comm`` floor runs the same layers under :func:`jax_ub.layers.core.comm_stand_ins` (local
stand-ins of the collectives, the GEMMs through :func:`jax_ub.gemm.matmul`) with jax_ub's policy: a
floor built from XLA's GEMMs bounded jax_ub by another library's GEMM speed (at tp=2 jax_ub once
ran below it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

# An impl for jax_ub.bench.harness.time_impls, built when called: () -> (step, args).
Thunk = Callable[[], tuple[Callable[..., Any], tuple[Any, ...]]]

# --remat: the forward under jax.checkpoint with one of these policies (None: no checkpoint). The
# jax_ub impl gets jax_ub.checkpoint_policy(policy), which also keeps its ops' outputs (a custom call
# is no dot, so a dot policy alone would run every jax_ub op again in the backward).
REMAT_POLICIES: dict[str, Any] = {
    "none": None,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def policies(remat: str) -> tuple[Any, Any]:
    """``(base, jax_ub's)``: the policy of the XLA impls and the floor (a value of
    :data:`REMAT_POLICIES`) and of jax_ub's impl (``jax_ub.checkpoint_policy(base)``); ``(None,
    None)`` for ``"none"``."""
    import jax_ub

    if remat not in REMAT_POLICIES:
        raise ValueError(f"remat must be one of {sorted(REMAT_POLICIES)}; got {remat!r}")
    base = REMAT_POLICIES[remat]
    return base, (None if base is None else jax_ub.checkpoint_policy(base))


def train_step(forward: Callable[[Any, jax.Array], jax.Array], policy: Any = None) -> Callable[..., Any]:
    """``(params, x) -> (loss, (dparams, dx))`` with ``loss = mean(forward(params, x)**2)``;
    ``policy``: the forward under ``jax.checkpoint`` with that policy."""
    if policy is not None:
        forward = jax.checkpoint(forward, policy=policy)

    def loss(params: Any, x: jax.Array) -> jax.Array:
        return jnp.mean(jnp.square(forward(params, x).astype(jnp.float32)))

    return jax.value_and_grad(loss, argnums=(0, 1))


def check(name: str, out: Any) -> tuple[float, float]:
    """``(loss, |dx|)`` of impl ``name``'s step output (a ``probe`` of
    :func:`jax_ub.bench.harness.time_impls`): printed per impl as a sanity check."""
    loss, (_, dx) = out
    return float(loss), float(jnp.linalg.norm(dx.astype(jnp.float32)))


def check_line(what: str, checks: dict[str, tuple[float, float]]) -> str:
    """``<what> check (loss, |dx|): impl (loss, dx), ...`` (tests parse it)."""
    return f"{what} check (loss, |dx|): " + ", ".join(
        f"{k} ({v[0]:.6g}, {v[1]:.6g})" for k, v in checks.items()
    )
