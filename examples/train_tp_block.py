#!/usr/bin/env python
"""Train a small GPT-style transformer with tensor + sequence parallelism on synthetic data.

Each block is ``x + attn(norm(x))`` then ``x + mlp(x)``, with

* attention: QKV as one :class:`jax_ub.nn.ColumnParallelDense` (AG→GEMM; the heads are split over
  ``tp``), causal softmax attention on each device's heads, output projection as a
  :class:`jax_ub.nn.RowParallelDense` (GEMM→RS);
* MLP: :class:`jax_ub.nn.ParallelMLP` (LayerNorm → column → gelu → row), or with ``--mlp swiglu``
  the gated MLP of Llama-style models (one column layer for gate and linear halves, ``silu(gate) *
  linear``, then row; no biases).

Between the layers the activations `[batch, seq, hidden]` are split over ``tp`` along the sequence
(sequence parallelism) and over ``dp`` along the batch. The task is next-token prediction on
sequences that repeat a random motif, which a causal attention layer can learn, so the loss drops
well below ``log(vocab)``.

Runs:

* one process driving every local device (``python examples/train_tp_block.py``); on a machine
  without GPUs it uses 4 simulated CPU devices and the pure-XLA reference path;
* one process per GPU: ``examples/launch.sh 4 examples/train_tp_block.py`` (the launcher's
  ``LAUNCH_*`` variables go to ``jax.distributed.initialize``);
* under mpirun / srun: add ``--distributed`` (``jax.distributed.initialize()`` detects the cluster);
* by hand on several hosts: ``--coordinator HOST:PORT --num-processes N --process-id I``.

In a multi-process run a process that fails (an exception, or a non-zero status such as a bad
configuration) prints why and leaves with ``os._exit(status)``: a plain exit would first run jax's
atexit ``jax.distributed.shutdown()``, whose barrier waits for every other process (up to 300 s)
while they wait for this one in a collective, so no launcher would see the failure.

``--fp8`` runs the tensor-parallel GEMMs in FP8 (``fp8=jax_ub.FP8Recipe()`` in the layers: current
scaling, e4m3 operands, e5m2 gradients; see docs/fp8.md), the parameters staying in ``--dtype``.

It prints the path that ran, the loss every ``--log-every`` steps and tokens/s; ``--compare`` trains
with ``method="xla"`` and with the chosen method from the same seed and prints the largest loss
difference and the speedup. The exit status is 1 when the loss is NaN or does not decrease.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import sys
import time
import traceback
from typing import Any

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:  # loaded by path, not run as a script
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # the command-line handling both training examples share

# Ends a failed multi-process run at once: flushes stdout and stderr, then os._exit(status). Not
# sys.exit: that runs the atexit handlers, and jax's calls jax.distributed.shutdown(), whose barrier
# waits for every other process (up to its shutdown_timeout_seconds, 300 s) while they wait for
# this one in a collective; the process would stay alive, so no launcher (launch.sh,
# srun --kill-on-bad-exit) would see the failure.
from failfast import leave_now

# (GPU, CPU) defaults of the options left unset.
DEFAULTS = dict(
    steps=(300, 100),
    lr=(3e-3, 1e-2),
    batch=(16, 8),
    seq=(1024, 32),
    hidden=(1024, 64),
    heads=(16, 4),
    layers=(2, 1),
    dtype=("bfloat16", "float32"),
)


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: ...)" where the help does not say it already (GPU/CPU defaults do)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=_Help)
    opt = functools.partial(_common.gpu_cpu_option, p, DEFAULTS)
    opt("steps", int, "training steps")
    opt("batch", int, "global batch")
    opt("seq", int, "sequence length")
    opt("hidden", int, "model width")
    opt("heads", int, "attention heads")
    p.add_argument("--ffn", type=int, default=None, help="MLP width (default: 4 * hidden)")
    opt("layers", int, "transformer blocks")
    p.add_argument("--vocab", type=int, default=64, help="vocabulary size")
    p.add_argument("--motif", type=int, default=8, help="period of the repeated random motif")
    opt("lr", float, "peak AdamW learning rate")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="compute dtype (default: bfloat16 on GPU, float32 on CPU); params are float32",
    )
    p.add_argument("--dp", type=int, default=1, help="data-parallel size (mesh axis 'dp')")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: devices / dp)")
    p.add_argument(
        "--method",
        default=None,
        choices=METHODS,
        metavar="METHOD",
        help=f"jax_ub method: {', '.join(METHODS)} (default: JAX_UB_METHOD or auto)",
    )
    p.add_argument(
        "--mlp",
        choices=("gelu", "swiglu"),
        default="gelu",
        help="the MLP: gelu (up, gelu, down) or swiglu (gated: silu(gate) * linear, no biases)",
    )
    p.add_argument(
        "--remat",
        choices=("none", "dots", "full"),
        default="none",
        help="recompute each block in the backward: 'dots' keeps the matmul outputs "
        "(jax_ub.checkpoint_policy(dots_saveable), which also keeps jax_ub's op "
        "outputs), 'full' keeps nothing",
    )
    p.add_argument(
        "--fp8",
        action="store_true",
        help="run every tensor-parallel GEMM in FP8 (fp8=jax_ub.FP8Recipe(): e4m3 operands with "
        "current scaling, e5m2 gradients); master weights stay in --dtype",
    )
    p.add_argument(
        "--compare",
        action="store_true",
        help="train with method='xla' and with --method from the same seed; print the max "
        "loss difference and the speedup",
    )
    p.add_argument(
        "--log-every", type=int, default=None, help="print the loss every N steps (default: steps/10)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--cpu-devices",
        type=int,
        default=None,
        help=f"simulated CPU devices per process; replaces a count XLA_FLAGS sets "
        f"(default: XLA_FLAGS's {_common.FORCE_DEVICES}, else {_common.CPU_DEVICES})",
    )
    p.add_argument(
        "--distributed",
        action="store_true",
        help="call jax.distributed.initialize() with cluster auto-detection (mpirun, srun); "
        "--coordinator/--num-processes/--process-id, where given, override what it detects",
    )
    p.add_argument(
        "--coordinator",
        default=None,
        help="HOST:PORT of process 0 (multi-process by hand: with --num-processes and --process-id)",
    )
    p.add_argument("--num-processes", type=int, default=None, help="process count (multi-process by hand)")
    p.add_argument(
        "--process-id", type=int, default=None, help="this process, 0 .. N-1 (multi-process by hand)"
    )
    p.add_argument(
        "--init-timeout",
        type=int,
        default=None,
        help="seconds jax.distributed.initialize waits for every process to connect (default: jax's, 300)",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=int,
        default=None,
        help="seconds without a heartbeat after which jax.distributed declares a process dead "
        "and aborts the others (default: jax's, 100)",
    )
    args = p.parse_args(argv)
    _common.check_lowest(p, args, LOWEST)
    # What every process of a run must be given alike, as typed (before the GPU/CPU defaults fill
    # the rest in): compared across processes before the first collective (see _run).
    args.compared = {k: v for k, v in sorted(vars(args).items()) if k not in PER_PROCESS}
    try:
        args.distributed_kw = distributed_kwargs(args, os.environ)
    except ValueError as e:
        p.error(str(e))
    return args


# Flags that may differ between the processes of one run: who a process is, how it reaches the
# coordinator (one host may name it "localhost", another by address), how long it waits, how often
# it prints, and the simulated CPU devices (whose count the device checks see).
PER_PROCESS = (
    "process_id",
    "coordinator",
    "num_processes",
    "distributed",
    "init_timeout",
    "heartbeat_timeout",
    "log_every",
    "cpu_devices",
)


# The lowest value of each int option that has one.
LOWEST = {
    **dict.fromkeys((*_common.COUNTS, "num_processes", "init_timeout", "heartbeat_timeout"), 1),
    "process_id": 0,
}

BY_HAND = {"--coordinator": "coordinator", "--num-processes": "num_processes", "--process-id": "process_id"}
LAUNCH_VARS = ("LAUNCH_COORDINATOR_ADDRESS", "LAUNCH_NUM_PROCESSES", "LAUNCH_PROCESS_ID")


def distributed_kwargs(args: argparse.Namespace, env: Any) -> dict[str, Any] | None:
    """The arguments of ``jax.distributed.initialize``, or None for one process; a ValueError (an
    argparse error) where the flags or launch.sh's variables are incomplete.

    From the first that applies: the by-hand flags (all three, or any with ``--distributed``, which
    detects the others); examples/launch.sh's ``LAUNCH_*`` variables; ``--distributed`` alone."""
    given = [flag for flag, name in BY_HAND.items() if getattr(args, name) is not None]
    kw: dict[str, Any] | None
    if given:
        missing = [flag for flag in BY_HAND if flag not in given]
        if missing and not args.distributed:
            raise ValueError(
                f"{' and '.join(given)} without {' and '.join(missing)}: a multi-process run by hand "
                f"needs all of --coordinator, --num-processes and --process-id (or add --distributed "
                f"to detect the others from mpirun or srun)"
            )
        kw = {
            {"coordinator": "coordinator_address"}.get(name, name): getattr(args, name)
            for name in BY_HAND.values()
            if getattr(args, name) is not None
        }
        if not args.distributed:
            # By hand means by hand: under srun or mpirun, jax's cluster detection would still give
            # each process one GPU by its local task id (a process per host would see only GPU 0).
            kw["cluster_detection_method"] = "deactivate"
        address = kw.get("coordinator_address")
        host, _, port = (address or "").rpartition(":")
        if address is not None and not (host and port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(
                f"--coordinator must be HOST:PORT (process 0's host, and a free port there); got {address!r}"
            )
    elif "LAUNCH_COORDINATOR_ADDRESS" in env:  # examples/launch.sh
        kw = {}
        for var, name in zip(
            LAUNCH_VARS, ("coordinator_address", "num_processes", "process_id"), strict=True
        ):
            if not env.get(var):
                raise ValueError(
                    f"LAUNCH_COORDINATOR_ADDRESS is set but {var} is not: start the processes "
                    f"with examples/launch.sh, or unset the LAUNCH_* variables"
                )
            try:
                kw[name] = env[var] if name == "coordinator_address" else int(env[var])
            except ValueError:
                raise ValueError(f"{var} must be an integer; got {env[var]!r}") from None
        if env.get("LAUNCH_LOCAL_RANK", "").isdigit():  # one GPU per process, by local rank
            kw["local_device_ids"] = [int(env["LAUNCH_LOCAL_RANK"])]
    elif args.distributed:
        kw = {}  # mpirun / srun / another cluster jax detects
    else:
        kw = None
    timeouts = {
        "--init-timeout": ("initialization_timeout", args.init_timeout),
        "--heartbeat-timeout": ("heartbeat_timeout_seconds", args.heartbeat_timeout),
    }
    if kw is None:
        if set_ := [flag for flag, (_, value) in timeouts.items() if value is not None]:
            raise ValueError(
                f"{' and '.join(set_)} only appl{'y' if len(set_) > 1 else 'ies'} to a "
                f"multi-process run (--distributed, --coordinator ..., or examples/launch.sh)"
            )
        return None
    num, pid = kw.get("num_processes"), kw.get("process_id")
    if num is not None and pid is not None and not pid < num:
        raise ValueError(f"--process-id ({pid}) must be below --num-processes ({num})")
    kw.update({name: value for name, value in timeouts.values() if value is not None})
    return kw


def _kw_text(kw: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kw.items())


def initialize_distributed(kw: dict[str, Any]) -> None:
    """jax.distributed.initialize(**kw): from the flags, from examples/launch.sh's variables, or
    auto-detected (see distributed_kwargs)."""
    import jax

    # Multi-process CPU runs need a collectives implementation (the option is harmless on GPU, and
    # may be gone in a future jax).
    with contextlib.suppress(Exception):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**kw)


