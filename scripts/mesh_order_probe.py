"""What a program whose mesh orders the TP devices otherwise than initialize's would compute
without jax_ub's mesh check (jax_ub._mesh_check), and that the check refuses it.

    python3 scripts/mesh_order_probe.py        # needs >= 2 GPUs
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub import _mesh_check


def main() -> None:
    devs = jax.devices("cuda")
    n = len(devs)
    fwd, rev = Mesh(np.array(devs), ("tp",)), Mesh(np.array(devs[::-1]), ("tp",))
    x = jax.random.normal(jax.random.key(0), (128 * n, 64 * n), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (64 * n, 64 * n), jnp.float32).astype(jnp.bfloat16)
    ref = np.asarray(jnp.matmul(x.astype(jnp.float32), w.astype(jnp.float32)), np.float64)
    jax_ub.initialize(fwd, "tp")

    def ag(mesh):
        return jax.jit(jax.shard_map(lambda x, w: jax_ub.all_gather_matmul(x, w, "tp", method="ring"),
                                     mesh=mesh, in_specs=(P("tp", None), P(None, "tp")),
                                     out_specs=P(None, "tp"), check_vma=False))

    def rel(y):
        y = np.asarray(y, np.float64)
        return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))

    print(f"initialize(mesh of {[d.id for d in devs]}); ring AG->GEMM, rel. error vs float32:")
    print(f"  program on the same mesh:                {rel(ag(fwd)(x, w)):.3e}")
    try:
        ag(rev)(x, w)
        print("  program on the reversed mesh: ran (NOT refused)")
    except ValueError as e:
        print(f"  program on the reversed mesh: refused: {str(e)[:160]}...")
    orig = _mesh_check.mismatch
    _mesh_check.mismatch = lambda *a: None  # the check off: what it prevents
    try:
        print(f"  reversed mesh with the check off:        {rel(ag(rev)(x, w)):.3e}")
    finally:
        _mesh_check.mismatch = orig
    jax_ub.shutdown()


if __name__ == "__main__":
    main()
