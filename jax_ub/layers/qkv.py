"""The fused QKV projection of grouped-query attention (:class:`jax_ub.nn.QKVParallelDense`,
:class:`jax_ub.linen.QKVParallelDense`): one column-parallel layer (AG→GEMM) whose output is split
into the query, key and value heads of each device.

Layout of the fused kernel `[hidden, (num_heads + 2 * num_kv_heads) * head_dim]`: ``tp`` column
blocks, one per device of the TP axis, block ``r`` holding ``[q heads of r | k heads of r | v heads
of r]``, each group head-major (head ``h``'s ``head_dim`` columns together). Device ``r`` owns query
heads ``r * num_heads/tp ...`` and the key/value heads ``r * num_kv_heads/tp ...`` they attend
with, so one all-gather and one GEMM give it q, k and v, and the grouping of query heads over key/
value heads (query head ``i`` with kv head ``i // (num_heads / num_kv_heads)``, as Hugging Face's
``repeat_kv`` and :func:`jax.nn.dot_product_attention`) holds on every device. The layout depends
on ``tp``: :func:`jax_ub.layers.convert.pack_qkv` builds the kernel from separate q, k, v matrices
for a given ``tp`` and :func:`~jax_ub.layers.convert.unpack_qkv` splits it.

``num_heads`` and ``num_kv_heads`` must both be divisible by ``tp``. Key/value heads are not
replicated where ``tp`` exceeds ``num_kv_heads`` (Megatron does that, at the cost of
gradients that must be summed over the copies): such a ``tp`` is refused, saying so.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from jax_ub.layers import core
from jax_ub.layers.mesh import placement

Array = jax.Array

__all__ = ["check_heads", "qkv_features", "qkv_parallel_dense", "split_local"]


def _check_int(where: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: `{name}` must be a positive int; got {value!r}.")
    return value


def qkv_features(where: str, num_heads: Any, num_kv_heads: Any, head_dim: Any) -> int:
    """``(num_heads + 2 * num_kv_heads) * head_dim``, the fused output size, after checking that
    the sizes are positive ints and ``num_kv_heads`` divides ``num_heads``."""
    nq = _check_int(where, "num_heads", num_heads)
    nkv = _check_int(where, "num_kv_heads", num_kv_heads)
    hd = _check_int(where, "head_dim", head_dim)
    if nq % nkv:
        raise ValueError(
            f"{where}: `num_heads` must be a multiple of `num_kv_heads` (each key/value head serves "
            f"num_heads / num_kv_heads query heads); got num_heads={nq}, num_kv_heads={nkv}."
        )
    return (nq + 2 * nkv) * hd


def check_heads(where: str, num_heads: int, num_kv_heads: int, tp: int | None, axis_name: str) -> None:
    """Both head counts split over ``tp`` (``None``: not known yet, nothing to check)."""
    if tp is None:
        return
    for name, n in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        if n % tp:
            extra = (
                f" Key/value heads are not replicated over the TP axis (as Megatron does where tp "
                f"exceeds them): use a mesh axis {axis_name!r} of a size that divides "
                f"num_kv_heads={num_kv_heads}, and spend the other devices on data or FSDP axes."
                if name == "num_kv_heads"
                else ""
            )
            raise ValueError(
                f"{where}: `{name}` must be divisible by the size of mesh axis {axis_name!r} ({tp}): "
                f"each device holds whole heads; got {name}={n}.{extra}"
            )


def split_local(y: Array, num_heads: int, num_kv_heads: int, head_dim: int, tp: int) -> tuple[Array, ...]:
    """One device's fused output `[..., (nq/tp + 2 nkv/tp) * head_dim]` → ``(q, k, v)``,
    `[..., nq/tp, head_dim]` and `[..., nkv/tp, head_dim]` twice."""
    nq, nkv = num_heads // tp, num_kv_heads // tp
    lead = y.shape[:-1]
    q = y[..., : nq * head_dim]
    k = y[..., nq * head_dim : (nq + nkv) * head_dim]
    v = y[..., (nq + nkv) * head_dim :]
    return (
        q.reshape(*lead, nq, head_dim),
        k.reshape(*lead, nkv, head_dim),
        v.reshape(*lead, nkv, head_dim),
    )


def qkv_parallel_dense(
    x: Array,
    kernel: Array,
    bias: Array | None,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    axis_name: str = "tp",
    mesh: Any = None,
    default_mesh: Any = None,
    where: str = "QKVParallelDense",
    **options: Any,
) -> tuple[Array, Array, Array]:
    """The fused QKV projection: ``(q, k, v)`` of x `[..., seq, hidden]`.

    Global mode: q `[..., seq, num_heads, head_dim]`, k and v `[..., seq, num_kv_heads,
    head_dim]`, the heads split over ``axis_name`` (the sequence gathered). Local mode: x
    `[..., seq/tp, hidden]` → q `[..., seq, num_heads/tp, head_dim]`, k, v `[..., seq,
    num_kv_heads/tp, head_dim]`. ``options``: those of :func:`jax_ub.layers.core.column_parallel_dense`
    (``dtype``, ``precision``, ``method``, ``fp8``, ``seq_axis``, ``sequence_parallel`` ...).
    """
    out = qkv_features(where, num_heads, num_kv_heads, head_dim)
    p = placement(where, axis_name, mesh, (core.array_mesh(kernel), core.array_mesh(x), default_mesh))
    check_heads(where, num_heads, num_kv_heads, p.tp, axis_name)
    tp = p.tp or 1

    def split(y: Array) -> tuple[Array, ...]:
        return split_local(y, num_heads, num_kv_heads, head_dim, tp)

    def specs(bdim: int | None, b: Any) -> tuple[P, ...]:
        spec = P(*({bdim: b, x.ndim - 1: axis_name}.get(d) for d in range(x.ndim + 1)))
        return (spec, spec, spec)

    q, k, v = core.column_parallel_dense(
        x,
        kernel,
        bias,
        out_features=out,
        axis_name=axis_name,
        mesh=mesh,
        default_mesh=default_mesh,
        where=where,
        epilogue=split,
        epilogue_specs=specs,
        **options,
    )
    return q, k, v
