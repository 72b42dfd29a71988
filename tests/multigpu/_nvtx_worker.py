"""Worker of tests/multigpu/test_nvtx.py: one process per rank under jax.distributed (ranks may
share a GPU); runs one ``all_gather_matmul`` and one ``matmul_reduce_scatter`` (ring schedules)
on the CUDA path, with the NVTX recorder named by ``NVTX_INJECTION64_PATH`` attached by the parent.
Prints ``RESULT nvtx_ops_done`` after both results are ready."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

nprocs = int(os.environ["JAX_UB_TEST_NPROCS"])
rank = int(os.environ["JAX_UB_TEST_RANK"])
jax.distributed.initialize(os.environ["JAX_UB_TEST_COORD"], nprocs, rank, heartbeat_timeout_seconds=120)

import jax_ub  # noqa: E402

mesh = Mesh(np.array(jax.devices()), ("tp",))
tp = mesh.shape["tp"]
jax_ub.initialize(mesh, "tp", timeout_s=60.0)
m, k, n = 64, 128, 96
x = jax.random.normal(jax.random.key(1), (tp * m, k), jnp.bfloat16)
w = jax.random.normal(jax.random.key(2), (k, tp * n), jnp.bfloat16)


def ag(x, w):
    return jax_ub.all_gather_matmul(x, w, axis_name="tp", method="ring")


def rs(h, w2):
    return jax_ub.matmul_reduce_scatter(h, w2, axis_name="tp", method="ring")


f = jax.jit(jax.shard_map(ag, mesh=mesh, in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp")))
g = jax.jit(jax.shard_map(rs, mesh=mesh, in_specs=(P(None, "tp"), P("tp")), out_specs=P("tp")))
w2 = jax.random.normal(jax.random.key(3), (tp * n, k), jnp.bfloat16)
y = g(f(x, w), w2)
y.block_until_ready()
assert bool(jnp.isfinite(y.astype(jnp.float32)).all())
jax_ub.shutdown()
print("RESULT nvtx_ops_done", flush=True)
