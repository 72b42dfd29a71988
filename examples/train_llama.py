#!/usr/bin/env python
"""Train a small Llama-style model with tensor + sequence parallelism on synthetic data.

The model is :class:`jax_ub.models.llama.LlamaModel`: token embedding, decoder layers stacked with
``nnx.scan`` (RMSNorm, fused grouped-query QKV projection through jax_ub's AG→GEMM, RoPE, causal
attention through ``jax.nn.dot_product_attention`` — cuDNN's fused attention on GPUs —, the output
projection through GEMM→RS, and the SwiGLU MLP), a final RMSNorm and an output projection of its
own (``lm_head``, not tied to the embedding). Between the layers the activations
`[batch, seq, hidden]` are split over ``tp`` along the sequence and over ``dp`` along the batch.

On GPUs it runs jax_ub's CUDA path on every local GPU (one process); on a machine without GPUs it
uses 4 simulated CPU devices and the pure-XLA reference path, with a tiny model. ``--fp8`` runs
every projection in FP8 (:class:`jax_ub.FP8Recipe`: e4m3 forward, e5m2 gradients, current
scaling; master weights stay float32). ``--remat`` recomputes each layer in the backward.

The task is next-token prediction on sequences that repeat a random motif, which causal attention
can learn, so the loss falls well below ``log(vocab)``. It prints the path that ran, the loss every
``--log-every`` steps and tokens/s; the exit status is 1 when the loss is not finite or does not
fall. For several processes (``jax.distributed``, ``launch.sh``, mpirun/srun) see
``examples/train_tp_block.py``, which this example shares its data and checks with in spirit.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time
from typing import Any

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:  # loaded by path, not run as a script
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # the command-line handling both training examples share

# (GPU, CPU) defaults of the options left unset.
DEFAULTS = dict(
    steps=(200, 60),
    batch=(8, 16),
    seq=(2048, 32),
    hidden=(1024, 64),
    heads=(16, 8),
    kv_heads=(8, 4),
    head_dim=(64, 8),
    ffn=(2816, 128),
    layers=(4, 2),
    lr=(1e-3, 1e-2),
    dtype=("bfloat16", "float32"),
)
REMAT = ("none", "dots", "names", "full")  # jax_ub.models.llama.REMAT (--help must not wait for jax)
LEARNED = 0.9  # the last steps' mean loss must be below this share of the first steps'
LOWEST = dict.fromkeys((*_common.COUNTS, "kv_heads", "head_dim"), 1)  # the lowest value of each count


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    opt = functools.partial(_common.gpu_cpu_option, p, DEFAULTS)
    opt("steps", int, "training steps")
    opt("batch", int, "global batch")
    opt("seq", int, "sequence length")
    opt("hidden", int, "model width")
    opt("heads", int, "query heads")
    opt("kv-heads", int, "key/value heads (grouped-query attention)")
    opt("head-dim", int, "head size")
    opt("ffn", int, "SwiGLU width")
    opt("layers", int, "decoder layers")
    opt("lr", float, "peak AdamW learning rate")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="compute dtype (default: bfloat16 on GPU, float32 on CPU)",
    )
    p.add_argument("--vocab", type=int, default=64, help="vocabulary size (default: 64)")
    p.add_argument("--motif", type=int, default=4, help="period of the repeated random motif (default: 4)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel size, mesh axis 'dp' (default: 1)")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: devices / dp)")
    p.add_argument(
        "--method", default=None, help="jax_ub method (default: JAX_UB_METHOD or auto); 'xla': the reference"
    )
    p.add_argument(
        "--fp8", action="store_true", help="FP8 projections (jax_ub.FP8Recipe(): e4m3 forward, e5m2 backward)"
    )
    p.add_argument(
        "--remat", choices=REMAT, default="none", help="recompute each layer in the backward (default: none)"
    )
    p.add_argument(
        "--log-every", type=int, default=None, help="print the loss every N steps (default: steps/10)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--cpu-devices",
        type=int,
        default=None,
        help=f"simulated CPU devices (default: {_common.CPU_DEVICES})",
    )
    args = p.parse_args(argv)
    _common.check_lowest(p, args, LOWEST)
    return args


def configuration_problem(args: argparse.Namespace, n: int, tp: int) -> str | None:
    """Why this configuration cannot run on ``n`` devices with this ``tp``, or None."""
    if args.dp * tp != n:
        return f"--dp ({args.dp}) * tp ({tp}) must equal the device count ({n})"
    for what, value in (
        ("--heads", args.heads),
        ("--kv-heads", args.kv_heads),
        ("--ffn", args.ffn),
        ("--seq", args.seq),
    ):
        if value % tp:
            return f"{what} ({value}) must be divisible by tp ({tp})"
    if args.heads % args.kv_heads:
        return f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})"
    if args.batch % args.dp:
        return f"--batch ({args.batch}) must be divisible by --dp ({args.dp})"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _common.prepare_environment(args)
    import jax

    on_gpu = jax.default_backend() == "gpu"
    _common.fill_gpu_cpu_defaults(args, DEFAULTS, on_gpu)
    args.log_every = args.log_every or max(1, args.steps // 10)
    n = jax.device_count()
    tp = args.tp or n // args.dp
    problem = configuration_problem(args, n, tp)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    return train(args, tp)


def train(args: argparse.Namespace, tp: int) -> int:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    import jax_ub
    from jax_ub.models import llama

    cfg = llama.LlamaConfig(
        hidden=args.hidden,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        ffn=args.ffn,
        num_layers=args.layers,
        vocab=args.vocab,
        rope_theta=10000.0,
        dtype=jnp.dtype(args.dtype),
        method=args.method,
        fp8=jax_ub.FP8Recipe() if args.fp8 else None,
        remat=args.remat,
    )
    auto = (jax.sharding.AxisType.Auto,) * 2
    mesh = jax.make_mesh((args.dp, tp), ("dp", "tp"), axis_types=auto)
    info = jax_ub.build_info()
    print(
        f"devices: {jax.device_count()} x {jax.devices()[0].platform}; mesh dp={args.dp} tp={tp}; "
        f"path: {info.get('path')} ({info.get('reason')})\n"
        f"model: {cfg.num_layers} layer(s), hidden {cfg.hidden}, {cfg.num_heads} heads / "
        f"{cfg.num_kv_heads} kv heads of {cfg.head_dim}, ffn {cfg.ffn}, seq {args.seq}, batch "
        f"{args.batch}, {args.dtype}{', fp8 (e4m3 fwd, e5m2 bwd)' if args.fp8 else ''}, remat {args.remat}",
        flush=True,
    )
    jax_ub.initialize(mesh, "tp")

    def batch(key: jax.Array) -> jax.Array:
        """`[batch, seq + 1]` int32: a random motif of length ``--motif`` repeated."""
        motif = jax.random.randint(key, (args.batch, args.motif), 0, args.vocab)
        tokens = jnp.tile(motif, (1, -(-(args.seq + 1) // args.motif)))[:, : args.seq + 1]
        return jax.lax.with_sharding_constraint(tokens, P("dp"))

    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, max(1, args.steps // 10), max(2, args.steps))
    optimizer = optax.adamw(schedule, weight_decay=0.01)
    key = jax.random.key(args.seed)
    with jax.set_mesh(mesh):

        @jax.jit
        def init(key: jax.Array) -> Any:
            model = llama.LlamaModel(cfg, rngs=nnx.Rngs(key))
            _, params, rest = nnx.split(model, nnx.Param, ...)
            return params, rest, optimizer.init(params)

        graphdef = nnx.graphdef(nnx.eval_shape(lambda: llama.LlamaModel(cfg, rngs=nnx.Rngs(0))))

        def loss_fn(params: Any, rest: Any, tokens: jax.Array) -> jax.Array:
            logits = nnx.merge(graphdef, params, rest)(tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        def step_fn(params: Any, rest: Any, opt_state: Any, key: jax.Array) -> Any:
            loss, grads = jax.value_and_grad(loss_fn)(params, rest, batch(key))
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        params, rest, opt_state = init(key)
        same = jax.tree.map(lambda a: a.sharding, (params, opt_state))
        step = jax.jit(step_fn, out_shardings=(*same, None), donate_argnums=(0, 2))
        losses: list[Any] = []
        t0 = None
        for i in range(args.steps):
            params, opt_state, loss = step(params, rest, opt_state, jax.random.fold_in(key, i + 1))
            losses.append(loss)
            if i == 0 or (i + 1) % args.log_every == 0 or i + 1 == args.steps:
                value = float(loss)  # waits for this step
                if i == 0:
                    t0 = time.perf_counter()  # compilation and the first step are not timed
                print(f"step {i + 1:5d}  loss {value:.4f}", flush=True)
        jax.block_until_ready(losses[-1])
        elapsed = time.perf_counter() - t0 if t0 is not None else float("nan")
    values = [float(v) for v in losses]
    timed = args.steps - 1
    tps = timed * args.batch * args.seq / elapsed if timed > 0 and elapsed > 0 else float("nan")
    print(f"tokens/s: {tps:,.0f}  final loss {values[-1]:.4f}", flush=True)
    jax_ub.shutdown()
    if not all(math.isfinite(v) for v in values):
        print(f"FAILED: the loss is not finite: {values[-5:]}", file=sys.stderr)
        return 1
    k = max(1, len(values) // 5)
    first, last = sum(values[:k]) / k, sum(values[-k:]) / k
    if len(values) >= 10 and not last < LEARNED * first:
        print(
            f"FAILED: the loss did not fall by {1 - LEARNED:.0%} "
            f"(first {k} steps {first:.4f}, last {last:.4f})",
            file=sys.stderr,
        )
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
