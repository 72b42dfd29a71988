"""Workload of ``python -m jax_ub.bench layer``: one training step of a whole Llama-style decoder
layer (attention and MLP), forward and backward, over a 1-D ``("tp",)`` mesh in the
sequence-parallel layout (input and output ``[batch, seq, hidden]``, the sequence split over tp).

The layer is :class:`jax_ub.models.llama.LlamaLayer`: RMSNorm → fused QKV column-parallel
(AG→GEMM; grouped-query heads split over tp) → RoPE → causal attention
(``jax.nn.dot_product_attention``, cuDNN's fused kernel on GPU) → output projection
row-parallel (GEMM→RS) → residual → RMSNorm → gated up projection column-parallel →
SwiGLU → down projection row-parallel → residual. Shapes from ``--preset`` (:data:`PRESETS`) and
the shape options. The step is :func:`jax_ub.bench.step.train_step`; ``--remat`` runs it with the
forward under ``jax.checkpoint`` (``none``: off; a policy name: on, jax_ub's impl and the floor with
``jax_ub.checkpoint_policy`` of that policy).

Impls, one run, the same parameters and input:

* ``jax_ub``: the layer with ``method="auto"`` (jax_ub's CUDA ops after ``jax_ub.initialize``; the
  pure-XLA reference off the CUDA path and at tp=1, where there is nothing to communicate);
* ``xla``: the same layer with ``method="xla"`` (XLA's all-gather / reduce-scatter, then the dot,
  inside the layers' ``shard_map``);
* ``xla_cm``: the same math written for jit's SPMD partitioner (sharding constraints instead of
  ``shard_map``) under XLA's collective-matmul flags (:data:`XLA_CM_FLAGS`), which must be set
  before the backend starts: timed in a subprocess of this command, its check compared with
  ``xla``'s. Skipped, with a printed reason, off the CUDA path and at tp=1 unless ``--xla-cm on``;
* ``no_comm``: the floor, not a competitor: the same step with every collective replaced by a
  local stand-in of the same shapes, the GEMMs on jax_ub's kernels (:func:`jax_ub.gemm.matmul`;
  :func:`jax_ub.models.llama.forward_no_comm`).

``--fp8``: every projection of every impl with ``fp8=jax_ub.FP8Recipe()`` (the default recipe:
e4m3 forward, e5m2 gradients): ``jax_ub`` runs the ops' FP8 path, ``xla`` XLA's FP8 dot
(:func:`jax_ub.fp8.scaled_dot`) after XLA's collectives, ``no_comm`` the stand-ins' GEMMs with the
recipe (:func:`jax_ub.ops.local_matmul`, where the stand-ins pass the recipe on); ``xla_cm`` is
skipped (:func:`xla_cm_reason`). Each record says ``"fp8"`` (and ``"fp8_recipe"``, its dtypes) and
``"fp8_gemms"``: whether its step's program holds an FP8 GEMM (a dot or a jax_ub custom call on
float8 operands), so a floor whose stand-ins ran in the compute dtype says so. The files' tag gets
``-fp8`` (``layer-8b-fp8``), and jax_ub's step is held to xla's within :data:`STEP_ERR_BOUND_FP8`.

Each record carries the step's ms (median of ``--reps`` timed bursts after warm-up, as every bench:
:func:`jax_ub.bench.harness.time_impls`), ``tokens_per_s`` (``batch*seq`` per step),
``model_flops`` (:func:`model_flops`), ``tflops`` and ``mfu`` (``model_flops / step time / (tp *
peak)``, ``peak_tflops`` per GPU from :data:`PEAK_TFLOPS`; null where the peak is unknown, e.g. on
CPU); jax_ub's record carries the hidden fraction ``E`` (:func:`hidden_fraction`), null with
``E_why`` where it is undefined (tp=1, a missing time, XLA's step exposing no communication).

Files, under ``--out``, with ``<stem>`` = ``<machine>-<yyyymmdd>-layer-<preset>`` (``layer-h<hidden>-f<ffn>``
where a size option changes the preset's), so runs of two presets on one day keep their own files:
``<stem>.json`` (records), ``<stem>.png`` (chart), ``<stem>-trace.json`` (jax_ub's step as a
Chrome/Perfetto trace of its ops and their chunks, :func:`jax_ub.bench.timeline.chrome_trace`; on
CPU, or where no jax_ub CUDA op runs, a file that says so) and with ``--profile``
``<stem>-profile/`` (a ``jax.profiler`` trace of the same step, to open beside it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_ub.bench import harness as h
from jax_ub.bench import step
from jax_ub.models import llama

# The shape options and the fields of jax_ub.models.llama.LlamaConfig they set.
FIELDS = {
    "hidden": "hidden",
    "heads": "num_heads",
    "kv_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "ffn": "ffn",
}
PRESETS: dict[str, dict[str, int]] = {  # llama's 8B- and 70B-class layers
    name: {k: llama.PRESETS[name][f] for k, f in FIELDS.items()} for name in ("8b", "70b")
}
SHAPE_KEYS = tuple(FIELDS)
IMPLS = ("xla", "xla_cm", "jax_ub", "no_comm")  # chart order
# XLA's collective matmul for jit-partitioned einsums: decompose every all-gather/reduce-scatter
# next to a dot (threshold 0 MiB) into a loop of collective-permutes and partial dots, on several
# streams. Without xla_gpu_use_memcpy_local_p2p: with it jax 0.11.2's XLA gave wrong outputs at tp=4
# (harness.WINDOWED_NCCL_FLAGS).
XLA_CM_FLAGS = {
    "xla_gpu_threshold_for_windowed_einsum_mib": 0,
    "xla_gpu_multi_streamed_windowed_einsum": True,
}
# Dense peak TFLOP/s per GPU by device kind and dtype (NVIDIA's data sheets, SXM parts, without
# sparsity): the denominator of mfu. float32 has none (TF32 or not depends on the precision).
_HOPPER = {"bfloat16": 989.4, "float16": 989.4}
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "NVIDIA H200": _HOPPER,
    "NVIDIA H100 80GB HBM3": _HOPPER,
}
# How far (fp32 relative Frobenius error, the largest over the step's outputs) an impl's step may be
# from xla's: looser than one op's bound (harness.REL_ERR_BOUND), the error of a dozen GEMMs adds up.
STEP_ERR_BOUND = {"bfloat16": 5e-2, "float16": 5e-2, "float32": 1e-3}
# The same with --fp8. Both steps quantize the same tensors with the same current scaling, so they
# differ where a rounding difference upstream (another accumulation order, XLA's fast accumulation
# against jax_ub's full one) moves a value across an FP8 rounding boundary: that element then moves
# by one FP8 step (2^-3 relative in e4m3, 2^-2 in e5m2). Those are few, so the step's relative error
# stays well under the FP8 error of one GEMM against the unquantized product (3-5 %, docs/fp8.md);
# a wrong step (a scale missing or applied twice, a gradient of the wrong operand) is off by O(1).
STEP_ERR_BOUND_FP8 = 1e-1
SP = P(None, "tp", None)  # [batch, seq, hidden], sequence split over tp
TP = P(None, None, "tp")  # [batch, seq, features], features split over tp


@dataclasses.dataclass(frozen=True)
class Shape:
    """One layer's sizes (global) and the run's tp."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    seq: int
    batch: int
    tp: int
    preset: str | None = None

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def problem(self) -> str | None:
        """Why the layer cannot run at this tp (None: it can)."""
        t = self.tp
        if self.heads % self.kv_heads:
            return f"--heads ({self.heads}) must be a multiple of --kv-heads ({self.kv_heads})"
        for what, v in (("--heads", self.heads), ("--kv-heads", self.kv_heads), ("--ffn", self.ffn)):
            if v % t:
                return f"{what} ({v}) must be divisible by --tp ({t}): each rank holds whole units"
        if self.seq % t:
            return f"--seq ({self.seq}) must be divisible by --tp ({t}) (the sequence is split over tp)"
        if self.head_dim % 2:
            return f"--head-dim ({self.head_dim}) must be even (RoPE rotates pairs)"
        return None


