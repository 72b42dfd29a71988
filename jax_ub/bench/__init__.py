"""Benchmarks: ``python -m jax_ub.bench ag|rs`` (see ``__main__``)."""
