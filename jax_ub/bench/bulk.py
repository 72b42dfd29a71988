"""Workloads of ``python -m jax_ub.bench bulk``: a collective under an *independent* GEMM.

The backward pass of a column-parallel layer ``y = all_gather(x) @ w`` (global ``x[M, K]``, ``w[K, N]``,
``tp`` devices) is where the bulk primitives run. For a global shape (M, K, N), per device:

* ``bulk_ag`` — re-gather the saved input shard under the dgrad GEMM:
  ``all_gather(x[M/tp, K]) → [M, K]`` while computing ``a[M, N/tp] @ b[N/tp, K]`` (``dy @ wᵀ``);
  :func:`jax_ub.bulk_all_gather`.
* ``bulk_rs`` — reduce-scatter dgrad under the wgrad GEMM:
  ``psum_scatter(x[M, K]) → [M/tp, K]`` while computing ``a[K, M] @ b[M, N/tp]`` (``x_gatheredᵀ @ dy``,
  ``a`` given already transposed); :func:`jax_ub.bulk_reduce_scatter`.

Impls timed per shape (``gemm_alone``/``comm_*`` alone give the bound ``max(gemm, comm)`` that the
overlapped ``jax_ub`` should reach within 1.10×; ``jax_ub``'s output, the collective's and the GEMM's,
is checked against ``xla_plain``'s and ``comm_jax_ub``'s against ``comm_nccl``'s,
:class:`jax_ub.bench.harness.Check`):

* ``gemm_alone``   the GEMM alone on one GPU (cuBLASLt; ``jnp.matmul`` off the CUDA path);
* ``comm_jax_ub``  ``jax_ub.collectives.all_gather`` / ``reduce_scatter`` alone (copy engine; CUDA only);
* ``comm_nccl``    ``lax.all_gather`` / ``lax.psum_scatter`` alone;
* ``xla_plain``    XLA collective and GEMM in one ``shard_map`` program (XLA may overlap them itself);
* ``jax_ub``       the bulk primitive (``method="auto"``; the reference off the CUDA path).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub import collectives
from jax_ub.bench import harness as h

KINDS = ("ag", "rs")
Thunk = Callable[[], tuple[Callable[..., Any], tuple[Any, ...]]]


def layout(kind: str, M: int, K: int, N: int, tp: int) -> dict[str, Any]:
    """Global shapes and specs of ``x``, ``a``, ``b`` and of the outputs (collective, GEMM)."""
    if kind == "ag":
        return dict(
            x=((M, K), P("tp", None)),
            a=((M, N), P(None, "tp")),
            b=((N, K), P("tp", None)),
            out=(P(), P("tp", None)),
            local=((M, N // tp), (N // tp, K)),
        )
    if kind == "rs":
        return dict(
            x=((tp * M, K), P("tp", None)),
            a=((K, M), P()),
            b=((M, N), P(None, "tp")),
            out=(P("tp", None), P(None, "tp")),
            local=((K, M), (M, N // tp)),
        )
    raise ValueError(f"kind must be one of {KINDS}; got {kind!r}")


def primitive(kind: str) -> Callable[..., Any]:
    """``jax_ub.bulk_all_gather`` / ``jax_ub.bulk_reduce_scatter``, or a clear error if missing."""
    name = "bulk_all_gather" if kind == "ag" else "bulk_reduce_scatter"
    fn = getattr(jax_ub, name, None)
    if fn is None:
        raise NotImplementedError(
            f"jax_ub.{name} does not exist in this jax_ub "
            f"({jax_ub.__file__}): the bulk primitives have not landed yet"
        )
    return fn


def build(kind: str, mesh: Any, M: int, K: int, N: int, *, dtype_name: str, cuda: bool) -> dict[str, Thunk]:
    """``{impl: thunk}``; each thunk returns ``(fn, args)``. ``comm_jax_ub`` only with ``cuda``. Each
    :func:`jax_ub.bench.harness.reference` comes before the impls checked against it."""
    dtype = jnp.dtype(dtype_name)
    tp = mesh.shape["tp"]
    lay = layout(kind, M, K, N, tp)
    kx, ka, kb = jax.random.split(jax.random.key(M + K + N), 3)
    x, a, b = (
        h.rand(k, lay[n][0], dtype, NamedSharding(mesh, lay[n][1]))
        for k, n in ((kx, "x"), (ka, "a"), (kb, "b"))
    )
    dev0 = mesh.devices.flat[0]
    al, bl = (h.rand(k, s, dtype, dev0) for k, s in zip((ka, kb), lay["local"], strict=True))
    x_spec, ab_specs, out_specs = lay["x"][1], (lay["a"][1], lay["b"][1]), lay["out"]

    def smap(f: Callable[..., Any], in_specs: Any, out_spec: Any) -> Callable[..., Any]:
        return h.shard_jit(mesh, f, in_specs, out_spec)

    if kind == "ag":
        nccl = lambda x: lax.all_gather(x, "tp", axis=0, tiled=True)  # noqa: E731
        ours = lambda x: collectives.all_gather(x, "tp", axis=0)  # noqa: E731
    else:
        nccl = lambda x: lax.psum_scatter(x, "tp", scatter_dimension=0, tiled=True)  # noqa: E731
        ours = lambda x: collectives.reduce_scatter(x, "tp", axis=0)  # noqa: E731
    gemm_method = "cublaslt" if cuda else "xla"

    def bulk() -> tuple[Callable[..., Any], tuple[Any, ...]]:
        prim = primitive(kind)
        return smap(lambda x, a, b: prim(x, a, b, "tp", axis=0), (x_spec, *ab_specs), out_specs), (x, a, b)

    impls: dict[str, Thunk] = {
        "gemm_alone": lambda: (jax.jit(lambda a, b: jax_ub.matmul(a, b, method=gemm_method)), (al, bl)),
        "comm_nccl": lambda: (smap(nccl, (x_spec,), out_specs[0]), (x,)),
        "comm_jax_ub": lambda: (smap(ours, (x_spec,), out_specs[0]), (x,)),
        "xla_plain": lambda: (
            smap(lambda x, a, b: (nccl(x), a @ b), (x_spec, *ab_specs), out_specs),
            (x, a, b),
        ),
        "jax_ub": bulk,
    }
    if not cuda:
        del impls["comm_jax_ub"]
    elif kind == "ag":  # every peer pulled at once instead of the ring
        impls["jax_ub_all_peer"] = lambda: (
            smap(
                lambda x, a, b: primitive(kind)(x, a, b, "tp", axis=0, method="all_peer"),
                (x_spec, *ab_specs),
                out_specs,
            ),
            (x, a, b),
        )
    return impls


# ------------------------------------------------------------------------------------------------
# The runner of the subcommand

CHART = ["gemm_alone", "comm_nccl", "comm_jax_ub", "xla_plain", "jax_ub"]


def run(a: argparse.Namespace) -> int:
    cuda, path = h.path_info()
    print(path)
    timeline_ok = h.timeline_wanted(a, cuda, path)
    if not cuda:
        h.progress("comm_jax_ub skipped: the copy-engine collective needs the CUDA path")
    cases = list(h.cases(a, h.BULK_SHAPES))
    if not cases:
        return h.nothing_to_run(a, cuda)
    h.warn_gpu_sized_defaults(a, cuda, h.BULK_SHAPES)
    stem = h.out_stem(a, "bulk")
    out = h.Results(a, stem, path)
    rows = []
    for tp, M, K, N in cases:
        for kind in KINDS:  # a case each (own communicators: one failing leaves the other)
            case = {"op": f"bulk_{kind}", "M": M, "K": K, "N": N, "tp": tp}
            label = f"bulk_{kind} tp={tp} {M}x{K}x{N} {a.dtype}"
            with out.case({**case, "dtype": a.dtype}, label) as c:
                mesh = h.make_mesh(tp, cuda)
                impls = build(kind, mesh, M, K, N, dtype_name=a.dtype, cuda=cuda)
                c.res = h.time_impls(
                    label, impls, a, probe=h.Check(a.dtype), probes=c.rel_err, failures=out.failures
                )
                if timeline_ok and "jax_ub" in c.res:
                    tl = h.traced_case(a, stem, case, impls["jax_ub"])
                    timeline_ok = tl is not None
                    out.timelines += [tl] if tl else []
            rows.append((f"bulk_{kind}", tp, M, K, N, c.res))
    stop = out.finish()
    if stop is not None:
        return stop
    h.wrote(stem, draw(out.records, stem, a.dtype))
    print(
        f"{path}\nop       tp  M,K,N               gemm  ub_comm    nccl  xla_plain  jax_ub  "
        "jax_ub/max(gemm,ub_comm) (target <= 1.10)"
    )
    for op, tp, M, K, N, r in rows:
        g = lambda k, r=r: r.get(k, float("nan"))  # noqa: E731
        print(
            f"{op:<8} {tp:<3} {M},{K},{N:<10} {g('gemm_alone'):6.3f} {g('comm_jax_ub'):7.3f} "
            f"{g('comm_nccl'):7.3f} {g('xla_plain'):9.3f} {g('jax_ub'):7.3f}  "
            f"{h.ratio(r, 'jax_ub', 'gemm_alone', 'comm_jax_ub'):6.2f}"
        )
    return 0


def draw(records: list[dict], stem: str, dtype: str) -> bool:
    """``<stem>.png``: the bar chart of a bulk record file (also of a merged one)."""
    return h.plot(
        records,
        stem + ".png",
        f"jax_ub bulk overlap ({os.path.basename(stem)}, {dtype})",
        CHART,
        lambda r: f"{r['op']} tp{r['tp']}\n{r['M']}x{r['K']}x{r['N']}",
    )
