"""A Llama-style decoder built from jax_ub's tensor-/sequence-parallel layers (Flax NNX).

Public names (stable):

* :class:`LlamaConfig` — the sizes and options; :data:`PRESETS` (``"8b"``, ``"70b"``, ``"tiny"``)
  and :func:`preset` for 8B- and 70B-class layers.
* :class:`LlamaAttention` — fused QKV (:class:`jax_ub.nn.QKVParallelDense`, AG→GEMM), RoPE,
  causal grouped-query attention through :func:`jax.nn.dot_product_attention`, output projection
  (:class:`jax_ub.nn.RowParallelDense`, GEMM→RS).
* :class:`LlamaLayer` — ``h = x + attn(rms_norm(x))``, ``h + mlp(h)`` with the SwiGLU
  :class:`jax_ub.nn.ParallelMLP` (``norm="rmsnorm"``, gated, silu, no biases).
* :class:`LlamaStack` — ``num_layers`` layers stacked on a leading axis (``nnx.vmap``), run with
  ``nnx.scan`` under ``nnx.remat`` (``LlamaConfig.remat``: :func:`remat_policy`).
* :class:`LlamaModel` — token embedding, the stack, a final RMSNorm and the output projection
  (``lm_head``, not tied to the embedding, as Llama 3's): logits `[batch, seq, vocab]`.
* :func:`rope` — rotary position embedding, Hugging Face's rotate-half convention.
* :func:`attention` — RoPE and causal GQA on one device's heads (local arrays).
* :func:`forward_no_comm` — a layer's (or any module's) forward with every collective of jax_ub's
  layers replaced by a local stand-in of the same shapes running the same GEMM kernels
  (:func:`jax_ub.gemm.matmul`): the ``no_comm`` floor of a benchmark.
* :func:`layer_flops` — the model FLOPs of one layer's forward (×3 for a training step).
* :func:`from_hf_layer` — one Hugging Face ``LlamaDecoderLayer``'s weights → a
  :class:`LlamaLayer`'s parameters (``nnx.to_pure_dict`` form) for a given ``tp``.

Layouts: activations `[batch, seq, hidden]` on global arrays, the sequence split over the TP axis
between the layers (sequence parallelism), the batch over the mesh's other axes where it divides.
Inside the attention each device holds ``num_heads/tp`` query heads and ``num_kv_heads/tp``
key/value heads of the whole sequence. Use under ``jax.set_mesh(mesh)`` (or with
``LlamaConfig.mesh``), as the layers.

RoPE: Hugging Face's ``LlamaRotaryEmbedding`` without the Llama 3.1 frequency scaling: pairs ``(i,
i + head_dim/2)`` rotated by ``position * theta ** (-2i / head_dim)`` (``rotate_half``), so
weights from a Hugging Face checkpoint load through :mod:`jax_ub.layers.convert` unpermuted.

Attention: :func:`jax.nn.dot_product_attention` with ``is_causal=True`` and
``implementation=None``: jax picks cuDNN's fused attention on a GPU where it supports the call
(bf16/fp16, head_dim a supported size), else its XLA implementation (always on CPU).
``LlamaConfig.attention_impl`` forces one (``"cudnn"`` fails where cuDNN cannot run it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal, cast

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jax_ub import nn as ubnn
from jax_ub import ops
from jax_ub.layers import activation, convert, core
from jax_ub.layers import mesh as _mesh

__all__ = [
    "PRESETS",
    "LlamaAttention",
    "LlamaConfig",
    "LlamaLayer",
    "LlamaModel",
    "LlamaStack",
    "attention",
    "forward_no_comm",
    "from_hf_layer",
    "layer_flops",
    "preset",
    "remat_policy",
    "rope",
]

Array = jax.Array

REMAT = ("none", "dots", "names", "full")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Sizes and options of a Llama-style decoder.

    ``hidden``, ``num_heads``, ``num_kv_heads``, ``head_dim``, ``ffn``: the layer's sizes (``tp``
    must divide ``num_heads``, ``num_kv_heads``, ``ffn`` and the sequence length);
    ``num_layers`` and ``vocab`` for :class:`LlamaStack` / :class:`LlamaModel`; ``rope_theta``;
    ``norm_eps`` (RMSNorm's epsilon); ``dtype`` (compute) and ``param_dtype`` (master weights);
    ``method`` (jax_ub's, ``"xla"`` for the reference) and ``fp8`` (a :class:`jax_ub.FP8Recipe` or
    ``None``) for every projection; ``remat``: ``"none"``, ``"dots"``
    (``jax_ub.checkpoint_policy(dots_saveable)``), ``"names"`` (``jax_ub.checkpoint_policy()``:
    only jax_ub's op outputs) or ``"full"`` (nothing saved), applied per layer by
    :class:`LlamaStack`; ``attention_impl`` for :func:`jax.nn.dot_product_attention` (``None``:
    jax chooses); ``axis_name``, ``mesh`` and ``batch_axes`` (the mesh axes of the batch, see
    docs/layers.md) as the layers'.
    """

    hidden: int = 4096
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    ffn: int = 14336
    num_layers: int = 32
    vocab: int = 128256
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    dtype: Any = jnp.bfloat16
    param_dtype: Any = jnp.float32
    method: str | None = None
    fp8: Any = None
    remat: str = "none"
    attention_impl: str | None = None
    axis_name: str = "tp"
    mesh: Any = None
    batch_axes: Any = "auto"

    def __post_init__(self) -> None:
        for name in ("hidden", "num_heads", "num_kv_heads", "head_dim", "ffn", "num_layers", "vocab"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LlamaConfig: `{name}` must be a positive int; got {value!r}.")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"LlamaConfig: `num_heads` must be a multiple of `num_kv_heads`; got "
                f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}."
            )
        if self.head_dim % 2:
            raise ValueError(
                f"LlamaConfig: `head_dim` must be even (RoPE rotates pairs); got {self.head_dim}."
            )
        if self.remat not in REMAT:
            raise ValueError(f"LlamaConfig: `remat` must be one of {REMAT}; got {self.remat!r}.")
        if self.attention_impl not in (None, "xla", "cudnn"):
            raise ValueError(
                f"LlamaConfig: `attention_impl` must be None, 'xla' or 'cudnn'; got {self.attention_impl!r}."
            )

    def replace(self, **changes: Any) -> LlamaConfig:
        return dataclasses.replace(self, **changes)


