"""Flax NNX tensor-/sequence-parallel layers with comm/GEMM overlap.

* :class:`ColumnParallelDense` — SP→TP: `[batch, seq/tp, in]` → all-gather + GEMM →
  `[batch, seq, out/tp]`.
* :class:`RowParallelDense` — TP→SP: `[batch, seq, in/tp]` → GEMM + reduce-scatter →
  `[batch, seq/tp, out]`.
* :class:`ParallelMLP` — norm → column → activation → row, `[batch, seq/tp, features]` in and
  out; ``norm="layernorm"`` (default), ``"rmsnorm"`` (Llama, Mistral) or ``None``;
  ``gated=True`` for the GLU family (SwiGLU with ``activation=jax.nn.silu``), whose ``up``
  parameters :func:`pack_gated` builds from separate gate and linear halves.
* :class:`QKVParallelDense` — the fused QKV projection of grouped-query attention, column-parallel:
  `[batch, seq/tp, hidden]` → q `[batch, seq, heads/tp, head_dim]`, k, v `[batch, seq,
  kv_heads/tp, head_dim]` (shaped for :func:`jax.nn.dot_product_attention`).
* :func:`pack_qkv` / :func:`unpack_qkv`, :func:`pack_mlp` / :func:`unpack_mlp`,
  :func:`pack_out` / :func:`unpack_out` — separate Hugging Face Llama (``layout="hf"``) or MaxText
  (``"maxtext"``) matrices ↔ the layers' kernels (:mod:`jax_ub.layers.convert`).

Shapes above are per device, for the default layout. Activations may have any number (>= 1) of
leading dims; ``seq_axis`` (default ``-2``) is the sequence, the axis all-gathered and
reduce-scattered (``seq_axis=0`` for `[seq, batch, hidden]`). ``sequence_parallel=False`` is TP
without SP, for sequences that do not split over ``tp`` (decode steps): activations replicated over
``axis_name``, a local GEMM in the column layer, a GEMM and an all-reduce in the row layer.

A layer works in one of two modes, chosen at each call: on *global* arrays under
``jax.set_mesh(mesh)`` (or with ``mesh=``; with neither, the mesh of its parameters' sharding or
the one it was built under), where it applies ``jax.shard_map`` itself, or on *local* shards inside
the user's ``jax.shard_map`` over ``axis_name``. See :mod:`jax_ub.layers.core` for the rules.
Parameters carry partitioning metadata (``nnx.get_partition_spec``): column kernel
``(None, axis_name)`` and bias ``(axis_name,)``; row kernel ``(axis_name, None)`` and bias
``(None,)``; an initializer wrapped in ``nnx.with_partitioning`` adds its names on the other dims
(e.g. FSDP), mesh axes or logical names translated by ``sharding_rules`` /
``nnx.logical_axis_rules`` (the metadata keeps them as given; see :mod:`jax_ub.layers.logical`).
Under a mesh with ``axis_name`` they are created sharded (Flax eager sharding).

Example (4 host devices: ``XLA_FLAGS=--xla_force_host_platform_device_count=4``)::

    import jax, jax.numpy as jnp
    from flax import nnx
    from jax_ub import nn as ubnn

    mesh = jax.make_mesh((1, 4), ("dp", "tp"))
    with jax.set_mesh(mesh):
        mlp = ubnn.ParallelMLP(64, 256, rngs=nnx.Rngs(0))
        x = jnp.ones((2, 16, 64))                  # [batch, seq, features]
        y = nnx.jit(lambda m, x: m(x))(mlp, x)     # [2, 16, 64], seq split over "tp"
"""

# The public names are those of the implementation and of the converters (their `__all__`);
# LayerNorm, RMSNorm and the default initializers are importable from here too.
from jax_ub.layers import convert as _convert
from jax_ub.layers import nnx as _layers
from jax_ub.layers.convert import *  # noqa: F403  (pack_qkv, unpack_qkv, pack_mlp, ...)
from jax_ub.layers.nnx import *  # noqa: F403  (the layers, pack_gated, unpack_gated)
from jax_ub.layers.nnx import LayerNorm, RMSNorm, default_bias_init, default_kernel_init  # noqa: F401

__all__ = sorted([*_convert.__all__, *_layers.__all__])
