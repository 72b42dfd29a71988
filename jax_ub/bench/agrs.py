"""``python -m jax_ub.bench ag|rs``: AG→GEMM / GEMM→RS against XLA at global shapes (M, K, N).

The impls of a shape are listed in :mod:`jax_ub.bench.__main__`'s docstring; :func:`build` makes
them, :func:`run` times them (:func:`jax_ub.bench.harness.time_impls`), checks each op's output
against ``xla_plain``'s and ``comm_jax_ub``'s against ``comm_nccl``'s
(:class:`jax_ub.bench.harness.Check`: above the dtype's bound an impl gets no time and a failure),
writes the records after every shape and the chart at the end, and prints the table (speedup vs
``xla_plain``, T/T_ideal, the run's own noise, one geometric mean per tp). With ``--dtype fp8``
(:func:`build_fp8`) it times jax_ub's FP8 op against XLA's FP8 and against both bfloat16 ops, each
FP8 impl checked against ``xla_fp8``.
"""

from __future__ import annotations

import argparse
import functools
import operator
import os
import statistics
from collections.abc import Callable
from typing import Any

from jax_ub.bench import harness as h

CHART = ["gemm_alone", "comm_nccl", "comm_jax_ub", "xla_plain", "xla_windowed", "jax_ub"]
# --dtype fp8: jax_ub's FP8 op against XLA's FP8 (all-gather of float8 x, then lax.dot_general on
# float8 operands with preferred_element_type bfloat16) and against both ops in bfloat16.
FP8 = "fp8"
FP8_CHART = ["xla_plain", "jax_ub_bf16", "xla_fp8", "jax_ub_fp8"]


def _specs(op: str) -> tuple[Any, Any, Any]:
    """The partition specs of x, w and y: AG x[M/tp, K] @ w[K, N/tp] → y[M, N/tp]; RS
    x[M, K/tp] @ w[K/tp, N] → y[M/tp, N]."""
    from jax.sharding import PartitionSpec as P

    if op == "ag":
        return P("tp", None), P(None, "tp"), P(None, "tp")
    return P(None, "tp"), P("tp", None), P("tp", None)


def _xla_op(op: str, dot: Callable[..., Any]) -> Callable[..., Any]:
    """XLA's op around ``dot(x, w, *scales)`` inside ``shard_map``: AG all-gathers x before it, RS
    reduce-scatters its product."""
    from jax import lax

    if op == "ag":
        return lambda x, w, *scales: dot(lax.all_gather(x, "tp", tiled=True), w, *scales)
    return lambda x, w, *scales: lax.psum_scatter(dot(x, w, *scales), "tp", tiled=True)


def _jax_ub_op(op: str) -> Callable[..., Any]:
    """``jax_ub.all_gather_matmul`` (AG) or ``jax_ub.matmul_reduce_scatter`` (RS)."""
    import jax_ub

    return jax_ub.all_gather_matmul if op == "ag" else jax_ub.matmul_reduce_scatter


def _schedules(op: str) -> tuple[str, ...]:
    from jax_ub import methods

    return methods.SCHEDULES[methods.AG if op == "ag" else methods.RS]


