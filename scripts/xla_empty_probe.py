"""Which pure-XLA programs with an empty operand does the installed jax's XLA compile?

jax 0.11.2 died with SIGSEGV compiling tests/multigpu/test_overlap.py's bulk case on two H200s, and
tests/cpu/test_ops.py::test_bulk_gather_beside_an_empty_gemm on the device's CPU backend. Each case
runs in its own process (a crash takes only that one); a shard_map over 2 CPU devices, or jit alone.

    python scripts/xla_empty_probe.py        # every case; "SEGV" marks a crash
    python scripts/xla_empty_probe.py gpu    # the same on jax's GPUs (a mesh of up to 2 of them)

On jax 0.11.2 (one H100 machine, CPU backend, 2026-11-25) every dot whose result has no elements
crashed inside shard_map; a dot over an empty contraction did not, and neither did jax_ub's ops
after reference._product stopped emitting such dots.
"""

from __future__ import annotations

import os
import subprocess
import sys

CASES = ["gather_and_empty_dot", "empty_dot_alone", "dot_of_empty_rows", "dot_of_empty_cols",
         "empty_contraction", "gather_and_zeros", "gather_and_empty_einsum",
         "jit_empty_dot_no_shard_map", "jax_ub_bulk", "jax_ub_ag", "jax_ub_rs", "jax_ub_ag_grad"]


def run(case: str) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    tp = mesh.size
    a = jnp.ones((8 * tp, 4), jnp.float32)
    x, w = jnp.ones((0, 6)), jnp.ones((6, 0))
    if case == "jit_empty_dot_no_shard_map":
        print(case, "ok", jax.jit(lambda x, w: x @ w)(x, w).shape, flush=True)
        return
    if case.startswith("jax_ub_") and case != "jax_ub_bulk":
        import jax_ub

        xs, ws = jnp.ones((8, 6)), jnp.ones((6, 0))
        if case == "jax_ub_ag":
            f = lambda x, w: jax_ub.all_gather_matmul(x, w, "tp")  # noqa: E731
            specs, out = (P("tp", None), P(None, "tp")), P(None, "tp")
        elif case == "jax_ub_rs":
            f = lambda x, w: jax_ub.matmul_reduce_scatter(x, w, "tp")  # noqa: E731
            specs, out = (P(None, "tp"), P("tp", None)), P("tp", None)
        else:
            g = jax.shard_map(lambda x, w: jax_ub.all_gather_matmul(x, w, "tp"), mesh=mesh,
                              in_specs=(P("tp", None), P(None, "tp")), out_specs=P(None, "tp"))
            r = jax.jit(jax.grad(lambda x, w: jnp.sum(g(x, w)), argnums=(0, 1)))(jnp.ones((8, 0)),
                                                                                   jnp.ones((0, 4)))
            print(case, "ok", [t.shape for t in r], flush=True)
            return
        r = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=specs, out_specs=out))(xs, ws)
        print(case, "ok", r.shape, flush=True)
        return

    def body(a, x, w):
        g = lax.all_gather(a, "tp", axis=0, tiled=True)
        if case == "gather_and_empty_dot":
            y = x @ w
        elif case == "empty_dot_alone":
            return a, x @ w
        elif case == "dot_of_empty_rows":
            y = x @ jnp.ones((6, 5))
        elif case == "dot_of_empty_cols":
            y = jnp.ones((3, 6)) @ w
        elif case == "empty_contraction":
            y = jnp.ones((3, 0)) @ jnp.ones((0, 5))
        elif case == "gather_and_zeros":
            y = jnp.zeros((x.shape[0], w.shape[1]), x.dtype)
        elif case == "gather_and_empty_einsum":
            y = jnp.einsum("mk,kn->mn", x, w)
        elif case == "jax_ub_bulk":
            from jax_ub import bulk

            return bulk.bulk_all_gather(a, x, w, "tp", method="ring")
        return g, y

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp", None), P(), P()),
                              out_specs=(P(), P()), check_vma=False))
    g, y = f(a, x, w)
    print(case, "ok", g.shape, y.shape, flush=True)


def main(gpu: bool) -> None:
    env = dict(os.environ) if gpu else dict(
        os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    for c in CASES:
        r = subprocess.run([sys.executable, __file__, c], env=env, capture_output=True, text=True,
                           timeout=120)
        crash = " SEGV" if r.returncode == -11 else ""
        tail = (r.stdout.strip() or r.stderr.strip())[-120:]
        print(f"{c}: rc={r.returncode}{crash} {tail}", flush=True)
    import jax

    print("jax", jax.__version__, "on", "GPU" if gpu else "CPU")


if __name__ == "__main__":
    run(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1] != "gpu" else main(sys.argv[1:] == ["gpu"])
