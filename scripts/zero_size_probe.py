"""Which zero-size program makes XLA's compiler crash? Each case runs in its own process (a
segfault ends only that case) and prints its exit code (-11: SIGSEGV):

    python3 scripts/zero_size_probe.py        # on jax's GPUs (a mesh of up to 2)
    python3 scripts/zero_size_probe.py cpu    # on 2 CPU devices (JAX_PLATFORMS=cpu)

Why: on 2xH200 (jax 0.11.2, session 29), tests/multigpu/test_overlap.py::
test_zero_size_operands_give_xla_results[bulk_ag] died with SIGSEGV inside XLA's
backend_compile_and_load, for a program with no jax_ub custom call (the lowered text was checked):
an all-gather of a[256, 64] beside x[0, 128] @ w[128, 0]. On one H200 every case below passed (a
1-device mesh: the all-gather is trivial there). Session 40 ran it with ``cpu`` on the H100
machine's jax 0.11.2: a dot with an empty result crashed in a shard_map that also took an operand
split over the axis (an all-gather of it beside the dot, or that operand merely passed through);
the same dot with only replicated operands did not, nor under jit alone. (A dot over an empty
contraction, both operands empty, is refused by shardy in jax 0.10 and 0.11: an error, no crash.) jax_ub's ops no longer emit such a dot (jax_ub/reference.py, ``_product``),
and their cases here passed there, as they did on one GPU."""
import os
import subprocess
import sys

