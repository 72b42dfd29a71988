"""CPU tier: ``jax_ub.initialize`` where the CUDA path is unavailable (no extension or GPU, or
``JAX_UB_DISABLE=1``): a logged no-op that still checks its arguments, after which the ops run on
the reference path."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub import comm, config

cpu_only = pytest.mark.skipif(jax_ub.build_info()["cuda_path"], reason="needs the CUDA path unavailable")


@cpu_only
@pytest.mark.parametrize("disable", [False, True], ids=["no-cuda", "JAX_UB_DISABLE"])
def test_initialize_is_a_logged_no_op_without_the_cuda_path(disable, cpu_mesh, caplog):
    mesh = cpu_mesh(4)
    with config.override(disable=disable), caplog.at_level(logging.INFO, logger="jax_ub"):
        reason = jax_ub.build_info()["reason"]
        assert jax_ub.initialize(mesh, "tp") is None
        assert jax_ub.initialize(mesh, "tp") is None  # again: still nothing
    assert comm.get("tp") is None and comm.errors() == {} and comm.host_stats() == {}
    msgs = [r.getMessage() for r in caplog.records if r.name == "jax_ub" and r.levelno == logging.INFO]
    assert msgs and all("initialize(axis='tp') does nothing" in m and reason in m for m in msgs), msgs
    assert ("JAX_UB_DISABLE=1" in msgs[0]) is disable
    jax_ub.shutdown()
    jax_ub.shutdown("tp")
    jax_ub.shutdown()


@cpu_only
def test_initialize_still_checks_its_arguments(cpu_mesh):
    mesh = cpu_mesh(2)
    with pytest.raises(ValueError, match="axis 'model' is not an axis of the mesh"):
        jax_ub.initialize(mesh, "model")
    with pytest.raises(ValueError, match="bootstrap must be one of"):
        jax_ub.initialize(mesh, "tp", bootstrap="mpi")


@cpu_only
def test_ops_run_after_a_no_op_initialize(cpu_mesh):
    mesh = cpu_mesh(2)
    assert jax_ub.initialize(mesh, "tp") is None
    x = jax.random.normal(jax.random.key(0), (4, 3), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (3, 4), jnp.float32)
    f = jax.shard_map(
        lambda x, w: jax_ub.all_gather_matmul(x, w, "tp"),
        mesh=mesh,
        in_specs=(P("tp"), P(None, "tp")),
        out_specs=P(None, "tp"),
    )
    np.testing.assert_allclose(
        np.asarray(f(x, w)), np.asarray(x, np.float64) @ np.asarray(w, np.float64), rtol=1e-5, atol=1e-6
    )
    jax_ub.shutdown()