def build_fp8(op: str, mesh: Any, M: int, K: int, N: int, cuda: bool) -> dict[str, Any]:
    """The impls of ``--dtype fp8`` (see :data:`FP8_CHART`; with the CUDA path also
    ``jax_ub_fp8_<method>`` per schedule). x and w are drawn in bfloat16 and quantized once to
    float8_e4m3fn with current scaling over the whole tensor (one scale each, so every rank's
    x scale is the same, as an all-gather needs); every FP8 impl multiplies the same float8 data.
    ``xla_plain`` and ``jax_ub_bf16`` take the bfloat16 x and w."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_ub import fp8, methods

    bf16, e4m3 = jnp.bfloat16, jnp.float8_e4m3fn
    kx, kw = jax.random.split(jax.random.key(M + K + N))
    x_spec, w_spec, y_spec = _specs(op)
    xs_, ws_ = NamedSharding(mesh, x_spec), NamedSharding(mesh, w_spec)
    x = h.rand(kx, (M, K), bf16, xs_)
    w = h.rand(kw, (K, N), bf16, ws_)
    rep = NamedSharding(mesh, P())
    quant = jax.jit(lambda t: fp8.quantize(t, e4m3))
    x8, sx = jax.jit(quant, out_shardings=(xs_, rep))(x)
    w8, sw = jax.jit(quant, out_shardings=(ws_, rep))(w)
    smap = functools.partial(h.shard_jit, mesh)

    def xla_dot(a8, b8, sa, sb):  # XLA's FP8 GEMM, the scales applied to its bfloat16 output
        y = lax.dot_general(a8, b8, (((a8.ndim - 1,), (0,)), ((), ())), preferred_element_type=bf16)
        return y * (sa * sb).astype(bf16)

    bf16_specs, fp8_specs = (x_spec, w_spec), (x_spec, w_spec, P(), P())
    ours = _jax_ub_op(op)
    impls: dict[str, Any] = {
        "xla_plain": (smap(_xla_op(op, operator.matmul), bf16_specs, y_spec), (x, w)),
        "xla_fp8": (smap(_xla_op(op, xla_dot), fp8_specs, y_spec), (x8, w8, sx, sw)),
        "jax_ub_bf16": (smap(lambda x, w: ours(x, w, "tp"), bf16_specs, y_spec), (x, w)),
    }
    for m in [methods.AUTO, *_schedules(op)] if cuda else [methods.AUTO]:
        name = "jax_ub_fp8" if m == methods.AUTO else f"jax_ub_fp8_{m}"
        impls[name] = (
            smap(lambda x, w, a, b, m=m: ours(x, w, "tp", method=m, scales=(a, b)), fp8_specs, y_spec),
            (x8, w8, sx, sw),
        )
    return impls


def build(op: str, mesh: Any, M: int, K: int, N: int, dtype_name: str, cuda: bool) -> dict[str, Any]:
    """``{impl: (fn, args) or a thunk returning it}``; each :func:`jax_ub.bench.harness.reference`
    (``comm_nccl``, ``xla_plain``) comes before the impls checked against it."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_ub
    from jax_ub import collectives, methods

    dtype = jnp.dtype(dtype_name)
    tp = mesh.shape["tp"]
    kx, kw = jax.random.split(jax.random.key(M + K + N))
    x_spec, w_spec, y_spec = _specs(op)

    def rand(key, shape, where):
        return h.rand(key, shape, dtype, where)

    x = rand(kx, (M, K), NamedSharding(mesh, x_spec))
    w = rand(kw, (K, N), NamedSharding(mesh, w_spec))
    smap = functools.partial(h.shard_jit, mesh)
    impls: dict[str, Any] = {}
    dev0 = mesh.devices.flat[0]
    gemm = jax.jit(lambda a, b: jax_ub.matmul(a, b, method="cublaslt" if cuda else "xla"))

    def local_gemm(a, b):  # one GPU's GEMM, stacked over the mesh by shard_map
        return jax_ub.matmul(a, b, method="cublaslt" if cuda else "xla")[None]

    # The entries that need arrays of their own are thunks (built when timed), so a caller that
    # keeps only some impls (bench tune) allocates nothing for the others.
    if op == "ag":  # every GPU: the gathered x (replicated) @ its w shard
        impls["gemm_all_gpus"] = lambda: (
            smap(local_gemm, (P(), w_spec), P("tp", None, None)),
            (jax.device_put(x, NamedSharding(mesh, P())), w),
        )
    else:  # every GPU: its x shard @ its w shard, the whole partial
        impls["gemm_all_gpus"] = (smap(local_gemm, (x_spec, w_spec), P("tp", None, None)), (x, w))

    def chunk_gemms(*args):  # tp chunks then w: the row-chunk GEMMs an overlapped op runs
        *chunks, b = args
        return tuple(local_gemm(c, b) for c in chunks)

    def gemm_chunks():  # every GPU: its tp row-chunk GEMMs back to back, no communication
        m = M // tp
        # AG: chunks of the gathered x (replicated) @ its w shard; RS: row chunks (one per owner)
        # of its x shard @ its w shard.
        spec = P() if op == "ag" else x_spec
        chunks = [jax.device_put(x[i * m : (i + 1) * m], NamedSharding(mesh, spec)) for i in range(tp)]
        out = tuple(P("tp", None, None) for _ in range(tp))
        return smap(chunk_gemms, (*(spec,) * tp, w_spec), out), (*chunks, w)

    impls["gemm_chunks"] = gemm_chunks
    if op == "ag":
        impls["gemm_alone"] = lambda: (gemm, (rand(kx, (M, K), dev0), rand(kw, (K, N // tp), dev0)))
        impls["comm_nccl"] = (smap(lambda x: lax.all_gather(x, "tp", tiled=True), (x_spec,), P()), (x,))
        impls["comm_jax_ub"] = (smap(lambda x: collectives.all_gather(x, "tp"), (x_spec,), P()), (x,))
    else:

        @functools.cache
        def partials():  # the collectives' input, made once for both
            return rand(kx, (M * tp, N), NamedSharding(mesh, P("tp", None)))

        impls["gemm_alone"] = lambda: (gemm, (rand(kx, (M, K // tp), dev0), rand(kw, (K // tp, N), dev0)))
        impls["comm_nccl"] = lambda: (
            smap(lambda p: lax.psum_scatter(p, "tp", tiled=True), (P("tp", None),), P("tp", None)),
            (partials(),),
        )
        impls["comm_jax_ub"] = lambda: (
            smap(lambda p: collectives.reduce_scatter(p, "tp"), (P("tp", None),), P("tp", None)),
            (partials(),),
        )
    impls["xla_plain"] = (smap(_xla_op(op, operator.matmul), (x_spec, w_spec), y_spec), (x, w))
    ours = _jax_ub_op(op)
    for m in (methods.AUTO, *_schedules(op)):
        if m == methods.PUSH_MERGE and tp < methods.PUSH_MERGE_MIN_TP:
            continue  # below PUSH_MERGE_MIN_TP push_merge (an AG schedule) is push's program
        name = "jax_ub" if m == methods.AUTO else f"jax_ub_{m}"
        impls[name] = (smap(lambda x, w, m=m: ours(x, w, "tp", method=m), (x_spec, w_spec), y_spec), (x, w))

    def windowed(flags):  # XLA's windowed einsum: the jit-partitioned dot, sharded operands and output
        fw = jax.jit(lambda x, w: jnp.dot(x, w), out_shardings=NamedSharding(mesh, y_spec))
        return lambda: (fw.lower(x, w).compile(compiler_options=flags), (x, w))

    impls["xla_windowed"] = windowed(h.WINDOWED_FLAGS)
    impls["xla_windowed_nccl"] = windowed(h.WINDOWED_NCCL_FLAGS)  # without the local peer memcpys
    if not cuda:  # the copy-engine collective and the explicit CUDA algorithms need the CUDA path
        for name in [n for n in impls if n == "comm_jax_ub" or n.startswith("jax_ub_")]:
            del impls[name]
    return impls


def run(a: argparse.Namespace) -> int:
    cuda, path = h.path_info()
    print(path)
    cases = list(h.cases(a, h.DEFAULT_SHAPES))
    if not cases:
        return h.nothing_to_run(a, cuda)
    h.warn_gpu_sized_defaults(a, cuda, h.DEFAULT_SHAPES)
    # FP8 runs keep their own file (their impls and dtype differ; the table `auto` reads takes the
    # bf16/fp16/fp32 files only).
    stem = h.out_stem(a, a.op + ("-fp8" if a.dtype == FP8 else ""))
    out = h.Results(a, stem, path)
    timeline_ok = h.timeline_wanted(a, cuda, path)
    op_name = "ag_gemm" if a.op == "ag" else "gemm_rs"
    rows = []
    for tp, M, K, N in cases:
        label = f"{a.op} tp={tp} {M}x{K}x{N} {a.dtype}"
        auto = "-"
        with out.case({"op": op_name, "M": M, "K": K, "N": N, "tp": tp, "dtype": a.dtype}, label) as c:
            mesh = h.make_mesh(tp, cuda)
            if a.dtype == FP8:
                impls = build_fp8(a.op, mesh, M, K, N, cuda)
            else:
                impls = build(a.op, mesh, M, K, N, a.dtype, cuda)
            c.res = h.time_impls(
                label, impls, a, probe=h.Check(a.dtype), probes=c.rel_err, failures=out.failures
            )
            traced = "jax_ub" if a.timeline_method == "auto" else f"jax_ub_{a.timeline_method}"
            if timeline_ok and traced in c.res:
                tl = h.traced_case(
                    a,
                    stem,
                    {
                        "M": M,
                        "K": K,
                        "N": N,
                        "tp": tp,
                        **({"method": a.timeline_method} if traced != "jax_ub" else {}),
                    },
                    impls[traced],
                )
                timeline_ok = tl is not None  # a skip says why once, then no more tries
                out.timelines += [tl] if tl else []
            dt = "float8_e4m3fn" if a.dtype == FP8 else a.dtype
            auto = auto_method(a.op, tp, M, K, N, dt) if cuda else "xla"
            c.extra["jax_ub"] = {"method": auto}  # what auto ran (jax_ub._measured ignores this key)
        rows.append((tp, M, K, N, c.res, auto))
    stop = out.finish()
    if stop is not None:
        return stop
    h.wrote(stem, draw(out.records, stem, a.op, a.dtype))
    if a.dtype == FP8:
        _table_fp8(a.op, rows, path)
    else:
        _table(a.op, rows, path)
    return 0


def _table_fp8(op: str, rows: list, path: str) -> None:
    """ms per op of ``--dtype fp8``'s impls, and jax_ub FP8's speedups against XLA's FP8 and
    against jax_ub's bfloat16 op."""
    print(
        f"{path}\ntp  M,K,N               xla_bf16  jax_ub_bf16  xla_fp8  jax_ub_fp8  (auto runs)  "
        "fp8 vs xla_fp8  fp8 vs jax_ub_bf16"
    )
    for tp, M, K, N, r, auto in rows:
        g = lambda k, r=r: r.get(k, float("nan"))  # noqa: E731
        print(
            f"{tp:<3} {M},{K},{N:<10} {g('xla_plain'):8.3f} {g('jax_ub_bf16'):12.3f} {g('xla_fp8'):8.3f} "
            f"{g('jax_ub_fp8'):11.3f}  ({auto:<8})  {h.ratio(r, 'xla_fp8', 'jax_ub_fp8'):13.2f}x  "
            f"{h.ratio(r, 'jax_ub_bf16', 'jax_ub_fp8'):17.2f}x"
        )
    methods_run = sorted({i for *_, r, _ in rows for i in r if i.startswith("jax_ub_fp8_")})
    for name in methods_run:
        print(
            f"{name}: "
            + ", ".join(
                f"tp{tp} {M},{K},{N} {r.get(name, float('nan')):.3f} ms" for tp, M, K, N, r, _ in rows
            )
        )


def draw(records: list[dict], stem: str, op: str, dtype: str) -> bool:
    """``<stem>.png``: the bar chart of an ag or rs record file (also of a merged one)."""
    return h.plot(
        records,
        stem + ".png",
        f"jax_ub {op} ({os.path.basename(stem)}, {dtype})",
        FP8_CHART if dtype == FP8 else CHART,
        lambda r: f"tp{r['tp']}\n{r['M']}x{r['K']}x{r['N']}",
    )


def auto_method(op: str, tp: int, M: int, K: int, N: int, dtype: str) -> str:
    """The method ``method="auto"`` runs at this global shape (the bench's communicator is still
    up): AG x[M/tp, K] @ w[K, N/tp]; RS x[M, K/tp] @ w[K/tp, N]."""
    from jax_ub import resolve

    x, w = ((M // tp, K), (K, N // tp)) if op == "ag" else ((M, K // tp), (K // tp, N))
    return resolve.choose(op, x, w, dtype, "tp")


def same_program_spread(rows: list) -> list[float]:
    """|jax_ub / jax_ub_<method auto ran> - 1| per row: one program timed twice in one run (two
    compilations of the same schedule), so the run's own noise. Differences between impls smaller
    than this are not resolved by the run."""
    out = []
    for *_, r, auto in rows:
        twin = h.twin_impl(auto)
        spread = h.ratio(r, "jax_ub", twin)
        if spread == spread:
            out.append(abs(spread - 1.0))
    return out


def _table(op: str, rows: list, path: str) -> None:
    alts = "ring/all_peer" if op == "ag" else "ring/pipeline/chain"
    print(
        f"{path}\ntp  M,K,N               gemm   nccl  ub_comm  xla_plain  windowed  (nccl)  "
        "jax_ub  (auto runs)  "
        f"({alts})  speedup  T/T_ideal  (gemm on all GPUs, T/max(it, ub_comm); in tp row "
        f"chunks, T/max(them, ub_comm))"
    )
    for tp, M, K, N, r, auto in rows:
        g = lambda k, r=r: r.get(k, float("nan"))  # noqa: E731
        alt = (
            f"{g('jax_ub_all_peer'):.3f}"
            if op == "ag"
            else f"{g('jax_ub_pipeline'):.3f}/{g('jax_ub_chain'):.3f}"
        )
        print(
            f"{tp:<3} {M},{K},{N:<10} {g('gemm_alone'):6.3f} {g('comm_nccl'):6.3f} {g('comm_jax_ub'):7.3f} "
            f"{g('xla_plain'):9.3f} {g('xla_windowed'):9.3f} {g('xla_windowed_nccl'):7.3f} "
            f"{g('jax_ub'):7.3f}  ({auto:<8})  "
            f"{g('jax_ub_ring'):.3f}/{alt}  {h.ratio(r, 'xla_plain', 'jax_ub'):6.2f}x  "
            f"{h.ratio(r, 'jax_ub', 'gemm_alone', 'comm_jax_ub'):8.2f}"
            f"  ({g('gemm_all_gpus'):.3f}, {h.ratio(r, 'jax_ub', 'gemm_all_gpus', 'comm_jax_ub'):.2f}; "
            f"{g('gemm_chunks'):.3f}, {h.ratio(r, 'jax_ub', 'gemm_chunks', 'comm_jax_ub'):.2f})"
        )
    unchained = sorted(
        {i for *_, r, _ in rows for i in r if h.chain_of(r, i) < max(h.chain_of(r, j) for j in r)}
    )
    if unchained:  # --chain N, and compiled programs, which chain_fn cannot chain
        print(f"timed one op per dispatch (not chainable; the others chained): {', '.join(unchained)}")
    for tp in dict.fromkeys(row[0] for row in rows):  # the targets are per tp
        speedups = [h.ratio(row[4], "xla_plain", "jax_ub") for row in rows if row[0] == tp]
        gm = h.geomean(speedups)
        k = sum(v == v for v in speedups)
        print(
            f"tp={tp}: geometric mean speedup vs xla_plain: "
            + (
                f"{gm:.2f}x over {k} of {len(speedups)} shapes"
                if gm is not None
                else f"none (no shape of {len(speedups)} has both times)"
            )
        )
    from jax_ub.methods import PUSH_MERGE_MIN_TP

    merged = [
        (tp, M, K, N, r)
        for tp, M, K, N, r, _ in rows
        if "jax_ub_push_merge" in r and "jax_ub_push" in r and tp >= PUSH_MERGE_MIN_TP
    ]
    if merged:
        print(
            "push_merge / push: "
            + ", ".join(
                f"tp{tp} {M},{K},{N} {_ratio_text(r, 'jax_ub_push_merge', 'jax_ub_push')}"
                for tp, M, K, N, r in merged
            )
        )
    spread = same_program_spread(rows)
    if spread:
        print(
            f"same program timed twice (jax_ub and jax_ub_<the method auto runs>): differ by "
            f"{100 * statistics.median(spread):.1f}% (median), {100 * max(spread):.1f}% (max) "
            f"over {len(spread)} shapes: this run's noise"
        )


def _ratio_text(r: dict[str, float], num: str, den: str) -> str:
    """``num / den`` of two timed impls, or why not: timed with different ops per dispatch."""
    x = h.ratio(r, num, den)
    return f"{x:.3f}" if x == x else f"n/a (chain {h.chain_of(r, num)} against {h.chain_of(r, den)})"