PRESETS: dict[str, dict[str, Any]] = {
    # Llama 3 8B: 32 layers, vocab 128256, rope theta 5e5, eps 1e-5.
    "8b": dict(hidden=4096, num_heads=32, num_kv_heads=8, head_dim=128, ffn=14336, num_layers=32),
    # Llama 3 70B: 80 layers.
    "70b": dict(hidden=8192, num_heads=64, num_kv_heads=8, head_dim=128, ffn=28672, num_layers=80),
    # A CPU-sized model of the same shape family (tests, the example on CPU).
    "tiny": dict(
        hidden=64, num_heads=8, num_kv_heads=4, head_dim=8, ffn=128, num_layers=2, vocab=64, rope_theta=1e4
    ),
}


def preset(name: str, **overrides: Any) -> LlamaConfig:
    """``LlamaConfig`` of a :data:`PRESETS` entry, with ``overrides`` (e.g. ``num_layers=1``)."""
    if name not in PRESETS:
        raise ValueError(f"preset: unknown preset {name!r}; known: {sorted(PRESETS)}.")
    return LlamaConfig(**{**PRESETS[name], **overrides})


def remat_policy(name: str) -> Callable[..., bool] | None:
    """The ``jax.checkpoint`` policy of ``LlamaConfig.remat`` (``None`` for ``"none"``: no remat)."""
    if name == "none":
        return None
    if name == "dots":
        return ops.checkpoint_policy(jax.checkpoint_policies.dots_saveable)
    if name == "names":
        return ops.checkpoint_policy()
    if name == "full":
        return jax.checkpoint_policies.nothing_saveable
    raise ValueError(f"remat_policy: must be one of {REMAT}; got {name!r}.")


# --------------------------------------------------------------------------------------------------
# RoPE and attention on one device's heads
# --------------------------------------------------------------------------------------------------


def rope(x: Array, positions: Array, theta: float) -> Array:
    """Rotary embedding of x `[batch, seq, heads, head_dim]` at ``positions`` `[batch, seq]` (or
    `[seq]`), Hugging Face's rotate-half convention, computed in float32, returned in x's dtype."""
    hd = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))  # [hd/2]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., seq, hd/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[..., None, :]  # [..., seq, 1, hd]
    if angles.ndim < x.ndim:
        angles = angles.reshape((1,) * (x.ndim - angles.ndim) + angles.shape)
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : hd // 2], xf[..., hd // 2 :]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (xf * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)


def attention(
    q: Array, k: Array, v: Array, positions: Array | None, *, theta: float, implementation: str | None = None
) -> Array:
    """RoPE on q and k, then causal attention: q `[b, s, n, h]`, k and v `[b, s, n_kv, h]` (``n``
    a multiple of ``n_kv``; query head ``i`` attends with key/value head ``i // (n / n_kv)``) →
    `[b, s, n * h]`. ``positions`` `[b, s]` or ``None`` (``0 .. s-1``)."""
    b, s = q.shape[:2]
    if positions is None:
        positions = jnp.arange(s)
    q, k = rope(q, positions, theta), rope(k, positions, theta)
    impl = cast(Literal["xla", "cudnn"] | None, implementation)  # checked by LlamaConfig
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
    return out.reshape(b, s, -1)


