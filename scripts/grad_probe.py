"""GPU probe: gradients of the TP primitives with batch dims, per method, against method='xla'."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_ub

tp = 4
mesh = Mesh(np.array(jax.devices()[:tp]), ("tp",))
jax_ub.initialize(mesh, "tp")
k = jax.random.split(jax.random.key(0), 4)
x = jax.random.normal(k[0], (2, 256, 128), jnp.float32)
w1 = jax.random.normal(k[1], (128, 512), jnp.float32) * 0.1
w2 = jax.random.normal(k[2], (512, 128), jnp.float32) * 0.1
HP = jax.lax.Precision.HIGHEST


def model(m_ag, m_rs, vma):
    def f(x, w1, w2):
        h = jax_ub.all_gather_matmul(x, w1, "tp", gather_axis=1, method=m_ag, precision=HP)
        y = jax_ub.matmul_reduce_scatter(jnp.tanh(h), w2, "tp", scatter_axis=1, method=m_rs, precision=HP)
        return y
    sm = jax.shard_map(f, mesh=mesh, in_specs=(P(None, "tp", None), P(None, "tp"), P("tp", None)),
                       out_specs=P(None, "tp", None), check_vma=vma)
    return jax.jit(jax.value_and_grad(lambda *a: jnp.mean(sm(*a) ** 2), (0, 1, 2)))


for vma in (True, False):
    l0, g0 = model("xla", "xla", vma)(x, w1, w2)
    for m_ag, m_rs in [("ring", "ring"), ("push", "ring"), ("ring", "pipeline"), ("push", "pipeline"),
                       ("auto", "auto")]:
        loss, g = model(m_ag, m_rs, vma)(x, w1, w2)
        rel = [float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) for a, b in zip(g, g0, strict=True)]
        print(f"check_vma={vma} ag={m_ag:5s} rs={m_rs:8s} loss {float(loss):.6f} vs {float(l0):.6f} "
              f"grad rel x {rel[0]:.2e} w1 {rel[1]:.2e} w2 {rel[2]:.2e}", flush=True)
jax_ub.shutdown()