def shape_of(a: argparse.Namespace) -> Shape:
    """The shape of ``a``: each of :data:`SHAPE_KEYS` as given, else ``--preset``'s (default 8b)."""
    base = PRESETS[a.preset or "8b"]
    sizes = {k: getattr(a, k) if getattr(a, k) is not None else base[k] for k in SHAPE_KEYS}
    return Shape(**sizes, seq=a.seq, batch=a.batch, tp=a.tp, preset=a.preset)


# ------------------------------------------------------------------------------------------------
# What a step computes, and what part of the communication it hid


def stem_tag(s: Shape, fp8: bool = False) -> str:
    """The file-name tag of ``s``: ``layer-<preset>``, or ``layer-h<hidden>-f<ffn>`` where a size
    differs from the preset's (see the module doc); ``-fp8`` appended for an ``--fp8`` run."""
    name = s.preset or "8b"
    if all(getattr(s, k) == PRESETS[name][k] for k in SHAPE_KEYS):
        tag = f"layer-{name}"
    else:
        tag = f"layer-h{s.hidden}-f{s.ffn}"
    return tag + ("-fp8" if fp8 else "")


def model_flops(s: Shape) -> int:
    """Model FLOPs of one step (forward and backward, global, recomputation not counted):
    ``3 * forward`` (:func:`jax_ub.models.llama.layer_flops`), forward = the GEMMs ``2 * tokens *
    hidden * ((heads + 2*kv_heads) * head_dim + heads * head_dim + 3 * ffn)`` (QKV, output, gated
    up and down projections) + causal attention ``2 * batch * seq**2 * heads * head_dim`` (QKᵀ and
    PV, ``4 * batch * seq**2 * heads * head_dim``, halved by the causal mask)."""
    return round(3 * llama.layer_flops(config(s, jnp.bfloat16, "xla", None), s.batch, s.seq))