def finish_distributed() -> None:
    """After a successful run, in the documented order: jax_ub.shutdown() (the end of _run; it is
    collective over jax.distributed's key-value store, so it comes first), then
    jax.distributed.shutdown(), whose barrier keeps every process, process 0 (the coordinator's host)
    included, until all have arrived. No device barrier before it: on CPU that one is a Gloo
    collective, and starting its connections at exit hung about one launch in ten on a loaded
    2-core machine. A failed run never gets here (see leave_now)."""
    import jax

    jax.distributed.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _common.prepare_environment(args)
    if args.distributed_kw is None:  # one process
        return _configure_and_run(args)
    try:
        try:
            initialize_distributed(args.distributed_kw)
        except ValueError as e:  # jax found no cluster to detect, or refused an argument
            print(
                f"error: jax.distributed.initialize({_kw_text(args.distributed_kw)}) refused: {e}"
                + (
                    " (--distributed found no mpirun or srun environment: pass --coordinator, "
                    "--num-processes and --process-id)"
                    if not args.distributed_kw.get("coordinator_address")
                    else ""
                ),
                file=sys.stderr,
            )
            leave_now(2)
        status = _configure_and_run(args)
    except SystemExit as e:  # sys.exit() below main(): its status, as Python would exit with
        code = e.code
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
        status = code if isinstance(code, int) else int(code is not None)
    except BaseException as e:  # any other failure, KeyboardInterrupt included, ends it too
        traceback.print_exc()
        leave_now(130 if isinstance(e, KeyboardInterrupt) else 1)
    if status != 0:  # _run printed why
        leave_now(status)
    finish_distributed()
    return 0