# --------------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------------


def _common(cfg: LlamaConfig) -> dict[str, Any]:
    return dict(
        dtype=cfg.dtype,
        param_dtype=cfg.param_dtype,
        method=cfg.method,
        fp8=cfg.fp8,
        axis_name=cfg.axis_name,
        mesh=cfg.mesh,
        batch_axes=cfg.batch_axes,
    )


class LlamaAttention(nnx.Module):
    """Grouped-query self-attention: ``o(attention(rope(qkv(x))))``, x `[batch, seq, hidden]`
    (sequence split over the TP axis) → the same. Parameters: ``qkv.kernel`` `[hidden, (heads + 2
    kv_heads) * head_dim]` (per-device layout of :mod:`jax_ub.layers.qkv`), ``o.kernel``
    `[heads * head_dim, hidden]`; no biases."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        common = _common(cfg)
        self.qkv = ubnn.QKVParallelDense(
            cfg.hidden, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, rngs=rngs, **common
        )
        self.o = ubnn.RowParallelDense(
            cfg.num_heads * cfg.head_dim, cfg.hidden, use_bias=False, rngs=rngs, **common
        )

    def __call__(self, x: Array, positions: Array | None = None) -> Array:
        cfg = self.cfg
        q, k, v = self.qkv(x)

        def body(q: Array, k: Array, v: Array, positions: Array | None) -> Array:
            return attention(q, k, v, positions, theta=cfg.rope_theta, implementation=cfg.attention_impl)

        where = "LlamaAttention"
        kernel = self.qkv.kernel[...]
        p = _mesh.placement(
            where, cfg.axis_name, cfg.mesh, (_mesh.array_mesh(kernel), self.qkv._mesh_at_build)
        )
        if p.local:
            return self.o(body(q, k, v, positions))
        b = activation.batch_entry(where, x, p.mesh, cfg.axis_name, 0, cfg.batch_axes)
        heads = P(b, None, cfg.axis_name, None)
        ctx = core._shard_map(
            body, p.mesh, (q, k, v, positions), (heads, heads, heads, P(b, None)), P(b, None, cfg.axis_name)
        )
        return self.o(ctx)


class LlamaLayer(nnx.Module):
    """One decoder layer: ``h = x + attn(input_norm(x))``, ``h + mlp(h)``; x `[batch, seq,
    hidden]` (global arrays under a mesh: the sequence split over the TP axis; or local shards
    inside ``shard_map``). ``mlp`` is the gated :class:`jax_ub.nn.ParallelMLP` with its RMSNorm
    (Hugging Face's ``post_attention_layernorm``) as ``mlp.norm``."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.input_norm = ubnn.RMSNorm(
            cfg.hidden,
            epsilon=cfg.norm_eps,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            axis_name=cfg.axis_name,
            mesh=cfg.mesh,
            rngs=rngs,
        )
        self.attn = LlamaAttention(cfg, rngs=rngs)
        self.mlp = ubnn.ParallelMLP(
            cfg.hidden,
            cfg.ffn,
            activation=jax.nn.silu,
            gated=True,
            use_bias=False,
            norm="rmsnorm",
            epsilon=cfg.norm_eps,
            rngs=rngs,
            **_common(cfg),
        )

    def __call__(self, x: Array, positions: Array | None = None) -> Array:
        x = x.astype(self.cfg.dtype)
        h = x + self.attn(self.input_norm(x), positions)
        return h + self.mlp(h)


class LlamaStack(nnx.Module):
    """``cfg.num_layers`` :class:`LlamaLayer` s, their parameters stacked on a leading axis (not
    sharded), applied with ``nnx.scan``, each under ``nnx.remat`` with :func:`remat_policy`
    (``cfg.remat``)."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
        def create(rngs: nnx.Rngs) -> LlamaLayer:
            return LlamaLayer(cfg, rngs=rngs)

        self.layers = create(rngs)

    def __call__(self, x: Array, positions: Array | None = None) -> Array:
        policy = remat_policy(self.cfg.remat)

        def one(layer: LlamaLayer, x: Array) -> Array:
            return layer(x, positions)

        if policy is not None:
            one = nnx.remat(one, policy=policy)

        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry, transform_metadata={nnx.PARTITION_NAME: None})
        def step(layer: LlamaLayer, x: Array) -> Array:
            return one(layer, x)

        return step(self.layers, x)


class LlamaModel(nnx.Module):
    """Tokens `[batch, seq]` → logits `[batch, seq, vocab]` (float32): embedding, :class:`LlamaStack`,
    final RMSNorm, output projection ``lm_head`` `[hidden, vocab]` (plain XLA ops outside the
    stack, partitioned by XLA)."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(
            cfg.vocab,
            cfg.hidden,
            param_dtype=cfg.param_dtype,
            embedding_init=nnx.initializers.normal(1.0),
            rngs=rngs,
        )
        self.stack = LlamaStack(cfg, rngs=rngs)
        self.norm = ubnn.RMSNorm(
            cfg.hidden,
            epsilon=cfg.norm_eps,
            dtype=jnp.float32,
            param_dtype=cfg.param_dtype,
            axis_name=cfg.axis_name,
            mesh=cfg.mesh,
            rngs=rngs,
        )
        self.lm_head = nnx.Linear(
            cfg.hidden, cfg.vocab, use_bias=False, param_dtype=cfg.param_dtype, rngs=rngs
        )

    def __call__(self, tokens: Array, positions: Array | None = None) -> Array:
        x = self.embed(tokens).astype(self.cfg.dtype)
        x = self.stack(x, positions)
        return self.lm_head(self.norm(x))