def peak_tflops(device_kind: str, dtype: str) -> float | None:
    """Dense peak TFLOP/s of one GPU of that kind in that dtype (:data:`PEAK_TFLOPS`), or None."""
    return PEAK_TFLOPS.get(device_kind, {}).get(dtype)


def hidden_fraction(ms: dict[str, float], tp: int) -> tuple[float | None, str]:
    """``(E, "")`` with ``E = (T_xla - T_jax_ub) / (T_xla - T_no_comm)``, the part of the
    communication that XLA's step leaves exposed which jax_ub's hides (1: jax_ub at the floor; 0:
    at XLA's time; < 0: slower than XLA), from the times ``ms`` of impls ``xla``, ``jax_ub``,
    ``no_comm``; or ``(None, why)`` where it is undefined."""
    if tp == 1:
        return None, "tp=1: the step has no communication to hide"
    missing = [k for k in ("xla", "jax_ub", "no_comm") if k not in ms]
    if missing:
        return None, f"no time for {', '.join(missing)}"
    exposed = ms["xla"] - ms["no_comm"]
    if not exposed > 0:
        return None, (
            f"XLA's step exposes no communication to hide: T_xla {ms['xla']} ms <= T_no_comm "
            f"{ms['no_comm']} ms"
        )
    return (ms["xla"] - ms["jax_ub"]) / exposed, ""


def throughput(s: Shape, ms: float, peak: float | None) -> dict[str, Any]:
    """The record's ``tokens_per_s``, ``model_flops``, ``tflops``, ``peak_tflops``, ``mfu``."""
    flops = model_flops(s)
    tflops = flops / (ms * 1e-3) / 1e12
    return {
        "tokens_per_s": round(s.tokens / (ms * 1e-3), 1),
        "model_flops": flops,
        "tflops": round(tflops, 3),
        "peak_tflops": peak,
        "mfu": None if peak is None else round(tflops / (s.tp * peak), 4),
    }


# ------------------------------------------------------------------------------------------------
# The layer: jax_ub.models.llama.LlamaLayer, and the same math for jit's SPMD partitioner (xla_cm)


def config(s: Shape, dtype: Any, method: str, mesh: Any, fp8: Any = None) -> Any:
    """The :class:`jax_ub.models.llama.LlamaConfig` of one layer of ``s`` (parameters and compute
    in ``dtype``, no remat inside: the step applies it; ``fp8``: every projection's recipe)."""
    return llama.preset(
        s.preset or "8b",
        hidden=s.hidden,
        num_heads=s.heads,
        num_kv_heads=s.kv_heads,
        head_dim=s.head_dim,
        ffn=s.ffn,
        num_layers=1,
        dtype=dtype,
        param_dtype=dtype,
        method=method,
        mesh=mesh,
        fp8=fp8,
    )


