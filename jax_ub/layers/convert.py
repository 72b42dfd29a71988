"""Separate attention and MLP matrices ↔ the kernels of jax_ub's layers (exported as
:mod:`jax_ub.nn` and :mod:`jax_ub.linen` functions).

* :func:`pack_qkv` / :func:`unpack_qkv` — q, k, v ↔ the fused kernel (or bias) of
  :class:`~jax_ub.nn.QKVParallelDense` for a given ``tp`` (its per-device layout,
  :mod:`jax_ub.layers.qkv`);
* :func:`pack_mlp` / :func:`unpack_mlp` — gate, up (and down) ↔ the gated
  :class:`~jax_ub.nn.ParallelMLP`'s interleaved ``up`` kernel (and ``down`` kernel), the same for
  every ``tp``;
* :func:`pack_out` / :func:`unpack_out` — the attention output projection ↔ the
  :class:`~jax_ub.nn.RowParallelDense` kernel `[heads * head_dim, hidden]`.

``layout`` names where the separate matrices come from:

* ``"hf"`` — Hugging Face Llama (PyTorch ``Linear`` weights `[out, in]`): ``q_proj`` `[heads *
  head_dim, hidden]`, ``k_proj``/``v_proj`` `[kv_heads * head_dim, hidden]`, ``o_proj`` `[hidden,
  heads * head_dim]`, ``gate_proj``/``up_proj`` `[ffn, hidden]`, ``down_proj`` `[hidden, ffn]`;
  biases `[out]` (1-D) as they are. Hugging Face's RoPE is the rotate-half one of
  :mod:`jax_ub.models.llama`, so q and k need no permutation.
* ``"maxtext"`` — MaxText (``DenseGeneral`` kernels): ``query`` `[embed, heads, head_dim]`,
  ``key``/``value`` `[embed, kv_heads, head_dim]`, ``out`` `[heads, head_dim, embed]`, ``wi_0``
  (gate) / ``wi_1`` (up) `[embed, mlp]`, ``wo`` `[mlp, embed]`; biases `[heads, head_dim]`.
* ``"kernel"`` — plain JAX kernels `[in, out]` (and biases `[out]`).

Every function takes leading dims before these (e.g. ``[layers, ...]`` of a stacked model, whose
packed kernels then have the same leading dims, as :class:`jax_ub.models.llama.LlamaStack`'s).
They only reshape, transpose and concatenate: a round trip is bit-exact. NumPy arrays in give
NumPy arrays out, computed on the host (a checkpoint converted without a device); jax arrays give
jax arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_ub.layers.qkv import check_heads, qkv_features

Array = jax.Array

__all__ = ["LAYOUTS", "pack_mlp", "pack_out", "pack_qkv", "unpack_mlp", "unpack_out", "unpack_qkv"]

LAYOUTS = ("hf", "maxtext", "kernel")


def _fmt(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _xp(*arrays: Any) -> Any:
    """NumPy where every array is one (host arrays stay on the host), else jax.numpy."""
    return np if all(isinstance(a, np.ndarray) for a in arrays if a is not None) else jnp


def _check_layout(where: str, layout: Any) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"{where}: `layout` must be one of {LAYOUTS}; got {layout!r}.")
    return layout


# --------------------------------------------------------------------------------------------------
# One matrix in a layout ↔ a kernel `[..., in, out]` (or a bias `[..., out]`)
# --------------------------------------------------------------------------------------------------


def _heads_to_kernel(a: Array, layout: str, bias: bool) -> Array:
    """A q/k/v matrix (or bias) in ``layout`` → `[..., hidden, heads * head_dim]` (`[..., out]`)."""
    if layout == "hf":
        return a if bias else _xp(a).swapaxes(a, -1, -2)
    if layout == "maxtext":
        return a.reshape(*a.shape[:-2], a.shape[-2] * a.shape[-1])
    return a


def _kernel_to_heads(a: Array, layout: str, head_dim: int, bias: bool) -> Array:
    if layout == "hf":
        return a if bias else _xp(a).swapaxes(a, -1, -2)
    if layout == "maxtext":
        return a.reshape(*a.shape[:-1], a.shape[-1] // head_dim, head_dim)
    return a


def _is_bias(q: Array, layout: str) -> bool:
    """Kernels have one dim more than biases: hf/kernel 2 vs 1, maxtext 3 vs 2 (plus leading dims,
    which only ``bias=`` can tell apart; see :func:`pack_qkv`)."""
    return q.ndim == (2 if layout == "maxtext" else 1)


# --------------------------------------------------------------------------------------------------
# QKV
# --------------------------------------------------------------------------------------------------


def pack_qkv(
    q: Array,
    k: Array,
    v: Array,
    *,
    num_heads: int,
    num_kv_heads: int,
    tp: int,
    layout: str = "hf",
    bias: bool | None = None,
) -> Array:
    """The fused kernel `[..., hidden, (heads + 2 kv_heads) * head_dim]` (or bias `[...,
    (heads + 2 kv_heads) * head_dim]`) of :class:`jax_ub.nn.QKVParallelDense` on a TP axis of
    size ``tp``, from separate q, k, v in ``layout`` (module docstring).

    ``bias``: whether q, k, v are biases; ``None``: told by their number of dims (kernels: 2, or
    3 for maxtext; biases one fewer) — pass it where they have leading (e.g. layer) dims.
    """
    where = "pack_qkv"
    layout = _check_layout(where, layout)
    if bias is None:
        bias = _is_bias(q, layout)
    qk, kk, vk = (_heads_to_kernel(a, layout, bias) for a in (q, k, v))
    if qk.shape[-1] % num_heads:
        raise ValueError(
            f"{where}: q's output features ({qk.shape[-1]}, from q.shape={_fmt(q.shape)} in layout "
            f"{layout!r}) must be num_heads ({num_heads}) * head_dim."
        )
    head_dim = qk.shape[-1] // num_heads
    qkv_features(where, num_heads, num_kv_heads, head_dim)
    check_heads(where, num_heads, num_kv_heads, tp, "tp")
    want = (*qk.shape[:-1], num_kv_heads * head_dim)
    for name, a, got in (("k", k, kk), ("v", v, vk)):
        if tuple(got.shape) != want:
            raise ValueError(
                f"{where}: in layout {layout!r}, `{name}` must hold num_kv_heads ({num_kv_heads}) heads "
                f"of head_dim {head_dim} (q's) over q's input dims: {_fmt(want)} as a kernel; got "
                f"{name}.shape={_fmt(a.shape)} (q.shape={_fmt(q.shape)})."
            )
    lead = qk.shape[:-1]
    blocks = [a.reshape(*lead, tp, a.shape[-1] // tp) for a in (qk, kk, vk)]
    return (
        _xp(q, k, v)
        .concatenate(blocks, axis=-1)
        .reshape(*lead, qkv_features(where, num_heads, num_kv_heads, head_dim))
    )


def unpack_qkv(
    qkv: Array,
    *,
    num_heads: int,
    num_kv_heads: int,
    tp: int,
    layout: str = "hf",
    bias: bool = False,
) -> tuple[Array, Array, Array]:
    """Inverse of :func:`pack_qkv`: the fused kernel `[..., hidden, (heads + 2 kv_heads) *
    head_dim]` (``bias=True``: `[..., (heads + 2 kv_heads) * head_dim]`) of a TP axis of size
    ``tp`` → ``(q, k, v)`` in ``layout``."""
    where = "unpack_qkv"
    layout = _check_layout(where, layout)
    if qkv.ndim < (1 if bias else 2):
        what = "bias [..., features]" if bias else "kernel [..., in, features]"
        raise ValueError(f"{where}: `qkv` must be a fused {what}; got qkv.shape={_fmt(qkv.shape)}.")
    total = qkv.shape[-1]
    per_head = num_heads + 2 * num_kv_heads
    if total % per_head:
        raise ValueError(
            f"{where}: the fused features ({total}, qkv.shape={_fmt(qkv.shape)}) must be "
            f"(num_heads + 2 * num_kv_heads) = {per_head} times head_dim."
        )
    head_dim = total // per_head
    qkv_features(where, num_heads, num_kv_heads, head_dim)
    check_heads(where, num_heads, num_kv_heads, tp, "tp")
    lead = qkv.shape[:-1]
    nq, nkv = num_heads // tp * head_dim, num_kv_heads // tp * head_dim
    blocks = qkv.reshape(*lead, tp, total // tp)
    parts = (blocks[..., :nq], blocks[..., nq : nq + nkv], blocks[..., nq + nkv :])
    q, k, v = (p.reshape(*lead, p.shape[-2] * p.shape[-1]) for p in parts)
    return (
        _kernel_to_heads(q, layout, head_dim, bias),
        _kernel_to_heads(k, layout, head_dim, bias),
        _kernel_to_heads(v, layout, head_dim, bias),
    )


# --------------------------------------------------------------------------------------------------
# Output projection
# --------------------------------------------------------------------------------------------------


def pack_out(o: Array, *, layout: str = "hf") -> Array:
    """The attention output projection's :class:`~jax_ub.nn.RowParallelDense` kernel `[...,
    heads * head_dim, hidden]` from ``o`` in ``layout`` (hf ``o_proj`` `[hidden, heads *
    head_dim]`, maxtext ``out`` `[heads, head_dim, embed]`). Heads in order: the same for every
    ``tp`` (device ``r`` holds the rows of its query heads)."""
    where = "pack_out"
    layout = _check_layout(where, layout)
    if o.ndim < (3 if layout == "maxtext" else 2):
        raise ValueError(f"{where}: `o` in layout {layout!r} has too few dims; got o.shape={_fmt(o.shape)}.")
    if layout == "hf":
        return _xp(o).swapaxes(o, -1, -2)
    if layout == "maxtext":
        return o.reshape(*o.shape[:-3], o.shape[-3] * o.shape[-2], o.shape[-1])
    return o


def unpack_out(kernel: Array, *, layout: str = "hf", head_dim: int | None = None) -> Array:
    """Inverse of :func:`pack_out` (``head_dim`` needed for maxtext)."""
    where = "unpack_out"
    layout = _check_layout(where, layout)
    if kernel.ndim < 2:
        raise ValueError(
            f"{where}: `kernel` must be [..., heads * head_dim, hidden]; got {_fmt(kernel.shape)}."
        )
    if layout == "hf":
        return _xp(kernel).swapaxes(kernel, -1, -2)
    if layout == "maxtext":
        if head_dim is None or kernel.shape[-2] % head_dim:
            raise ValueError(
                f"{where}: layout 'maxtext' needs `head_dim` dividing kernel.shape[-2] "
                f"({kernel.shape[-2]}); got head_dim={head_dim!r}."
            )
        return kernel.reshape(*kernel.shape[:-2], kernel.shape[-2] // head_dim, head_dim, kernel.shape[-1])
    return kernel


# --------------------------------------------------------------------------------------------------
# Gated MLP
# --------------------------------------------------------------------------------------------------


def pack_mlp(
    gate: Array, up: Array, down: Array | None = None, *, layout: str = "hf"
) -> tuple[Array, Array | None]:
    """The gated :class:`~jax_ub.nn.ParallelMLP`'s ``(up.kernel, down.kernel)``: `[..., hidden, 2 *
    ffn]` with gate and up interleaved (:func:`jax_ub.nn.pack_gated`: the same for every ``tp``)
    and `[..., ffn, hidden]` (``None`` without ``down``), from hf ``gate_proj``, ``up_proj``
    `[ffn, hidden]` and ``down_proj`` `[hidden, ffn]`, or maxtext ``wi_0``, ``wi_1`` `[embed,
    mlp]` and ``wo`` `[mlp, embed]`, or plain kernels."""
    where = "pack_mlp"
    layout = _check_layout(where, layout)
    for name, a in (("gate", gate), ("up", up)) + ((("down", down),) if down is not None else ()):
        if a.ndim < 2:
            raise ValueError(
                f"{where}: `{name}` must be a matrix [..., rows, cols]; got {name}.shape={_fmt(a.shape)}."
            )
    if gate.shape != up.shape:
        raise ValueError(
            f"{where}: `gate` and `up` must have the same shape; got {_fmt(gate.shape)} and {_fmt(up.shape)}."
        )
    xp = _xp(gate, up, down)
    t = (lambda a: xp.swapaxes(a, -1, -2)) if layout == "hf" else (lambda a: a)
    g, u = t(gate), t(up)
    d = None if down is None else t(down)
    if down is not None and d is not None and tuple(d.shape) != (*g.shape[:-2], g.shape[-1], g.shape[-2]):
        raise ValueError(
            f"{where}: in layout {layout!r}, `down` must map ffn ({g.shape[-1]}) back to hidden "
            f"({g.shape[-2]}); got down.shape={_fmt(down.shape)} (gate.shape={_fmt(gate.shape)})."
        )
    # unit j's gate at column 2j, its linear part at 2j + 1 (jax_ub.nn.pack_gated)
    return xp.stack([g, u], axis=-1).reshape(*g.shape[:-1], 2 * g.shape[-1]), d


def unpack_mlp(
    up_kernel: Array, down_kernel: Array | None = None, *, layout: str = "hf"
) -> tuple[Array, Array, Array | None]:
    """Inverse of :func:`pack_mlp`: ``(gate, up, down)`` in ``layout`` (``down`` ``None`` without
    ``down_kernel``)."""
    where = "unpack_mlp"
    layout = _check_layout(where, layout)
    if up_kernel.ndim < 2:
        raise ValueError(f"{where}: `up_kernel` must be [..., hidden, 2 * ffn]; got {_fmt(up_kernel.shape)}.")
    if up_kernel.shape[-1] % 2:
        raise ValueError(
            f"{where}: `up_kernel`'s last dim must be even (gate/up pairs); got {_fmt(up_kernel.shape)}."
        )
    pairs = up_kernel.reshape(*up_kernel.shape[:-1], up_kernel.shape[-1] // 2, 2)
    g, u = pairs[..., 0], pairs[..., 1]
    xp = _xp(up_kernel, down_kernel)
    t = (lambda a: xp.swapaxes(a, -1, -2)) if layout == "hf" else (lambda a: a)
    return t(g), t(u), None if down_kernel is None else t(down_kernel)