def _configure_and_run(args: argparse.Namespace) -> int:
    """The GPU/CPU defaults (the backend must be known), then the run; its exit status."""
    import jax

    _common.fill_gpu_cpu_defaults(args, DEFAULTS, jax.default_backend() == "gpu")
    args.ffn = args.ffn or 4 * args.hidden
    args.log_every = args.log_every or max(1, args.steps // 10)
    return _run(args)


def _log(*parts: Any) -> None:
    import jax

    if jax.process_index() == 0:
        print(*parts, flush=True)


def _build(args: argparse.Namespace, method: str | None):
    """The model class and a jitted train step (all jax imports happen here)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    import jax_ub
    from jax_ub import nn as ubnn

    dtype = jnp.dtype(args.dtype)
    # FP8 in the tensor-parallel layers: x and w quantized per tensor (current scaling) before the
    # all-gather, dy in e5m2 in the backward (the hybrid recipe); the parameters keep their dtype.
    fp8 = jax_ub.FP8Recipe() if args.fp8 else None
    # A dot-based policy alone does not see jax_ub's custom calls and would recompute them.
    policy = {
        "none": None,
        "full": jax.checkpoint_policies.nothing_saveable,
        "dots": jax_ub.checkpoint_policy(jax.checkpoint_policies.dots_saveable),
    }[args.remat]
    head_dim = args.hidden // args.heads

    def causal_attention(qkv: jax.Array) -> jax.Array:
        """Local heads: `[b, s, heads_local * 3 * head_dim]` → `[b, s, heads_local * head_dim]`."""
        b, s, f = qkv.shape
        q, k, v = jnp.split(qkv.reshape(b, s, f // (3 * head_dim), 3, head_dim), 3, axis=3)
        q, k, v = (t[:, :, :, 0] for t in (q, k, v))  # [b, s, h, d]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(head_dim)
        mask = jnp.tril(jnp.ones((s, s), bool))
        probs = jax.nn.softmax(jnp.where(mask, scores, -1e30), axis=-1).astype(v.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
        return out.reshape(b, s, -1)

    class Attention(nnx.Module):
        def __init__(self, *, rngs: nnx.Rngs):
            h = args.hidden
            self.norm = nnx.LayerNorm(h, dtype=dtype, rngs=rngs)
            # QKV features ordered [heads, 3, head_dim], so each tp shard holds whole heads.
            self.qkv = ubnn.ColumnParallelDense(h, 3 * h, dtype=dtype, method=method, fp8=fp8, rngs=rngs)
            self.out = ubnn.RowParallelDense(h, h, dtype=dtype, method=method, fp8=fp8, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            qkv = self.qkv(self.norm(x))  # [b, s, 3h], features split over tp
            spec = P("dp", None, "tp")
            ctx = jax.shard_map(causal_attention, in_specs=spec, out_specs=spec)(qkv)
            return self.out(ctx)  # [b, s, h], sequence split over tp

    class Block(nnx.Module):
        def __init__(self, *, rngs: nnx.Rngs):
            self.attn = Attention(rngs=rngs)
            gated = dict(gated=True, activation=jax.nn.silu, use_bias=False) if args.mlp == "swiglu" else {}
            self.mlp = ubnn.ParallelMLP(
                args.hidden, args.ffn, dtype=dtype, method=method, fp8=fp8, rngs=rngs, **gated
            )

        def __call__(self, x: jax.Array) -> jax.Array:
            x = x + self.attn(x)
            return x + self.mlp(x)

    class Model(nnx.Module):
        def __init__(self, *, rngs: nnx.Rngs):
            self.embed = nnx.Embed(args.vocab, args.hidden, rngs=rngs)
            self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (args.seq, args.hidden)))
            self.blocks = nnx.List([Block(rngs=rngs) for _ in range(args.layers)])
            self.norm = nnx.LayerNorm(args.hidden, dtype=dtype, rngs=rngs)

        def __call__(self, tokens: jax.Array) -> jax.Array:
            x = (self.embed(tokens) + self.pos[...]).astype(dtype)
            for block in self.blocks:
                x = block(x) if policy is None else nnx.remat(lambda b, x: b(x), policy=policy)(block, x)
            return self.embed.attend(self.norm(x).astype(jnp.float32))  # tied output embedding

    def batch(key: jax.Array) -> jax.Array:
        """`[batch, seq + 1]` int32: a random motif of length ``--motif`` repeated."""
        motif = jax.random.randint(key, (args.batch, args.motif), 0, args.vocab)
        reps = -(-(args.seq + 1) // args.motif)
        tokens = jnp.tile(motif, (1, reps))[:, : args.seq + 1]
        return jax.lax.with_sharding_constraint(tokens, P("dp"))

    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, max(1, args.steps // 10), max(2, args.steps))
    optimizer = optax.adamw(schedule, weight_decay=0.01)

    @jax.jit
    def init(key: jax.Array):
        model = Model(rngs=nnx.Rngs(key))
        _, params, rest = nnx.split(model, nnx.Param, ...)
        return params, rest, optimizer.init(params)

    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Model(rngs=nnx.Rngs(0))))

    def loss_fn(params, rest, tokens):
        logits = nnx.merge(graphdef, params, rest)(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    def step(params, rest, opt_state, key):
        loss, grads = jax.value_and_grad(loss_fn)(params, rest, batch(key))
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return init, step


def _train(args: argparse.Namespace, mesh: Any, method: str | None) -> tuple[list[float], float]:
    """Trains from ``--seed``; returns the losses and tokens/s (steps after the first)."""
    import jax

    with jax.set_mesh(mesh):
        init, step_fn = _build(args, method)
        key = jax.random.key(args.seed)
        params, rest, opt_state = init(key)
        # Outputs keep the inputs' shardings, so the step compiles once.
        same = jax.tree.map(lambda a: a.sharding, (params, opt_state))
        step = jax.jit(step_fn, out_shardings=(*same, None), donate_argnums=(0, 2))
        losses: list[float] = []
        t0 = None
        for i in range(args.steps):
            params, opt_state, loss = step(params, rest, opt_state, jax.random.fold_in(key, i + 1))
            if i == 0 or (i + 1) % args.log_every == 0 or i + 1 == args.steps:
                value = float(loss)  # waits for this step
                if i == 0:
                    t0 = time.perf_counter()  # compile + first step excluded from the rate
                _log(f"step {i + 1:5d}  loss {value:.4f}")
            losses.append(loss)
        jax.block_until_ready(losses[-1])
        elapsed = time.perf_counter() - t0 if t0 is not None else float("nan")
    values = [float(v) for v in losses]
    timed = args.steps - 1
    tps = timed * args.batch * args.seq / elapsed if timed > 0 and elapsed > 0 else float("nan")
    return values, tps


# jax_ub.config.METHODS (not imported here: --help must not wait for jax).
METHODS = ("auto", "xla", "ring", "all_peer", "push", "push_merge", "pipeline", "chain", "columns", "nccl")


def _resolved(method: str | None) -> tuple[str, str]:
    """What ``method`` resolves to in jax_ub.ops, and a line that also says whether the CUDA path is
    active and why."""
    import jax_ub
    from jax_ub import ops

    resolve = getattr(ops, "resolve_method", None) or getattr(ops, "_resolve_method", None)
    name = resolve(method) if resolve is not None else (method or jax_ub.config.get().method)
    kind = "pure-XLA reference" if name == "xla" else "jax_ub CUDA overlap"
    info = jax_ub.build_info()
    requested = method if method is not None else jax_ub.config.get().method
    return name, f"method={requested!r} -> {name!r} ({kind}; build: {info.get('path')}: {info.get('reason')})"


LEARNED = 0.95  # the last steps' mean loss must be below this share of the first steps'
JUDGE_STEPS = 10  # fewer steps (e.g. a run that only records shapes) are too few to judge the loss


def _check(losses: list[float], label: str) -> str | None:
    if any(math.isnan(v) or math.isinf(v) for v in losses):
        return f"{label}: loss is not finite: {losses[-5:]}"
    if len(losses) < JUDGE_STEPS:
        _log(f"[{label}] {len(losses)} steps: too few to check that the loss decreases (needs {JUDGE_STEPS})")
        return None
    k = max(1, len(losses) // 5)
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    # By a margin: the batches are drawn anew every step, so an untrained model's loss moves by a
    # few percent from noise alone (with --lr 0, last/first was 0.97-1.01), and a training run
    # falls more (the tests' tiny model: 0.91 in 40 steps; the default: 4.76 -> 1.26 in 100).
    if not last < LEARNED * first:
        return (
            f"{label}: loss did not decrease by {1 - LEARNED:.0%} (first {k} steps "
            f"{first:.4f}, last {k} {last:.4f})"
        )
    return None


def _configuration_problem(args: argparse.Namespace, n: int, tp: int) -> str | None:
    """Why this configuration cannot run on ``n`` devices with this ``tp``, or None."""
    if args.dp * tp != n:
        return f"dp ({args.dp}) * tp ({tp}) must equal the device count ({n})"
    for what, value in (("--heads", args.heads), ("--ffn", args.ffn), ("--seq", args.seq)):
        if value % tp:
            hint = (
                ""
                if args.tp
                else f"; tp = the {n} devices / --dp {args.dp} unless --tp says "
                f"otherwise: pass --tp and --dp with dp * tp = {n} (tp dividing {what}), or "
                f"run on fewer devices (--cpu-devices on CPU)"
            )
            return f"{what} ({value}) must be divisible by tp ({tp}){hint}"
    for what, value, by, size in (
        ("--hidden", args.hidden, "--heads", args.heads),
        ("--batch", args.batch, "--dp", args.dp),
    ):
        if value % size:
            return f"{what} ({value}) must be divisible by {by} ({size})"
    return None


def _run(args: argparse.Namespace) -> int:
    import jax

    import jax_ub

    runs = [("xla", "xla"), ("default", args.method)] if args.compare else [("run", args.method)]
    paths: dict[str, tuple[str, str]] = {}
    problem = None
    try:
        n = jax.device_count()
        tp = args.tp or n // args.dp
        problem = _configuration_problem(args, n, tp)
        # Also where the sizes are wrong: the methods are compared across processes below.
        paths = {label: _resolved(method) for label, method in runs}
    except ValueError as e:  # a CUDA method without the CUDA path, or a bad JAX_UB_* variable
        problem = problem or str(e)
    except Exception as e:  # anything else: the peers hear of it too (the traceback stays here)
        traceback.print_exc()
        problem = problem or f"{type(e).__name__}: {e}"
    if problem is not None:  # said here first, whatever the other processes do
        print(f"error: {problem}", file=sys.stderr, flush=True)
    # Every process learns here whether any of them cannot run, and whether they were all started
    # with the same flags (--steps or --seed differing would train different things, or hang),
    # then all stop together, naming the process and why, instead of leaving the others to wait
    # for it in their first collective until jax.distributed's heartbeat timeout.
    methods = {label: name for label, (name, _) in paths.items()}  # not the why: it names host paths
    try:
        jax_ub.check_processes({**args.compared, "methods": methods}, problem=problem)
    except jax_ub.ProcessCheckError as e:
        if set(e.problems) - {jax.process_index()} or e.differences or e.missing:  # more than its own
            print(f"error: {e}", file=sys.stderr)
        return 2
    except (jax_ub.AgreementError, jax_ub.PeerTimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    auto = (jax.sharding.AxisType.Auto,) * 2
    mesh = jax.make_mesh((args.dp, tp), ("dp", "tp"), axis_types=auto)
    _log(
        f"devices: {n} x {jax.devices()[0].platform} in {jax.process_count()} process(es); "
        f"mesh dp={args.dp} tp={tp}; model: {args.layers} block(s), hidden {args.hidden}, "
        f"{args.heads} heads, ffn {args.ffn} ({args.mlp}), seq {args.seq}, batch {args.batch}, {args.dtype}"
        + (" (FP8 GEMMs: e4m3 forward, e5m2 gradients)" if args.fp8 else "")
    )

    # Userbuffers communicators for the TP groups. Without the CUDA path it creates none, but with
    # several processes it still checks that every process got the same mesh and settings.
    jax_ub.initialize(mesh, "tp")
    results = {}
    for label, method in runs:
        _log(f"[{label}] path: {paths[label][1]}")
        losses, tps = _train(args, mesh, method)
        _log(f"[{label}] tokens/s: {tps:,.0f}  final loss {losses[-1]:.4f}")
        results[label] = (losses, tps)
        problem = _check(losses, label)
        if problem:
            print(f"FAILED: {problem}", file=sys.stderr, flush=True)
            return 1
    if args.compare:
        (la, ta), (lb, tb) = results["xla"], results["default"]
        diff = max(abs(a - b) for a, b in zip(la, lb, strict=True))
        _log(f"compare: max |loss(xla) - loss(default)| = {diff:.3e}; speedup default/xla = {tb / ta:.3f}x")
    jax_ub.shutdown()
    _log("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