def spmd_forward(layer: Any, x: jax.Array, mesh: Any) -> jax.Array:
    """``layer(x)`` (a :class:`jax_ub.models.llama.LlamaLayer`) computed on global arrays with
    sharding constraints on the same layouts instead of the layers' ``shard_map``: XLA decomposes
    only the collectives its partitioner creates, so its collective-matmul flags would not touch
    the layers' own. The attention runs per device on its heads, as in the layer."""
    from jax_ub.layers import core, qkv

    cfg = layer.cfg
    tp = mesh.shape["tp"]

    def dense(h: jax.Array, kernel: Any, spec: P) -> jax.Array:
        y = jnp.matmul(h, kernel[...].astype(cfg.dtype))
        return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, spec))

    def heads(t: jax.Array) -> jax.Array:
        q, k, v = qkv.split_local(t, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, tp)
        return llama.attention(q, k, v, None, theta=cfg.rope_theta, implementation=cfg.attention_impl)

    x = jax.lax.with_sharding_constraint(x.astype(cfg.dtype), NamedSharding(mesh, SP))
    h = core.rms_norm(x, layer.input_norm.scale[...], epsilon=cfg.norm_eps, dtype=cfg.dtype)
    t = dense(h, layer.attn.qkv.kernel, TP)
    ctx = jax.shard_map(heads, mesh=mesh, in_specs=TP, out_specs=TP)(t)
    x = x + dense(ctx, layer.attn.o.kernel, SP)
    h = core.rms_norm(x, layer.mlp.norm.scale[...], epsilon=cfg.norm_eps, dtype=cfg.dtype)
    g = core.glu(dense(h, layer.mlp.up.kernel, TP), jax.nn.silu)
    return x + dense(g, layer.mlp.down.kernel, SP)


# ------------------------------------------------------------------------------------------------
# Impls


def build(
    s: Shape, mesh: Any, dtype_name: str, remat: str, only: tuple[str, ...], fp8: Any = None
) -> dict[str, step.Thunk]:
    """``{impl: thunk}`` of the impls in ``only`` (in that order), each returning ``(step, (params,
    x))`` for :func:`jax_ub.bench.harness.time_impls`; ``fp8``: the layers' recipe (``xla_cm`` has
    none). Call after ``jax_ub.initialize``."""
    from flax import nnx

    dtype = jnp.dtype(dtype_name)
    base, ub_policy = step.policies(remat)
    policy = {"jax_ub": ub_policy, "no_comm": ub_policy, "xla": base, "xla_cm": base}

    def make(method: str) -> Any:
        return llama.LlamaLayer(config(s, dtype, method, mesh, fp8), rngs=nnx.Rngs(0))

    graphdef = {m: nnx.graphdef(nnx.eval_shape(lambda m=m: make(m))) for m in ("auto", "xla")}
    params = jax.jit(lambda: nnx.state(make("auto")))()  # one program, created sharded
    x = h.rand(jax.random.key(1), (s.batch, s.seq, s.hidden), dtype, NamedSharding(mesh, SP))
    forwards: dict[str, Callable[[Any, jax.Array], jax.Array]] = {
        "jax_ub": lambda p, x: nnx.merge(graphdef["auto"], p)(x),
        "xla": lambda p, x: nnx.merge(graphdef["xla"], p)(x),
        "xla_cm": lambda p, x: spmd_forward(nnx.merge(graphdef["xla"], p), x, mesh),
        "no_comm": lambda p, x: llama.forward_no_comm(nnx.merge(graphdef["auto"], p), x),
    }

    def thunk(impl: str) -> step.Thunk:
        return lambda: (jax.jit(step.train_step(forwards[impl], policy[impl])), (params, x))

    return {impl: thunk(impl) for impl in only}


