"""One GPU, tp=1: after jax_ub.initialize (which makes no communicator on an axis of size 1), the
primitives and the bare collectives run without communicating and equal XLA's; prints one line."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub import overlap

mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
print("initialize on tp=1 returned", jax_ub.initialize(mesh, "tp"), "| path", jax_ub.build_info()["path"])
x = jax.random.normal(jax.random.key(0), (512, 256), jnp.bfloat16)
w = jax.random.normal(jax.random.key(1), (256, 384), jnp.bfloat16)
smap = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("tp", None), P(None, "tp")),  # noqa: E731
                                       out_specs=P("tp", None), check_vma=False))
ref = np.asarray(x.astype(jnp.float32) @ w.astype(jnp.float32))
for name, f in [("all_gather_matmul", lambda x, w: jax_ub.all_gather_matmul(x, w, "tp")),
                ("matmul_reduce_scatter", lambda x, w: jax_ub.matmul_reduce_scatter(x, w, "tp")),
                ("overlap.all_gather @ w", lambda x, w: overlap.all_gather(x, "tp") @ w),
                ("overlap.reduce_scatter(x @ w)", lambda x, w: overlap.reduce_scatter(x @ w, "tp"))]:
    y = np.asarray(smap(f)(x, w).astype(jnp.float32))
    print(f"tp=1 {name}: rel err {np.linalg.norm(y - ref) / np.linalg.norm(ref):.2e}")
jax_ub.shutdown()
