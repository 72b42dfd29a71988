"""The tensor-/sequence-parallel Flax layers; users import them as :mod:`jax_ub.nn` (NNX) and
:mod:`jax_ub.linen` (linen).

* :mod:`~jax_ub.layers.core` — the forward pass both frameworks share (plain functions of arrays);
* :mod:`~jax_ub.layers.mesh` — where a call runs (local or global mode) and on which mesh;
* :mod:`~jax_ub.layers.params` — which dim of each parameter is split, checks, initialization;
* :mod:`~jax_ub.layers.logical` — logical axis names on the parameters;
* :mod:`~jax_ub.layers.activation` — the mesh axes the activations keep on their batch;
* :mod:`~jax_ub.layers.qkv` and :mod:`~jax_ub.layers.convert` — the fused QKV projection, and the
  converters from Hugging Face and MaxText matrices to the layers' kernels;
* :mod:`~jax_ub.layers.nnx` / :mod:`~jax_ub.layers.linen` — the modules, owning parameters only.
"""