class StepCheck:
    """A ``probe`` for :func:`jax_ub.bench.harness.time_impls`: keeps ``(loss, |dx|)`` per impl
    (:func:`jax_ub.bench.step.check`) and holds ``jax_ub``'s step to ``xla``'s (the largest
    relative error over the step's outputs, :data:`STEP_ERR_BOUND`, with ``fp8``
    :data:`STEP_ERR_BOUND_FP8`; ``no_comm`` computes another function and is not compared). Returns
    the error, or None."""

    def __init__(self, dtype: str, fp8: bool = False):
        self.bound = STEP_ERR_BOUND_FP8 if fp8 else STEP_ERR_BOUND[dtype]
        self.checks: dict[str, tuple[float, float]] = {}
        self.ref: Any = None

    def __call__(self, name: str, out: Any) -> float | None:
        self.checks[name] = step.check(name, out)
        if name == "xla":
            self.ref = out
            return None
        if name != "jax_ub" or self.ref is None:
            return None
        err = h.rel_err(out, self.ref)
        if not err <= self.bound:
            raise h.WrongOutput(f"step differs from xla's: relative error {err:.3g} (bound {self.bound:g})")
        return err


def _float8(v: Any) -> bool:
    from jax_ub import fp8

    return fp8.is_fp8(getattr(getattr(v, "aval", None), "dtype", None))


def _fp8_gemms_in(jaxpr: Any) -> bool:
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if (name == "dot_general" or "ffi" in name or "custom_call" in name) and any(
            _float8(v) for v in eqn.invars
        ):
            return True
        for p in eqn.params.values():
            for sub in p if isinstance(p, (list, tuple)) else (p,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns") and _fp8_gemms_in(inner):
                    return True
    return False


def fp8_gemms(thunk: step.Thunk) -> bool:
    """Whether the step of ``thunk`` (traced, not run) holds an FP8 GEMM: a ``dot_general`` or a
    custom call (jax_ub's) with a float8 operand. The float32 dot of dequantized operands is none."""
    fn, args = thunk()
    return _fp8_gemms_in(jax.make_jaxpr(fn)(*args).jaxpr)


def recipe_fields(recipe: Any) -> dict[str, Any]:
    """The records' ``fp8`` and ``fp8_recipe`` (its dtypes, by name) of a run's recipe (or None)."""
    if recipe is None:
        return {"fp8": False}
    names = {
        f: (None if getattr(recipe, f) is None else getattr(recipe, f).name)
        for f in ("fwd_dtype", "bwd_dtype", "out_dtype")
    }
    return {"fp8": True, "fp8_recipe": {**names, "fwd_fast_accum": recipe.fwd_fast_accum}}


def scalar_err(a: tuple[float, float], b: tuple[float, float]) -> float:
    """The larger relative difference of two ``(loss, |dx|)`` checks."""
    return max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b, strict=True))


# ------------------------------------------------------------------------------------------------
# xla_cm: a subprocess with XLA_FLAGS


def xla_cm_reason(a: argparse.Namespace, cuda: bool) -> str:
    """Why ``xla_cm`` is skipped in this run ("" where it runs)."""
    if a.xla_cm == "off":
        return "--xla-cm off"
    if getattr(a, "fp8", False):
        return (
            "--fp8: the jit-partitioned layer (spmd_forward) has no FP8 recipe (its dense is "
            "jnp.matmul; the recipe's quantization and FP8 backward live in jax_ub's ops)"
        )
    if a.xla_cm == "on":
        return ""
    if not cuda:
        return "off the CUDA path (XLA's collective-matmul flags are GPU flags; --xla-cm on runs it anyway)"
    if a.tp == 1:
        return "tp=1: no collective for the flags to decompose (--xla-cm on runs it anyway)"
    return ""


def xla_flags(existing: str) -> str:
    own = [f"--{k}={str(v).lower()}" for k, v in XLA_CM_FLAGS.items()]
    return " ".join([*existing.split(), *own])


def child_argv(a: argparse.Namespace, s: Shape, result: str) -> list[str]:
    """The command line of the ``xla_cm`` subprocess: this run's shape and timing, writing
    ``result``."""
    argv = [sys.executable, "-m", "jax_ub.bench", "layer", "--xla-cm-child", result]
    for k in SHAPE_KEYS:
        argv += [f"--{k.replace('_', '-')}", str(getattr(s, k))]
    argv += ["--seq", str(s.seq), "--batch", str(s.batch), "--tp", str(s.tp), "--dtype", a.dtype]
    argv += ["--remat", *a.remat, "--warmup", str(a.warmup), "--iters", str(a.iters)]
    argv += ["--reps", str(a.reps), "--settle-ms", str(a.settle_ms), "--machine", a.machine]
    return argv


