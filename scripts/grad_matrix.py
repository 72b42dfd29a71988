"""Gradient check matrix on the GPUs of this host: transport x method x (scan or not) x gather axis,
AG -> tanh -> RS, relative error of the outputs and of the gradients against method="xla".

    python scripts/grad_matrix.py [--transports ipc nccl] [--methods ring push auto]
"""

from __future__ import annotations

import argparse
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_ub


def rel(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--transports", nargs="+", default=["ipc", "nccl"])
    p.add_argument("--methods", nargs="+", default=["ring", "push", "auto"])
    p.add_argument("--dtype", default="bfloat16")
    a = p.parse_args()
    tp = min(len(jax.devices()), 4)
    mesh = Mesh(np.array(jax.devices()[:tp]), ("tp",))
    dt = jnp.dtype(a.dtype)
    key = jax.random.key(0)
    k1, k2, k3 = jax.random.split(key, 3)
    x3 = jax.random.normal(k1, (2, 64 * tp, 256), jnp.float32).astype(dt)
    w1 = (jax.random.normal(k2, (256, 128 * tp), jnp.float32) / 16).astype(dt)
    w2 = (jax.random.normal(k3, (128 * tp, 256), jnp.float32) / 16).astype(dt)

    def make(method, scan, gax):
        x = x3 if gax == 1 else x3.reshape(-1, 256)
        xs = P(None, "tp", None) if gax == 1 else P("tp", None)

        def layer(h):
            y = jax_ub.all_gather_matmul(h, w1l, "tp", gather_axis=gax, method=method)
            return jax_ub.matmul_reduce_scatter(jnp.tanh(y), w2l, "tp", scatter_axis=gax,
                                                method=method) * 0.5

        def f(x, w1_, w2_):
            nonlocal w1l, w2l
            w1l, w2l = w1_, w2_
            if scan:
                h, _ = lax.scan(lambda h, _: (layer(h), None), x, None, length=2)
            else:
                h = layer(x)
            return jnp.sum(h.astype(jnp.float32) ** 2), h

        w1l = w2l = None
        g = jax.shard_map(f, mesh=mesh, in_specs=(xs, P(None, "tp"), P("tp", None)),
                          out_specs=(P(), xs), check_vma=False)
        loss = jax.jit(lambda *args: g(*args)[0].sum())
        fwd = jax.jit(lambda *args: g(*args)[1])
        grad = jax.jit(jax.grad(lambda *args: g(*args)[0].sum(), (0, 1, 2)))
        return x, fwd, grad, loss

    for transport in a.transports:
        jax_ub.shutdown()
        if transport != "none":  # "none": no communicator (dry run of the script on CPU)
            jax_ub.initialize(mesh, "tp", transport=transport)
        for method, scan, gax in itertools.product(a.methods, (False, True), (0, 1)):
            x, fwd, grad, _ = make(method, scan, gax)
            _, fwd_r, grad_r, _ = make("xla", scan, gax)
            try:
                fo = rel(fwd(x, w1, w2), fwd_r(x, w1, w2))
                gs = grad(x, w1, w2)
                gr = grad_r(x, w1, w2)
                ge = [rel(u, v) for u, v in zip(gs, gr, strict=True)]
                print(f"{transport:5} {method:5} scan={int(scan)} gax={gax}  fwd {fo:.2e}  "
                      f"grad x {ge[0]:.2e} w1 {ge[1]:.2e} w2 {ge[2]:.2e}"
                      f"{'  <-- BAD' if max([fo, *ge]) > 3e-2 else ''}", flush=True)
            except Exception as e:
                print(f"{transport:5} {method:5} scan={int(scan)} gax={gax}  ERROR {type(e).__name__}: "
                      f"{str(e)[:300]}", flush=True)
    jax_ub.shutdown()


if __name__ == "__main__":
    main()
