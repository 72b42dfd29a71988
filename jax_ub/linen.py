"""Flax linen tensor-/sequence-parallel layers: thin wrappers over the same core as :mod:`jax_ub.nn`.

* :class:`ColumnParallelDense` — SP→TP (all-gather + GEMM), `[batch, seq/tp, in]` →
  `[batch, seq, features/tp]` per device.
* :class:`RowParallelDense` — TP→SP (GEMM + reduce-scatter), `[batch, seq, in/tp]` →
  `[batch, seq/tp, features]` per device; bias added once after the reduce-scatter.
* :class:`ParallelMLP` — norm (``"layernorm"``, ``"rmsnorm"`` or ``None``) → column → activation
  → row (``gated=True``: the GLU family).
* :class:`QKVParallelDense` — the fused QKV projection of grouped-query attention (heads split over
  ``axis_name``), returning q, k, v `[batch, seq, heads, head_dim]`.
* :func:`pack_qkv` / :func:`unpack_qkv`, :func:`pack_mlp` / :func:`unpack_mlp`,
  :func:`pack_out` / :func:`unpack_out` — separate Hugging Face Llama (``layout="hf"``) or MaxText
  (``"maxtext"``) matrices ↔ the layers' kernels (:mod:`jax_ub.layers.convert`).

Layouts (``seq_axis``, ``sequence_parallel=False``) and modes are those of :mod:`jax_ub.nn`
(global arrays under ``jax.set_mesh`` / ``mesh=``, or local shards inside the user's
``jax.shard_map`` over ``axis_name``; see :mod:`jax_ub.layers.core`). The input size is taken from
``x`` as usual in linen. Parameters are boxed with ``nn.with_partitioning`` (column kernel
``(None, axis_name)``, bias ``(axis_name,)``; row kernel ``(axis_name, None)``, bias ``(None,)``),
in one box with the names of an initializer that is itself wrapped in ``nn.with_partitioning``
(e.g. ``("fsdp", None)``). Logical names (``nn.with_logical_partitioning``, rules from the box or
``nn.logical_axis_rules``) stay logical in an ``nn.LogicallyPartitioned`` box, and under
``nn.logical_axis_rules`` the layer's own boxes are logical too (see :mod:`jax_ub.layers.logical`),
so ``nn.logical_to_mesh_sharding(nn.get_partition_spec(variables), mesh, rules)`` is right for
the whole tree. In local mode ``init`` creates the local shapes (the ones
``shard_map`` hands to the body), each device's shard of the same global initialisation, and
``apply`` takes either those shards or the whole parameters (which it slices).

Example (4 host devices)::

    import jax, jax.numpy as jnp
    from jax_ub import linen as ubl

    mesh = jax.make_mesh((4,), ("tp",))
    with jax.set_mesh(mesh):
        mlp = ubl.ParallelMLP(ffn_features=256)
        x = jnp.ones((2, 16, 64))
        params = jax.jit(mlp.init)(jax.random.key(0), x)
        y = jax.jit(mlp.apply)(params, x)           # [2, 16, 64]
"""

# The public names are those of the implementation and of the converters (their `__all__`);
# LayerNorm, RMSNorm and the default initializers are importable from here too.
from jax_ub.layers import convert as _convert
from jax_ub.layers import linen as _layers
from jax_ub.layers.convert import *  # noqa: F403  (pack_qkv, unpack_qkv, pack_mlp, ...)
from jax_ub.layers.linen import *  # noqa: F403  (the layers, pack_gated, unpack_gated)
from jax_ub.layers.linen import LayerNorm, RMSNorm, default_bias_init, default_kernel_init  # noqa: F401

__all__ = sorted([*_convert.__all__, *_layers.__all__])