def run_xla_cm(a: argparse.Namespace, s: Shape, stem: str) -> tuple[dict[str, dict], str]:
    """Times ``xla_cm`` at every ``--remat`` in a subprocess started with :data:`XLA_CM_FLAGS` in
    ``XLA_FLAGS``: ``({remat: {"ms", "ms_min", "ms_max", "check"} or {"error"}}, "")``, or ``({},
    why)`` when the subprocess failed."""
    result = f"{stem}-xla_cm.{os.getpid()}.json"
    env = dict(os.environ, XLA_FLAGS=xla_flags(os.environ.get("XLA_FLAGS", "")))
    h.progress(f"xla_cm: a subprocess with XLA_FLAGS={env['XLA_FLAGS']}")
    try:
        # its progress lines and errors go to this process's stderr
        proc = subprocess.run(
            child_argv(a, s, result), env=env, timeout=a.xla_cm_timeout, stdout=subprocess.PIPE
        )
        if proc.returncode != 0:
            return {}, f"the subprocess exited with status {proc.returncode} (its lines above say why)"
        with open(result) as f:
            return json.load(f), ""
    except subprocess.TimeoutExpired:
        return {}, f"the subprocess ran past --xla-cm-timeout {a.xla_cm_timeout} s"
    except (OSError, ValueError) as e:
        return {}, f"{type(e).__name__}: {e}"
    finally:
        if os.path.exists(result):
            os.unlink(result)


def child(a: argparse.Namespace) -> int:
    """The ``xla_cm`` subprocess: times only ``xla_cm`` per ``--remat``, writes ``--xla-cm-child``."""
    s = shape_of(a)
    mesh = h.make_mesh(s.tp, False)  # no jax_ub communicators: XLA alone
    out: dict[str, dict] = {}
    for remat in a.remat:
        checks: dict[str, Any] = {}
        try:
            res = h.time_impls(
                f"xla_cm remat={remat}", build(s, mesh, a.dtype, remat, ("xla_cm",)), a, step.check, checks
            )
        except Exception as e:
            out[remat] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            continue
        if "xla_cm" not in res:
            out[remat] = {"error": "xla_cm failed (the [bench] lines above say why)"}
            continue
        lo, hi = res.spread["xla_cm"]
        out[remat] = {"ms": res["xla_cm"], "ms_min": lo, "ms_max": hi, "check": checks["xla_cm"]}
    h.write_doc(a.xla_cm_child, out)
    return 0


# ------------------------------------------------------------------------------------------------
# The trace of jax_ub's step


def write_trace(a: argparse.Namespace, s: Shape, stem: str, entry: Any, cuda: bool, path_line: str) -> str:
    """``<stem>-trace.json``: jax_ub's step traced (:func:`jax_ub.bench.harness.capture_timeline`)
    as a Chrome/Perfetto trace; a file with a note where there is no CUDA timeline. ``entry``:
    ``(step, args)``. Returns the line that says what was written."""
    from jax_ub.bench import timeline

    title = f"jax_ub layer step tp={s.tp} seq={s.seq} batch={s.batch} {a.dtype} remat={a.remat[0]}"
    records: list[dict] = []
    if not cuda:
        note = "no CUDA timeline: the step ran on the XLA reference path (no jax_ub CUDA op)"
    elif s.tp == 1:
        note = "no CUDA timeline: at tp=1 the step runs no jax_ub op (nothing to communicate)"
    else:
        got, why = h.capture_timeline(*entry)
        records = got or []
        note = why if got is None else ""
        if got is not None and not got:
            note = "the step ran no jax_ub CUDA op (at tp=1, or where auto runs XLA's path, nothing overlaps)"
    path = f"{stem}-trace.json"
    h.write_doc(path, timeline.chrome_trace(records, title=title, note=note))
    ops = len({(r.get("device"), r.get("epoch")) for r in records})
    return f"trace: {path}: {ops} op spans, {len(records)} chunk spans" + (f" ({note})" if note else "")


def write_profile(stem: str, entry: Any, calls: int = 3) -> str:
    """A ``jax.profiler`` trace (with a Perfetto JSON) of ``calls`` jax_ub steps in ``<stem>-profile``."""
    fn, args = entry
    jax.block_until_ready(fn(*args))  # compiled before the trace starts
    folder = f"{stem}-profile"
    try:
        with jax.profiler.trace(folder, create_perfetto_trace=True):
            jax.block_until_ready([fn(*args) for _ in range(calls)])
    except Exception as e:
        return f"profile: failed: {type(e).__name__}: {str(e)[:300]}"
    return f"profile: {folder} (jax.profiler, {calls} steps)"