CASES = {
    # plain JAX, no jax_ub
    "dot_0x0_jit": "f = jax.jit(lambda x, w: x @ w); r = f(x0, w0)",
    "dot_0x0_shard_map": "f = jax.jit(jax.shard_map(lambda x, w: x @ w, mesh=mesh, in_specs=(P(), P()), "
                         "out_specs=P(), check_vma=False)); r = f(x0, w0)",
    "gather_and_dot_0x0": "f = jax.jit(jax.shard_map(lambda a, x, w: (lax.all_gather(a, 'tp', tiled=True), x @ w), "
                          "mesh=mesh, in_specs=(P('tp'), P(), P()), out_specs=(P(), P()), check_vma=False)); "
                          "r = f(a, x0, w0)",
    "gather_and_dot_0x0_sharded_a_only": "f = jax.jit(jax.shard_map(lambda a, x, w: (lax.all_gather(a, 'tp', tiled=True), "
                          "x @ w), mesh=mesh, in_specs=(P('tp'), P(), P()), out_specs=(P(), P()), check_vma=False)); "
                          "r = f(a, jnp.zeros((0, 8), a.dtype), jnp.zeros((8, 0), a.dtype))",
    "dot_rows0_shard_map": "f = jax.jit(jax.shard_map(lambda x, w: x @ w, mesh=mesh, in_specs=(P(), P()), "
                           "out_specs=P(), check_vma=False)); r = f(x0, jnp.ones((128, 8), a.dtype))",
    "dot_cols0_shard_map": "f = jax.jit(jax.shard_map(lambda x, w: x @ w, mesh=mesh, in_specs=(P(), P()), "
                           "out_specs=P(), check_vma=False)); r = f(jnp.ones((8, 128), a.dtype), w0)",
    "contraction0_shard_map": "f = jax.jit(jax.shard_map(lambda x, w: x @ w, mesh=mesh, in_specs=(P(), P()), "
                              "out_specs=P(), check_vma=False)); "
                              "r = f(jnp.ones((8, 0), a.dtype), jnp.ones((0, 8), a.dtype))",
    "psum_scatter_width0": "f = jax.jit(jax.shard_map(lambda x: lax.psum_scatter(x, 'tp', tiled=True), mesh=mesh, "
                           "in_specs=P(), out_specs=P('tp'), check_vma=False)); r = f(jnp.ones((256, 0), a.dtype))",
    # jax_ub's reference path (no communicator)
    "jax_ub_bulk_ag_xla": "import jax_ub as ub; f = jax.jit(jax.shard_map(lambda a, x, w: ub.bulk_all_gather(a, x, w, "
                          "'tp', method='xla'), mesh=mesh, in_specs=(P('tp'), P(), P()), out_specs=(P(), P()), "
                          "check_vma=False)); r = f(a, x0, w0)",
    "jax_ub_ag_width0": "import jax_ub as ub; f = jax.jit(jax.shard_map(lambda x, w: ub.all_gather_matmul(x, w, "
                        "'tp'), mesh=mesh, in_specs=(P('tp'), P(None, 'tp')), out_specs=P(None, 'tp'))); "
                        "r = f(a, jnp.ones((64, 0), a.dtype))",
    "jax_ub_rs_width0": "import jax_ub as ub; f = jax.jit(jax.shard_map(lambda x, w: ub.matmul_reduce_scatter(x, w, "
                        "'tp'), mesh=mesh, in_specs=(P(None, 'tp'), P('tp')), out_specs=P('tp'))); "
                        "r = f(a, jnp.ones((64, 0), a.dtype))",
    "jax_ub_ag_grad_k0": "import jax_ub as ub; g = jax.shard_map(lambda x, w: ub.all_gather_matmul(x, w, 'tp'), "
                         "mesh=mesh, in_specs=(P('tp'), P(None, 'tp')), out_specs=P(None, 'tp')); "
                         "r = jax.jit(jax.grad(lambda x, w: jnp.sum(g(x, w).astype(jnp.float32)), (0, 1)))("
                         "jnp.ones((256, 0), a.dtype), jnp.ones((0, 64), a.dtype))",
    # the failing test's body: jax_ub initialized on the mesh (CUDA IPC buffers, watchdog), method ring
    "jax_ub_bulk_ag_ring_after_initialize": "import jax_ub as ub; ub.initialize(mesh, 'tp'); "
                          "f = jax.jit(jax.shard_map(lambda a, x, w: ub.bulk_all_gather(a, x, w, 'tp', "
                          "method='ring'), mesh=mesh, in_specs=(P('tp'), P(), P()), out_specs=(P(), P()), "
                          "check_vma=False)); r = f(a, x0, w0)",
    "gather_and_dot_0x0_after_initialize": "import jax_ub as ub; ub.initialize(mesh, 'tp'); "
                          "f = jax.jit(jax.shard_map(lambda a, x, w: (lax.all_gather(a, 'tp', tiled=True), x @ w), "
                          "mesh=mesh, in_specs=(P('tp'), P(), P()), out_specs=(P(), P()), check_vma=False)); "
                          "r = f(a, x0, w0)",
}
PRE = """
import jax, jax.numpy as jnp, numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P
mesh = Mesh(np.array(jax.devices()[:2]), ('tp',))
print('devices', len(mesh.devices.flat), jax.__version__)
k = jax.random.split(jax.random.key(0), 3)
a = jax.random.normal(k[0], (256, 64), jnp.bfloat16)
x0 = jax.random.normal(k[1], (0, 128), jnp.bfloat16)
w0 = jax.random.normal(k[2], (128, 0), jnp.bfloat16)
"""
ENV = dict(os.environ)
if sys.argv[1:] == ["cpu"]:
    ENV.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
for name, body in CASES.items():
    src = PRE + body + "\njax.block_until_ready(r); print('ok', jax.tree.map(lambda t: t.shape, r))"
    p = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, timeout=120, env=ENV)
    tail = (p.stdout.strip().splitlines() or [""])[-1] if p.returncode == 0 else \
        " | ".join((p.stderr.strip().splitlines() or [""])[-2:])[:300]
    print(f"ZERO {name}: rc={p.returncode} {tail}", flush=True)
    if name == "dot_0x0_jit":
        print("ZERO", (p.stdout.strip().splitlines() or [""])[0], flush=True)
