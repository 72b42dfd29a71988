"""Worker of the one-process GPU tests that need a fresh process (their own environment, or a
communicator that ends up unusable): one process drives every local GPU.

    python _op_worker.py resharded|never_starts|compile_cache

Prints ``RESULT <name> <value>`` lines the test reads; exits non-zero on any mismatch.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from _cache_probe import count_cache_events, digest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_ub

mode = sys.argv[1]
devs = jax.devices("cuda")
tp = min(len(devs), 8)
mesh = Mesh(np.array(devs[:tp]), ("tp",))
jax_ub.initialize(mesh, "tp")
HP = lax.Precision.HIGHEST


def smap(f, in_specs, out_specs):
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False))


ag = smap(lambda x, w: jax_ub.all_gather_matmul(x, w, "tp"), (P("tp", None), P(None, "tp")), P(None, "tp"))
rs = smap(
    lambda x, w: jax_ub.matmul_reduce_scatter(x, w, "tp"), (P(None, "tp"), P("tp", None)), P("tp", None)
)


def rand(seed, shape):
    # made on the default device, uncommitted: each call reshards it onto the mesh (XLA copies
    # device 0's data to the other GPUs right before the op)
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(jnp.bfloat16)


def rel(out, x, w):
    ref = np.asarray(jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision=HP))
    out = np.asarray(out, np.float64)
    assert not np.isnan(out).any(), "NaN in output"
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


if mode == "resharded":
    # Fresh inputs on device 0 for every call, several calls in flight before a result is read.
    worst, calls = 0.0, 0
    for i in range(30):
        m, k, n = (256 * tp, 1024, 512 * tp) if i % 2 else (512 * tp, 768 * tp, 1024)
        pending = []
        for j in range(3):
            seed = 100 * i + 2 * j
            if i % 2:
                x, w = rand(seed, (m, k)), rand(seed + 1, (k, n)) / k**0.5
                pending.append((ag(x, w), x, w))
            else:
                x, w = rand(seed, (m, k)), rand(seed + 1, (k, n)) / k**0.5
                pending.append((rs(x, w), x, w))
            calls += 1
        for out, x, w in pending:
            worst = max(worst, rel(out, x, w))
    print(f"RESULT resharded calls {calls} worst_rel {worst:.3e}", flush=True)
    assert worst <= 1e-2, worst
elif mode == "never_starts":
    # Rank 1 refuses its next op before it begins, so it never enters it: rank 0 must fail on the
    # host after JAX_UB_TIMEOUT, naming rank 1, instead of waiting for it on the GPU.
    x, w = rand(1, (256 * tp, 512)), rand(2, (512, 256 * tp))
    jax.block_until_ready(ag(x, w))
    messages = []
    t0 = time.monotonic()
    # The failing call, then one on rank 0's now unusable communicator (rank 1 refuses that one
    # too, so no rank enqueues a wait that nobody answers).
    for _ in range(2):
        jax_ub.comm._inject_failure("tp", "before", devices=[devs[1].local_hardware_id])
        try:
            jax.block_until_ready(ag(x, w))
            messages.append("no error")
        except Exception as e:  # XLA's runtime error wraps ours
            messages.append(str(e))
    print(f"RESULT never_starts seconds {time.monotonic() - t0:.1f}", flush=True)
    for msg in messages:
        print("RESULT never_starts message " + " ".join(msg.split()), flush=True)
elif mode == "compile_cache":
    # Run with JAX_COMPILATION_CACHE_DIR (and a zero minimum compile time and entry size) set, twice
    # on one cache directory: the second process loads the jax_ub programs from the persistent
    # cache. Tracing still runs there (it grows the registered buffers and prepares the GEMMs);
    # the results must equal the first process's bit for bit.
    events = count_cache_events()
    x, w1, w2 = rand(11, (512 * tp, 1024)), rand(12, (1024, 768 * tp)), rand(13, (768 * tp, 1024))
    w1, w2 = w1 / 32, w2 / (768 * tp) ** 0.5
    mlp = smap(
        lambda x, w1, w2: jax_ub.matmul_reduce_scatter(
            jax.nn.gelu(jax_ub.all_gather_matmul(x, w1, "tp")), w2, "tp"
        ),
        (P("tp", None), P(None, "tp"), P("tp", None)),
        P("tp", None),
    )
    grad = jax.jit(jax.grad(lambda *a: mlp(*a).astype(jnp.float32).sum(), (0, 1, 2)))
    text = mlp.lower(x, w1, w2).as_text() + grad.lower(x, w1, w2).as_text()
    assert "jax_ub_ag_gemm" in text and "jax_ub_gemm_rs" in text, "no jax_ub custom call"
    outs = [ag(x, w1), rs(x.T, x), mlp(x, w1, w2), *grad(x, w1, w2)]
    print(f"RESULT compile_cache ag_rel {rel(outs[0], x, w1):.3e}", flush=True)
    assert rel(outs[0], x, w1) <= 1e-2
    assert rel(outs[1], x.T, x) <= 1e-2
    for out in outs:
        assert np.isfinite(np.asarray(out, np.float32)).all(), "non-finite output"
    print(f"RESULT compile_cache digest {digest(outs)}", flush=True)
    print(f"RESULT compile_cache hits {events['hits']} misses {events['misses']}", flush=True)
else:
    sys.exit(f"unknown mode {mode!r}")
jax_ub.shutdown()
print("RESULT done", flush=True)