# ------------------------------------------------------------------------------------------------
# The runner of the subcommand


def run(a: argparse.Namespace) -> int:
    import jax_ub

    s = shape_of(a)
    if a.xla_cm_child:
        return child(a)
    recipe = jax_ub.FP8Recipe() if a.fp8 else None
    problem = s.problem()
    if problem is None and s.tp > len(jax.devices()):
        problem = f"--tp {s.tp} needs {s.tp} devices; found {len(jax.devices())}"
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    cuda, path = h.path_info()
    print(path)
    kind = jax.devices()[0].device_kind
    peak = peak_tflops(kind, a.dtype) if cuda else None
    if peak is None:
        print(f"mfu: null: no peak TFLOP/s known for {kind!r} in {a.dtype}")
    stem = h.out_stem(a, stem_tag(s, a.fp8))
    skip = xla_cm_reason(a, cuda)
    cm: dict[str, dict] | None = None  # None: xla_cm skipped; else the subprocess's results
    if skip:
        print(f"xla_cm: skipped: {skip}")
    else:  # first, while this process leaves the devices idle
        cm, failed = run_xla_cm(a, s, stem)
        if failed:
            h.progress(f"xla_cm failed: {failed}")
            cm = {remat: {"error": failed} for remat in a.remat}
    out = h.Results(a, stem, path)
    rows: list[tuple[str, dict[str, float], float | None, str]] = []
    mesh = None
    kept: dict[str, Any] = {}  # jax_ub's compiled step and args of the first case: traced last
    try:
        for remat in a.remat:
            common = {"op": "layer", "preset": s.preset, **{k: getattr(s, k) for k in SHAPE_KEYS}}
            common |= {"seq": s.seq, "batch": s.batch, "tokens": s.tokens, "tp": s.tp, "dtype": a.dtype}
            common |= {"remat": remat, **recipe_fields(recipe)}
            if skip:
                common["skipped"] = {"xla_cm": skip}
            label = (
                f"layer tp={s.tp} hidden={s.hidden} heads={s.heads}/{s.kv_heads}x{s.head_dim} "
                f"ffn={s.ffn} seq={s.seq} batch={s.batch} {a.dtype}{' fp8' if a.fp8 else ''} remat={remat}"
            )
            with out.case(common, label, shutdown=False) as c:
                if mesh is None:
                    mesh = h.make_mesh(s.tp, cuda)
                impls = build(s, mesh, a.dtype, remat, ("xla", "jax_ub", "no_comm"), recipe)
                if recipe is not None:  # what each step's program multiplies in
                    ran = {impl: fp8_gemms(t) for impl, t in impls.items()}
                    c.extra = {impl: {"fp8_gemms": v} for impl, v in ran.items()}
                    print("FP8 GEMMs in the step: " + ", ".join(f"{k} {v}" for k, v in ran.items()))
                if not kept:
                    impls["jax_ub"] = _kept(impls["jax_ub"], kept)
                probe, errs = StepCheck(a.dtype, a.fp8), dict[str, Any]()
                c.res = h.time_impls(label, impls, a, probe=probe, probes=errs, failures=out.failures)
                c.rel_err = {k: v for k, v in errs.items() if v is not None}
                if cm is not None:
                    got = cm.get(remat, {"error": "the subprocess gave no result"})
                    _add_xla_cm(c, got, probe, label, out.failures)
                print(step.check_line(f"remat={remat}", probe.checks))
                ms = {k: round(v, 4) for k, v in c.res.items()}  # as the records say
                e, why = hidden_fraction(ms, s.tp)
                c.extra = {
                    impl: {**c.extra.get(impl, {}), **throughput(s, t, peak)} for impl, t in ms.items()
                }
                if "jax_ub" in c.extra:
                    c.extra["jax_ub"]["E"] = None if e is None else round(e, 4)
                    if why:
                        c.extra["jax_ub"]["E_why"] = why
                rows.append((remat, ms, e, why))
        stop = out.finish()  # records and chart first: the trace and profile come last
        if stop is not None:
            return stop
        png = h.plot(
            out.records,
            stem + ".png",
            f"jax_ub layer fwd+bwd ({os.path.basename(stem)}, {a.dtype}{', fp8' if a.fp8 else ''}): "
            "ms per step",
            IMPLS,
            lambda r: f"tp{r['tp']} h{r['hidden']} s{r['seq']}x{r['batch']}\nremat {r['remat']}",
        )
        h.wrote(stem, png)
        _table(s, a, path, rows, peak)
        print(_trace(a, s, stem, kept, cuda, path), flush=True)
    finally:
        jax_ub.shutdown()
    return 0


