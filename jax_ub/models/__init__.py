"""Models built from jax_ub's layers: :mod:`jax_ub.models.llama` (a Llama-style decoder)."""
