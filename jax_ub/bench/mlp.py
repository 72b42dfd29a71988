"""Workloads of ``python -m jax_ub.bench mlp``: one training step of a TP/SP transformer's dense layers.

Two models, built from :mod:`jax_ub.nn` layers in global mode over a 1-D ``("tp",)`` mesh, with the
sequence-parallel layout (input and output `[1, tokens, hidden]`, the sequence split over ``tp``):

* ``mlp``: :class:`jax_ub.nn.ParallelMLP` ``(hidden, ffn)``: LayerNorm → ColumnParallelDense
  (AG→GEMM) → gelu → RowParallelDense (GEMM→RS);
* ``swiglu``: the gated MLP of Llama-style models, :class:`jax_ub.nn.ParallelMLP` ``(hidden, ffn,
  gated=True, activation=silu, use_bias=False)``: LayerNorm → ColumnParallelDense ``hidden → 2*ffn``
  (gate and linear halves interleaved, one AG→GEMM) → ``silu(gate) * linear`` → RowParallelDense
  ``ffn → hidden``. Its records carry ``ffn`` (the width after the gate);
* ``attn_proj``: the attention projections without the attention math: ColumnParallelDense
  ``hidden → 3*hidden`` (QKV), then per device ``q + k + v`` of its local features (a token-local
  stand-in for attention, so the shapes and layouts are the real ones), then RowParallelDense
  ``hidden → hidden`` (output projection). Its records carry ``ffn = 3*hidden`` (the QKV width).

The step is :func:`jax_ub.bench.step.train_step` (``value_and_grad`` of ``mean(y**2)`` w.r.t. the
parameters and the input): both overlapped primitives forward and their duals backward. Parameters
and compute are in ``dtype``. Three configurations with the same parameters and input:

* ``jax_ub``: the layers with ``method="auto"`` (the CUDA overlap after ``jax_ub.initialize``; the
  pure-XLA reference where the CUDA path is unavailable);
* ``xla_plain``: the same layers with ``method="xla"`` (XLA's all-gather / reduce-scatter, then the
  dot, inside the layers' ``shard_map``: no overlap);
* ``xla_windowed``: the same parameters and math written for jit's SPMD partitioner (sharding
  constraints on the same layouts instead of ``shard_map``), compiled with the windowed-einsum
  flags. XLA only decomposes the collectives its partitioner creates, so the flags would not touch
  the layers' explicit ``shard_map`` collectives.

And one floor that is not a competitor: ``no_comm``, the same layers run under
:func:`jax_ub.layers.core.comm_stand_ins`: every collective replaced by a local stand-in of the same
shapes (the all-gather by ``tp`` copies of the local shard, the reduce-scatter by this device's rows
of the local GEMM), the GEMMs through :func:`jax_ub.gemm.matmul` (the kernel jax_ub's ops run), under
jax_ub's checkpoint policy. It bounds what an overlap can reach: the best speedup over
``xla_plain`` is ``xla_plain / no_comm``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_ub import nn as ubnn
from jax_ub.bench import harness as h
from jax_ub.bench import step
from jax_ub.layers import core as _layers

MODELS = ("mlp", "attn_proj", "swiglu")
GATED = ("swiglu",)  # models whose MLP is gated (the rest of their math is ``mlp``'s)
SP = P(None, "tp", None)  # [batch, seq, hidden], sequence split over tp
TP = P(None, None, "tp")  # [batch, seq, features], features split over tp


def _mix(qkv: jax.Array, mesh: Any) -> jax.Array:
    """`[b, s, 3h]` split over tp on features → `[b, s, h]` likewise: ``q + k + v`` per device."""

    def local(t: jax.Array) -> jax.Array:
        q, k, v = jnp.split(t, 3, axis=-1)
        return q + k + v

    return jax.shard_map(local, mesh=mesh, in_specs=TP, out_specs=TP)(qkv)


class AttnProj(nnx.Module):
    """QKV (column-parallel, ``hidden → 3*hidden``) → :func:`_mix` → output projection (row)."""

    def __init__(self, hidden: int, *, dtype: Any, method: str, mesh: Any, rngs: nnx.Rngs):
        common = dict(dtype=dtype, param_dtype=dtype, method=method, mesh=mesh, rngs=rngs)
        self.mesh = mesh
        self.qkv = ubnn.ColumnParallelDense(hidden, 3 * hidden, **common)
        self.out = ubnn.RowParallelDense(hidden, hidden, **common)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(_mix(self.qkv(x), self.mesh))


def make_model(model: str, mesh: Any, hidden: int, ffn: int, dtype: Any, method: str) -> nnx.Module:
    rngs = nnx.Rngs(0)
    if model == "mlp":
        return ubnn.ParallelMLP(
            hidden, ffn, dtype=dtype, param_dtype=dtype, method=method, mesh=mesh, rngs=rngs
        )
    if model == "swiglu":
        return ubnn.ParallelMLP(
            hidden,
            ffn,
            gated=True,
            activation=jax.nn.silu,
            use_bias=False,
            dtype=dtype,
            param_dtype=dtype,
            method=method,
            mesh=mesh,
            rngs=rngs,
        )
    if model == "attn_proj":
        return AttnProj(hidden, dtype=dtype, method=method, mesh=mesh, rngs=rngs)
    raise ValueError(f"model must be one of {MODELS}; got {model!r}")


# ------------------------------------------------------------------------------------------------
# The same math for jit's SPMD partitioner (xla_windowed).


def _spmd_dense(x: jax.Array, layer: Any, out_spec: P, mesh: Any, dtype: Any) -> jax.Array:
    y = jnp.matmul(x, layer.kernel[...].astype(dtype))
    if layer.bias is not None:
        y = y + layer.bias[...].astype(dtype)
    return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, out_spec))


def _mlp(m: nnx.Module) -> ubnn.ParallelMLP:
    """``m`` as the :class:`jax_ub.nn.ParallelMLP` that :func:`make_model` builds for ``mlp`` and
    ``swiglu`` (its norm: the default LayerNorm)."""
    return cast(ubnn.ParallelMLP, m)


def _norm(m: nnx.Module) -> ubnn.LayerNorm:
    return cast(ubnn.LayerNorm, _mlp(m).norm)


def _activate(model: str, m: nnx.Module, h: jax.Array) -> jax.Array:
    activation = _mlp(m).activation
    return _layers.glu(h, activation) if model in GATED else activation(h)


def spmd_forward(model: str, m: nnx.Module, x: jax.Array, mesh: Any, dtype: Any) -> jax.Array:
    """``m(x)`` computed on global arrays with sharding constraints instead of shard_map."""
    x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, SP))
    if model != "attn_proj":
        norm = _norm(m)
        h = _layers.layer_norm(x, norm.scale[...], norm.bias[...], epsilon=norm.epsilon, dtype=dtype)
        h = _activate(model, m, _spmd_dense(h, _mlp(m).up, TP, mesh, dtype))
        return _spmd_dense(h, _mlp(m).down, SP, mesh, dtype)
    proj = cast(AttnProj, m)
    ctx = _mix(_spmd_dense(x, proj.qkv, TP, mesh, dtype), mesh)
    return _spmd_dense(ctx, proj.out, SP, mesh, dtype)


# ------------------------------------------------------------------------------------------------
# Steps and the impls the harness times.


def build(
    model: str,
    mesh: Any,
    *,
    hidden: int,
    ffn: int,
    tokens: int,
    dtype_name: str,
    windowed_flags: dict[str, Any],
    remat: str = "none",
) -> dict[str, step.Thunk]:
    """``{impl: thunk}``; each thunk returns ``(step, (params, x))`` for the harness to time.
    ``remat``: a key of :data:`jax_ub.bench.step.REMAT_POLICIES`; with remat,
    ``jax_ub_base_policy`` also times the jax_ub layers under the bare policy, which does not keep
    jax_ub's op outputs (a custom call is no dot).

    Call after ``jax_ub.initialize(mesh, "tp")`` where the CUDA path runs: ``method="auto"`` is
    resolved when the jax_ub step is traced.
    """
    dtype = jnp.dtype(dtype_name)
    base, ub_policy = step.policies(remat)
    train_step = step.train_step

    def make(method: str) -> nnx.Module:
        return make_model(model, mesh, hidden, ffn, dtype, method)

    graphdef = nnx.graphdef(nnx.eval_shape(lambda: make("auto")))
    xla_graphdef = nnx.graphdef(nnx.eval_shape(lambda: make("xla")))
    params = jax.jit(lambda: nnx.state(make("auto")))()  # one program, created sharded
    x = jax.random.normal(jax.random.key(1), (1, tokens, hidden), jnp.float32).astype(dtype)
    x = jax.device_put(x, NamedSharding(mesh, SP))
    args = (params, x)

    def layers(gd: Any) -> Callable[[Any, jax.Array], jax.Array]:
        return lambda p, x: nnx.merge(gd, p)(x)

    def spmd(p: Any, x: jax.Array) -> jax.Array:
        return spmd_forward(model, nnx.merge(xla_graphdef, p), x, mesh, dtype)

    def windowed() -> tuple[Callable[..., Any], tuple[Any, ...]]:
        compiled = jax.jit(train_step(spmd, base)).lower(*args).compile(compiler_options=windowed_flags)
        return compiled, args

    def nocomm(p: Any, x: jax.Array) -> jax.Array:
        with _layers.comm_stand_ins():
            return nnx.merge(graphdef, p)(x)

    impls: dict[str, step.Thunk] = {
        "jax_ub": lambda: (jax.jit(train_step(layers(graphdef), ub_policy)), args),
        "xla_plain": lambda: (jax.jit(train_step(layers(xla_graphdef), base)), args),
        "xla_windowed": windowed,
        "no_comm": lambda: (jax.jit(train_step(nocomm, ub_policy)), args),
    }
    if base is not None:
        impls["jax_ub_base_policy"] = lambda: (jax.jit(train_step(layers(graphdef), base)), args)
    return impls


# ------------------------------------------------------------------------------------------------
# The runner of the subcommand

CHART = ["xla_plain", "xla_windowed", "jax_ub", "jax_ub_base_policy", "no_comm"]


def run(a: argparse.Namespace) -> int:
    import jax_ub

    if a.tp > len(jax.devices()):
        print(f"error: --tp {a.tp} needs {a.tp} devices; found {len(jax.devices())}", file=sys.stderr)
        return 2
    for what, v in (("--tokens", a.tokens), ("--hidden", a.hidden), ("--ffn", a.ffn)):
        if v % a.tp:
            print(f"error: {what} ({v}) must be divisible by --tp ({a.tp})", file=sys.stderr)
            return 2
    cuda, path = h.path_info()
    print(path)
    if not cuda:
        h.progress("xla_windowed: the windowed-einsum flags are GPU flags; off GPU this is plain SPMD")
    stem = h.out_stem(a, "mlp" if a.remat == "none" else f"mlp-remat-{a.remat}")
    out = h.Results(a, stem, path)
    rows = []
    mesh = None
    try:
        for model in a.models:
            ffn = 3 * a.hidden if model == "attn_proj" else a.ffn
            label = f"{model} tp={a.tp} hidden={a.hidden} ffn={ffn} tokens={a.tokens} {a.dtype}"
            common = {
                "op": model,
                "hidden": a.hidden,
                "ffn": ffn,
                "tokens": a.tokens,
                "tp": a.tp,
                "dtype": a.dtype,
            }
            if a.remat != "none":
                common["remat"] = a.remat
            with out.case(common, label, shutdown=False) as c:  # one mesh for every model
                if mesh is None:
                    mesh = h.make_mesh(a.tp, cuda)
                impls = build(
                    model,
                    mesh,
                    hidden=a.hidden,
                    ffn=a.ffn,
                    tokens=a.tokens,
                    dtype_name=a.dtype,
                    windowed_flags=h.WINDOWED_FLAGS,
                    remat=a.remat,
                )
                checks: dict[str, Any] = {}
                c.res = h.time_impls(label, impls, a, probe=step.check, probes=checks, failures=out.failures)
                print(step.check_line(model, checks))
            rows.append((model, ffn, c.res))
    finally:
        jax_ub.shutdown()
    stop = out.finish()
    if stop is not None:
        return stop
    png = h.plot(
        out.records,
        stem + ".png",
        f"jax_ub mlp fwd+bwd ({os.path.basename(stem)}, {a.dtype})",
        CHART,
        lambda r: f"{r['op']} tp{r['tp']}\nh{r['hidden']} f{r['ffn']} t{r['tokens']}",
    )
    h.wrote(stem, png)
    for model, _, r in rows:
        print(f"{model}: jax_ub speedup vs xla_plain {h.ratio(r, 'xla_plain', 'jax_ub'):.2f}x")
    print(
        f"{path}\nmodel      tp  hidden  ffn     tokens  xla_plain  windowed  jax_ub  speedup  "
        f"no_comm  (best possible)"
    )
    for model, ffn, r in rows:
        g = lambda k, r=r: r.get(k, float("nan"))  # noqa: E731
        print(
            f"{model:<10} {a.tp:<3} {a.hidden:<7} {ffn:<7} {a.tokens:<7} {g('xla_plain'):9.3f} "
            f"{g('xla_windowed'):9.3f} {g('jax_ub'):7.3f}  {h.ratio(r, 'xla_plain', 'jax_ub'):6.2f}x  "
            f"{g('no_comm'):7.3f}  ({h.ratio(r, 'xla_plain', 'no_comm'):.2f}x)"
        )
    if a.remat != "none":
        for model, _, r in rows:
            g = lambda k, r=r: r.get(k, float("nan"))  # noqa: E731
            print(
                f"{model}: remat {a.remat}: jax_ub with jax_ub.checkpoint_policy {g('jax_ub'):.3f} ms, "
                f"with the bare policy {g('jax_ub_base_policy'):.3f} ms "
                f"({h.ratio(r, 'jax_ub_base_policy', 'jax_ub'):.2f}x slower)"
            )
    return 0