def _kept(thunk: step.Thunk, kept: dict[str, Any]) -> step.Thunk:
    """``thunk``, keeping what it returns in ``kept["entry"]`` (the trace reuses the compiled step)."""

    def entry() -> tuple[Callable[..., Any], tuple[Any, ...]]:
        kept["entry"] = thunk()
        return kept["entry"]

    return entry


def _add_xla_cm(c: h.Case, got: dict, probe: StepCheck, label: str, failures: list[tuple[str, str]]) -> None:
    """The subprocess's ``xla_cm`` result (:func:`run_xla_cm`) into the case: its time where it ran
    and its check matches xla's, else a failure."""
    if "error" in got:
        h.progress(f"  xla_cm failed: {got['error']}")
        failures.append(("xla_cm", f"{label}: {got['error']}"))
        return
    check = (float(got["check"][0]), float(got["check"][1]))
    probe.checks["xla_cm"] = check
    extra: dict[str, Any] = {}
    if "xla" in probe.checks:
        err = scalar_err(check, probe.checks["xla"])
        if not err <= probe.bound:
            why = f"(loss, |dx|) {check} differs from xla's {probe.checks['xla']} ({err:.3g})"
            h.progress(f"  xla_cm: wrong output: {why}")
            failures.append(("xla_cm", f"{label}: wrong output: {why}"))
            return
        extra["check_rel_err"] = float(f"{err:.3g}")
    res = c.res if isinstance(c.res, h.Times) else h.Times(c.res)
    res["xla_cm"] = float(got["ms"])
    res.chain["xla_cm"] = 1
    res.spread["xla_cm"] = (float(got["ms_min"]), float(got["ms_max"]))
    c.res = res
    c.extra["xla_cm"] = extra


def _trace(a: argparse.Namespace, s: Shape, stem: str, kept: dict[str, Any], cuda: bool, path: str) -> str:
    """The trace file (and ``--profile``'s) of jax_ub's step; the lines that say what was written."""
    entry = kept.get("entry")
    if entry is None:
        return "trace: none: jax_ub's step was not built"
    lines = [write_trace(a, s, stem, entry, cuda, path)]
    if a.profile:
        lines.append(write_profile(stem, entry))
    return "\n".join(lines)


def _table(s: Shape, a: argparse.Namespace, path: str, rows: list, peak: float | None) -> None:
    print(f"{path}\nlayer tp={s.tp} hidden={s.hidden} heads={s.heads}/{s.kv_heads}x{s.head_dim} ffn={s.ffn}")
    fp8 = " fp8 (jax_ub.FP8Recipe())" if a.fp8 else ""
    print(f"seq={s.seq} batch={s.batch} {a.dtype}{fp8}; model TFLOP per step {model_flops(s) / 1e12:.3f}")
    print("remat          xla    xla_cm    jax_ub   no_comm  speedup  jax_ub tok/s  mfu     E")
    for remat, ms, e, why in rows:
        g = lambda k, ms=ms: ms.get(k, math.nan)  # noqa: E731
        ub = g("jax_ub")
        tok = s.tokens / (ub * 1e-3) if ub == ub else math.nan
        mfu = (
            "n/a"
            if peak is None or ub != ub
            else f"{model_flops(s) / (ub * 1e-3) / 1e12 / (s.tp * peak):.3f}"
        )
        es = f"{e:.2f}" if e is not None else f"n/a ({why})"
        print(
            f"{remat:<13} {g('xla'):8.3f} {g('xla_cm'):8.3f} {ub:9.3f} {g('no_comm'):9.3f} "
            f"{g('xla') / ub:7.2f}x {tok:13.0f}  {mfu:<6}  {es}"
        )