# --------------------------------------------------------------------------------------------------
# The benchmark's floor, and FLOPs
# --------------------------------------------------------------------------------------------------


def forward_no_comm(module: Any, *args: Any, **kwargs: Any) -> Any:
    """``module(*args, **kwargs)`` with every collective of jax_ub's layers replaced by a local
    stand-in: each all-gather by ``tp`` local copies of the shard, each reduce-scatter by this
    device's rows of the local GEMM, each all-reduce by nothing, the GEMMs through
    :func:`jax_ub.gemm.matmul` (cuBLASLt on GPUs, the kernel jax_ub's ops run). Shapes are those of
    the real forward, the values are not (the floor of a benchmark, not a model).

    Call it where the forward is traced (inside the function given to ``jax.jit`` /
    ``jax.grad``), as ``module(...)`` would be called: in global mode (under the mesh) or inside
    ``shard_map``. What XLA partitions itself outside jax_ub's layers (the RMSNorm scale's
    gradient, a `[hidden]` all-reduce over the sequence shards) is not replaced. Where the layers
    have ``fp8=``, the stand-ins' GEMMs use the same recipe (:func:`jax_ub.ops.local_matmul`).
    """
    with core.comm_stand_ins():
        return module(*args, **kwargs)


def layer_flops(cfg: LlamaConfig, batch: int, seq: int, *, causal_half: bool = True) -> float:
    """Model FLOPs of one layer's forward over ``batch x seq`` tokens: the projections
    (``2 * tokens * in * out`` each: QKV, O, gate+up, down) and attention (``4 * batch * seq**2 *
    heads * head_dim``, halved for the causal mask with ``causal_half``). A training step
    (forward and backward, no remat) is 3x this."""
    tokens = batch * seq
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    proj = 2 * tokens * cfg.hidden * (qkv + cfg.num_heads * cfg.head_dim + 3 * cfg.ffn)
    attn = 4 * batch * seq * seq * cfg.num_heads * cfg.head_dim
    return float(proj + (attn / 2 if causal_half else attn))


HF_NAMES = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)


def from_hf_layer(weights: Any, cfg: LlamaConfig, tp: int) -> dict[str, Any]:
    """The parameters of a :class:`LlamaLayer` (the ``nnx.to_pure_dict`` tree of its
    ``nnx.Param`` state) from one Hugging Face ``LlamaDecoderLayer``'s weights, a mapping with the
    names of :data:`HF_NAMES` (the state dict's keys after ``model.layers.N.``; NumPy arrays stay
    on the host), for a TP axis of size ``tp`` (the QKV kernel's layout depends on it). Set them
    with ``nnx.update(layer, state)`` after ``state = nnx.state(layer, nnx.Param)`` and
    ``nnx.replace_by_pure_dict(state, params)``, or use them as the ``params`` of
    ``nnx.merge(graphdef, params)``."""
    missing = [n for n in HF_NAMES if n not in weights]
    if missing:
        raise ValueError(
            f"from_hf_layer: the weights must hold {list(HF_NAMES)}; missing {missing} "
            f"(given: {sorted(weights)[:12]})."
        )
    w = weights
    qkv = convert.pack_qkv(
        w["self_attn.q_proj.weight"],
        w["self_attn.k_proj.weight"],
        w["self_attn.v_proj.weight"],
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        tp=tp,
        layout="hf",
        bias=False,
    )
    up, down = convert.pack_mlp(
        w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"], w["mlp.down_proj.weight"], layout="hf"
    )
    return {
        "input_norm": {"scale": w["input_layernorm.weight"]},
        "attn": {"qkv": {"kernel": qkv}, "o": {"kernel": convert.pack_out(w["self_attn.o_proj.weight"])}},
        "mlp": {
            "norm": {"scale": w["post_attention_layernorm.weight"]},
            "up": {"kernel": up},
            "down": {"kernel": down},
        },
    }
