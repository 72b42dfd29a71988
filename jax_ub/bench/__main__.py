"""``python -m jax_ub.bench ag|rs|mlp|bulk|tune [options]`` (``--help`` on each for its options).

``ag`` / ``rs`` — for each global shape (M, K, N) and tp, in one process and one run, the median
milliseconds of:

* ``gemm_alone``   cuBLASLt GEMM of the whole local problem on one GPU (AG: x_gathered[M, K] @
  w[K, N/tp]; RS: x[M, K/tp] @ w[K/tp, N]);
* ``gemm_all_gpus`` the same GEMM on every GPU of the mesh at once (no communication): what a GEMM
  costs while the whole machine computes, as in every overlapped op (power and clocks are shared);
* ``comm_nccl``    XLA's own collective alone (``lax.all_gather`` / ``lax.psum_scatter``, NCCL);
* ``comm_jax_ub``  jax_ub's collective alone (copy engine);
* ``xla_plain``    collective then dot in ``shard_map`` (no overlap);
* ``xla_windowed`` the jit-partitioned dot with XLA's windowed-einsum flags;
* ``jax_ub``       the overlapped op (``method="auto"``), plus ``jax_ub_<algo>`` per algorithm.

With ``--timeline`` (``ag``, ``rs``, ``bulk``; CUDA path only), each shape's ``jax_ub`` op also
runs traced (``jax_ub.overlap.trace_enable``/``trace_collect``), ``TIMELINE_CALLS`` calls back to
back of which the last is kept (a lone call after a sync starts cold): a Gantt PNG per shape
(``<stem>-timeline-[<op>-]tp<tp>-<M>x<K>x<N>.png``, see :mod:`jax_ub.bench.timeline`) and the records
under the JSON's ``"timelines"`` key: ``[{"M", "K", "N", "tp", "dtype", "impl", "records"}, ...]``.

``mlp`` — forward+backward step of ``ParallelMLP`` (plain and gated, ``--models``) and of the
attention-projection pair with jax_ub's layers: ``jax_ub`` vs ``xla_plain`` vs ``xla_windowed``
(see :mod:`jax_ub.bench.mlp`).

``tune SHAPES.json`` — every method at the shapes a program recorded (``JAX_UB_RECORD_SHAPES``),
written as a file for ``JAX_UB_TUNING_FILE`` (see :mod:`jax_ub.bench.tune`, :mod:`jax_ub.tuning`).

``bulk`` — an all-gather / reduce-scatter under an independent GEMM (the backward pass's bulk
overlap): the collective and the GEMM alone, XLA's program, and ``jax_ub.bulk_all_gather`` /
``bulk_reduce_scatter`` (see :mod:`jax_ub.bench.bulk`).

Off the CUDA path (CPU, ``JAX_UB_DISABLE=1``) everything runs with jax_ub on its pure-XLA reference
("path: xla-reference"), which is how the harness is tested; CUDA-only impls are skipped.

Timing: every impl of a shape is built and warmed up, then ``reps`` interleaved repetitions (each
times every impl once, in a shuffled order) of ``iters`` back-to-back dispatches closed by one
``block_until_ready``, each after an untimed ``--settle-ms`` burst of the same impl (the GPU's
clocks under its power cap follow the last few ms of load); the median per-call time is recorded.
With ``--chain N`` (``ag``, ``rs``, ``bulk``; ``tune`` defaults to 8) a call runs the op N times in a
row in one program (:func:`chain_fn`) and the time per op is recorded: a lone dispatch of a small op
is bound by the host, which a model's step, many ops per dispatch, is not. Writes
``<out>/<machine>-<yyyymmdd>-<op>.json`` (``{"machine", "date", "jax", "path", "records": [{"op",
..., "tp", "dtype", "impl", "ms"}, ...]}``) and a PNG bar chart beside it, prints a table last.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

DEFAULT_SHAPES = [(8192, 8192, 28672), (8192, 8192, 8192), (16384, 12288, 12288), (2048, 8192, 28672)]
BULK_SHAPES = DEFAULT_SHAPES[:3]
WINDOWED_FLAGS = {
    "xla_gpu_threshold_for_windowed_einsum_mib": 0,
    "xla_gpu_multi_streamed_windowed_einsum": True,
    "xla_gpu_use_memcpy_local_p2p": True,
}
AG_RS_CHART = ["gemm_alone", "comm_nccl", "comm_jax_ub", "xla_plain", "xla_windowed", "jax_ub"]
MLP_MODELS = ("mlp", "attn_proj", "swiglu")  # jax_ub.bench.mlp.MODELS, without importing jax here
MLP_CHART = ["xla_plain", "xla_windowed", "jax_ub", "jax_ub_base_policy", "no_comm"]
BULK_CHART = ["gemm_alone", "comm_nccl", "comm_jax_ub", "xla_plain", "jax_ub"]


def _progress(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------
# Shared: timing, mesh, records, JSON, chart.


def _burst(fn, args, iters: int) -> float:
    """Per-call ms of ``iters`` back-to-back dispatches closed by one ``block_until_ready``."""
    import jax

    t0 = time.perf_counter()
    out = None
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) * 1e3 / iters


def time_fn(fn, args, *, warmup: int, iters: int, reps: int) -> float:
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    return statistics.median(_burst(fn, args, iters) for _ in range(reps))


def settle_calls(est_ms: float, settle_ms: float, iters: int) -> int:
    """Untimed calls of an impl right before each of its timed bursts: enough to run ``settle_ms``
    at ``est_ms`` per call (at least 1, at most ``4 * iters``); 0 when ``settle_ms <= 0``."""
    if settle_ms <= 0:
        return 0
    return max(1, min(4 * iters, math.ceil(settle_ms / max(est_ms, 1e-6))))


def shard_jit(mesh: Any, f: Any, in_specs: Any, out_specs: Any) -> Any:
    """``jax.jit(jax.shard_map(f, ...))`` over ``mesh`` (no replication check); :func:`chain_fn`
    chains it through its ``__wrapped__``."""
    import jax

    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False))


def chain_fn(fn: Any, n: int) -> Any | None:
    """A jitted program running ``fn``'s body ``n`` times in a row, each call after the previous
    one's output (an optimization barrier orders them; every output is returned, so none is dead
    code), or None when ``fn`` is not a ``jax.jit`` of a Python function (e.g. a compiled
    executable). One dispatch then pays for ``n`` ops, as in a model's step: on 2xH200 a lone
    dispatch of a small op was bound by the host (tp=2 RS 16384,1024,1024: 0.158 ms per
    dispatch, 0.100 ms per op chained 8 times; XLA's 0.160 and 0.131)."""
    import jax
    from jax import lax

    inner = getattr(fn, "__wrapped__", None)
    if n <= 1 or inner is None or not callable(inner):
        return None

    def run(*args):
        outs = []
        for _ in range(n):
            out = inner(*args)
            args, out = lax.optimization_barrier((args, out))
            outs.append(out)
        return tuple(outs)

    return jax.jit(run)


def time_impls(label: str, impls: dict[str, Any], a: argparse.Namespace,
               probe: Callable[[Any], Any] | None = None, probes: dict[str, Any] | None = None,
               ) -> dict[str, float]:
    """Median ms of each impl; an entry is ``(fn, args)`` or a thunk returning it (built here, so a
    failure to build is reported like a failure to run: one progress line, no record). With
    ``probe``, ``probes[name] = probe(fn(*args))`` of one more call (e.g. a loss to compare).

    Every impl is built and warmed up first; then the repetitions are interleaved: repetition r
    times each impl once, in an order shuffled by r (seeded), so a drift of clocks or power during
    the run weighs on every impl alike. Each timed burst follows an untimed burst of the same impl
    (``a.settle_ms`` of it, see :func:`settle_calls`): a GPU at its power cap runs at clocks that
    depend on the load of the last few ms, so without it an impl timed after a light one (a
    collective) ran up to 10% faster than the same program timed after a GEMM (2xH200, tp=2,
    8192,8192,28672: 2.745 against 3.072 ms)."""
    import random

    import jax

    ready: dict[str, tuple[Any, Any]] = {}
    settle: dict[str, int] = {}
    per_call: dict[str, int] = {}  # ops per timed call (a.chain where the impl can be chained)
    settle_ms = getattr(a, "settle_ms", 25.0)
    chain = getattr(a, "chain", 1)
    for name, entry in impls.items():
        _progress(f"{label}: {name}")
        try:
            fn, args = entry() if callable(entry) else entry
            chained = chain_fn(fn, chain)
            if chain > 1 and chained is None:
                _progress(f"  {name}: not chained (one op per dispatch)")
            fn, per_call[name] = (chained, chain) if chained is not None else (fn, 1)
            for _ in range(a.warmup):
                jax.block_until_ready(fn(*args))
            if probe is not None and probes is not None:
                probes[name] = probe(fn(*args))
            settle[name] = settle_calls(_burst(fn, args, 2), settle_ms, a.iters) if settle_ms > 0 else 0
            ready[name] = (fn, args)
        except Exception as e:
            _progress(f"  {name} failed: {type(e).__name__}: {str(e)[:300]}")
    samples: dict[str, list[float]] = {name: [] for name in ready}
    host: dict[str, list[dict]] = {name: [] for name in ready}  # host_stats deltas of the bursts
    names = list(ready)
    for r in range(a.reps):
        for name in random.Random(r).sample(names, len(names)):
            if name not in ready:
                continue
            try:
                if settle[name]:
                    _burst(*ready[name], settle[name])
                h0 = _host_stats()
                samples[name].append(_burst(*ready[name], a.iters))
                host[name].append(_host_delta(h0, _host_stats()))
            except Exception as e:
                _progress(f"  {name} failed: {type(e).__name__}: {str(e)[:300]}")
                del ready[name]
                samples[name] = []
    line = host_line(host)
    if line:
        _progress(f"  {line}")
    return {name: statistics.median(ms) / per_call[name] for name, ms in samples.items() if ms}


def _host_stats() -> dict:
    from jax_ub import comm

    return comm.host_stats()


def _host_delta(h0: dict, h1: dict) -> dict:
    """Per device: ops run and host seconds spent enqueueing them between two host_stats."""
    return {k: {f: h1[k][f] - h0[k][f] for f in h1[k]} for k in h1 if k in h0}


def host_line(host: dict[str, list[dict]]) -> str:
    """``host us per op`` of every impl that ran jax_ub ops (the slowest device's enqueueing, and
    of it the wait for same-process peers): near the ms per op, the impl is bound by the host."""
    parts = []
    for name, deltas in host.items():
        ops = sum(d[k]["ops"] for d in deltas for k in d)
        if not ops:
            continue
        n_dev = max(len(d) for d in deltas)
        per_dev = ops / n_dev
        spent, waited = max((sum(d[k]["host_s"] for d in deltas if k in d),
                             sum(d[k]["meet_s"] for d in deltas if k in d)) for k in deltas[0])
        parts.append(f"{name} {spent / per_dev * 1e6:.0f} ({waited / per_dev * 1e6:.0f})")
    return "host us per op (of it waiting for peers): " + ", ".join(parts) if parts else ""


def _machine() -> str:
    try:
        import jax

        kind = jax.devices()[0].device_kind.replace(" ", "_")
        return f"{len(jax.devices())}x{kind}"
    except Exception:
        return socket.gethostname()


def path_info() -> tuple[bool, str]:
    """(CUDA path active, ``"path: cuda"`` or ``"path: xla-reference (why)"``)."""
    import jax_ub

    info = jax_ub.build_info()
    if info["cuda_path"]:
        return True, "path: cuda"
    return False, f"path: xla-reference ({info['reason']})"


def make_mesh(tp: int, cuda: bool) -> Any:
    """1-D ``("tp",)`` mesh of the first ``tp`` devices, with jax_ub's communicators on CUDA."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    import jax_ub

    mesh = Mesh(np.array(jax.devices()[:tp]), ("tp",))
    if cuda:
        jax_ub.initialize(mesh, "tp")
    return mesh


def case_records(common: dict[str, Any], res: dict[str, float]) -> list[dict[str, Any]]:
    return [{**common, "impl": impl, "ms": round(ms, 4)} for impl, ms in res.items()]


def write_json(a: argparse.Namespace, stem: str, records: list[dict], **extra: Any) -> None:
    import jax

    if getattr(a, "chain", 1) > 1:
        extra = {"chain": a.chain, **extra}  # ms are per op, CHAIN ops per dispatch
    with open(stem + ".json", "w") as f:
        json.dump({"machine": a.machine, "date": a.date, "jax": jax.__version__, **extra,
                   "records": records}, f, indent=1, default=_plain)


def _plain(o: Any) -> Any:
    """JSON for numpy scalars and anything else a trace record may hold."""
    return o.item() if hasattr(o, "item") else str(o)


def out_stem(a: argparse.Namespace, tag: str) -> str:
    """``<out>/<machine>-<yyyymmdd>-<tag>`` (the folder is created)."""
    os.makedirs(a.out, exist_ok=True)
    return os.path.join(a.out, f"{a.machine}-{a.date}-{tag}")


def plot(records: list[dict], path: str, title: str, impls: Sequence[str],
         case_label: Callable[[dict], str]) -> bool:
    """Grouped bar chart: one group per case (``case_label``, first-seen order), one bar per impl.
    Returns whether the PNG was written (False without matplotlib or records)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _progress("matplotlib missing: no PNG")
        return False
    cases = list(dict.fromkeys(case_label(r) for r in records))
    impls = [i for i in impls if any(r["impl"] == i for r in records)]
    if not cases or not impls:
        return False
    fig, ax = plt.subplots(figsize=(max(8, 2.2 * len(cases)), 4.5))
    width = 0.8 / len(impls)
    for j, impl in enumerate(impls):
        vals = [next((r["ms"] for r in records if case_label(r) == c and r["impl"] == impl), 0.0)
                for c in cases]
        ax.bar([i + j * width for i in range(len(cases))], vals, width, label=impl)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))])
    ax.set_xticklabels(cases, fontsize=8)
    ax.set_ylabel("ms (median)")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _wrote(stem: str, png: bool) -> None:
    print(f"\nwrote {stem}.json" + (f" and {stem}.png" if png else " (no PNG)"))


def _ideal(*ms: float) -> float:
    """max(ms), or NaN when one is missing (max() would silently drop a NaN)."""
    return float("nan") if any(m != m for m in ms) else max(ms)


def _geomean(values: Sequence[float]) -> float | None:
    good = [v for v in values if v == v and v > 0]
    return math.exp(sum(map(math.log, good)) / len(good)) if good else None


def _shapes(a: argparse.Namespace, default: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    if not a.shapes:
        return default
    return [tuple(int(v) for v in s.split(",")) for s in a.shapes]  # type: ignore[misc]


def _cases(a: argparse.Namespace, default: list[tuple[int, int, int]]):
    """(tp, M, K, N) to run, skipping (with a progress line) what the devices/tp cannot do."""
    import jax

    for tp in a.tp:
        if tp > len(jax.devices()):
            _progress(f"skip tp={tp}: only {len(jax.devices())} devices")
            continue
        for M, K, N in _shapes(a, default):
            if M % tp or K % tp or N % tp:
                _progress(f"skip {M}x{K}x{N}: not divisible by tp={tp}")
                continue
            yield tp, M, K, N


def _nothing_to_run(a: argparse.Namespace) -> int:
    """Exit status 2 with a message for a run whose every case was skipped (no JSON is written:
    an empty record file would only mislead a later merge)."""
    import jax

    print(f"error: nothing to measure with --tp {' '.join(map(str, a.tp))} on {len(jax.devices())} "
          f"device(s): each tp needs that many devices and shapes whose M, K and N it divides "
          f"(the skip lines above say which)", file=sys.stderr)
    return 2


# ------------------------------------------------------------------------------------------------
# ag / rs


def agrs_impls(op: str, mesh: Any, M: int, K: int, N: int, dtype_name: str, cuda: bool) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_ub
    from jax_ub import overlap

    dtype = jnp.dtype(dtype_name)
    tp = mesh.shape["tp"]
    kx, kw = jax.random.split(jax.random.key(M + K + N))
    if op == "ag":
        x_spec, w_spec, y_spec = P("tp", None), P(None, "tp"), P(None, "tp")
    else:
        x_spec, w_spec, y_spec = P(None, "tp"), P("tp", None), P("tp", None)

    def rand(key, shape, where):
        return jax.device_put(jax.random.normal(key, shape, jnp.float32).astype(dtype), where)

    x = rand(kx, (M, K), NamedSharding(mesh, x_spec))
    w = rand(kw, (K, N), NamedSharding(mesh, w_spec))

    def smap(f, in_specs, out_specs):
        return shard_jit(mesh, f, in_specs, out_specs)

    impls: dict[str, Any] = {}
    dev0 = mesh.devices.flat[0]
    gemm = jax.jit(lambda a, b: jax_ub.matmul(a, b, method="cublaslt" if cuda else "xla"))

    def local_gemm(a, b):  # one GPU's GEMM, stacked over the mesh by shard_map
        return jax_ub.matmul(a, b, method="cublaslt" if cuda else "xla")[None]

    # The entries that need arrays of their own are thunks (built when timed), so a caller that
    # keeps only some impls (bench tune) allocates nothing for the others.
    if op == "ag":  # every GPU: the gathered x (replicated) @ its w shard
        impls["gemm_all_gpus"] = lambda: (smap(local_gemm, (P(), w_spec), P("tp", None, None)),
                                          (jax.device_put(x, NamedSharding(mesh, P())), w))
    else:  # every GPU: its x shard @ its w shard, the whole partial
        impls["gemm_all_gpus"] = (smap(local_gemm, (x_spec, w_spec), P("tp", None, None)), (x, w))
    if op == "ag":
        impls["gemm_alone"] = lambda: (gemm, (rand(kx, (M, K), dev0), rand(kw, (K, N // tp), dev0)))
        impls["comm_nccl"] = (smap(lambda x: lax.all_gather(x, "tp", tiled=True), (x_spec,), P()), (x,))
        impls["comm_jax_ub"] = (smap(lambda x: overlap.all_gather(x, "tp"), (x_spec,), P()), (x,))
        impls["xla_plain"] = (smap(lambda x, w: lax.all_gather(x, "tp", tiled=True) @ w, (x_spec, w_spec), y_spec), (x, w))
        for m in ("auto", "push", "ring", "all_peer"):
            name = "jax_ub" if m == "auto" else f"jax_ub_{m}"
            impls[name] = (smap(lambda x, w, m=m: jax_ub.all_gather_matmul(x, w, "tp", method=m),
                                (x_spec, w_spec), y_spec), (x, w))
    else:
        @functools.cache
        def partials():  # the collectives' input, made once for both
            return rand(kx, (M * tp, N), NamedSharding(mesh, P("tp", None)))

        impls["gemm_alone"] = lambda: (gemm, (rand(kx, (M, K // tp), dev0), rand(kw, (K // tp, N), dev0)))
        impls["comm_nccl"] = lambda: (smap(lambda p: lax.psum_scatter(p, "tp", tiled=True), (P("tp", None),),
                                           P("tp", None)), (partials(),))
        impls["comm_jax_ub"] = lambda: (smap(lambda p: overlap.reduce_scatter(p, "tp"), (P("tp", None),),
                                             P("tp", None)), (partials(),))
        impls["xla_plain"] = (smap(lambda x, w: lax.psum_scatter(x @ w, "tp", tiled=True), (x_spec, w_spec), y_spec), (x, w))
        for m in ("auto", "ring", "pipeline", "chain", "columns"):
            name = "jax_ub" if m == "auto" else f"jax_ub_{m}"
            impls[name] = (smap(lambda x, w, m=m: jax_ub.matmul_reduce_scatter(x, w, "tp", method=m),
                                (x_spec, w_spec), y_spec), (x, w))

    def windowed():  # XLA's windowed einsum: the jit-partitioned dot with sharded operands and output
        fw = jax.jit(lambda x, w: jnp.dot(x, w), out_shardings=NamedSharding(mesh, y_spec))
        return fw.lower(x, w).compile(compiler_options=WINDOWED_FLAGS), (x, w)

    impls["xla_windowed"] = windowed
    if not cuda:  # the copy-engine collective and the explicit CUDA algorithms need the CUDA path
        for name in [n for n in impls if n == "comm_jax_ub" or n.startswith("jax_ub_")]:
            del impls[name]
    return impls


TIMELINE_CALLS = 4


def capture_timeline(fn: Any, args: Sequence[Any], calls: int = TIMELINE_CALLS,
                     ) -> tuple[list[dict] | None, str]:
    """Runs ``fn(*args)`` ``calls`` times back to back with jax_ub's tracing on and returns the last
    call's records: (records, "") or (None, why not). One call right after a host sync starts
    cold: on 2xH200 its first GEMM piece took 0.21-0.30 ms against 0.18 ms in every later call
    (scripts/rs_piece_probe.py), so a picture of it misstates where the time goes."""
    import jax

    from jax_ub import overlap

    try:
        enable, collect = overlap.trace_enable, overlap.trace_collect
    except AttributeError:
        return None, ("jax_ub.overlap.trace_enable/trace_collect do not exist in this jax_ub "
                      "(tracing not implemented yet)")
    try:
        enable(True)
        try:
            collect()  # drop records of earlier calls
            jax.block_until_ready([fn(*args) for _ in range(max(calls, 1))])
            return last_call(list(collect()), max(calls, 1)), ""
        finally:
            enable(False)
    except Exception as e:  # e.g. an extension built without tracing
        return None, f"tracing failed: {type(e).__name__}: {str(e)[:300]}"


def last_call(records: list[dict], calls: int) -> list[dict]:
    """The records of the last of ``calls`` identical calls: per device, the latest epochs, as
    many as one call runs ops (its epoch count / ``calls``; the latest one if that is not whole).
    Records without an epoch are all kept."""
    epochs: dict[Any, set[int]] = {}
    for r in records:
        if "epoch" in r:
            epochs.setdefault(r.get("device"), set()).add(int(r["epoch"]))
    keep: dict[Any, set[int]] = {}
    for dev, es in epochs.items():
        per_call = len(es) // calls if len(es) % calls == 0 and len(es) >= calls else 1
        keep[dev] = set(sorted(es)[-per_call:])
    return [r for r in records if "epoch" not in r or int(r["epoch"]) in keep[r.get("device")]]


def _timeline_wanted(a: argparse.Namespace, cuda: bool, path: str) -> bool:
    if a.timeline and not cuda:
        _progress(f"--timeline needs the CUDA path; skipped ({path})")
    return a.timeline and cuda


def traced_case(a: argparse.Namespace, stem: str, case: dict[str, Any], entry: Any) -> dict | None:
    """Traces the last of TIMELINE_CALLS back-to-back calls of ``entry`` (the jax_ub impl), draws ``<stem>-timeline-<case>.png``, prints
    a summary; returns the JSON ``timelines`` item, or None (with a progress line) if skipped."""
    from jax_ub.bench import timeline

    records, why = capture_timeline(*(entry() if callable(entry) else entry))
    if records is None:
        _progress(f"timeline skipped: {why}")
        return None
    tag = f"{case.get('op', '')}-tp{case['tp']}-{case['M']}x{case['K']}x{case['N']}".lstrip("-")
    if case.get("method"):
        tag += f"-{case['method']}"
    path = f"{stem}-timeline-{tag}.png"
    title = (f"jax_ub {tag} {a.dtype}: the last of {TIMELINE_CALLS} traced calls back to back "
             "(ms from the op's start on each device)")
    drawn = timeline.draw(records, path, title)
    print(f"timeline {tag}: {len(records)} records"
          + (f", {path}" if drawn else " (no PNG: matplotlib missing or no records)"))
    if records:
        print(timeline.summary(records))
    impl = f"jax_ub_{case['method']}" if case.get("method") else "jax_ub"
    return {**case, "dtype": a.dtype, "impl": impl, "records": records}


def run_agrs(a: argparse.Namespace) -> int:
    import jax_ub

    cuda, path = path_info()
    print(path)
    stem = out_stem(a, a.op)
    timeline_ok = _timeline_wanted(a, cuda, path)
    op_name = "ag_gemm" if a.op == "ag" else "gemm_rs"
    records, rows, timelines = [], [], []
    cases = list(_cases(a, DEFAULT_SHAPES))
    if not cases:
        return _nothing_to_run(a)
    for tp, M, K, N in cases:
        mesh = make_mesh(tp, cuda)
        impls = agrs_impls(a.op, mesh, M, K, N, a.dtype, cuda)
        res = time_impls(f"{a.op} tp={tp} {M}x{K}x{N} {a.dtype}", impls, a)
        traced = "jax_ub" if a.timeline_method == "auto" else f"jax_ub_{a.timeline_method}"
        if timeline_ok and traced in res:
            tl = traced_case(a, stem, {"M": M, "K": K, "N": N, "tp": tp,
                                       **({"method": a.timeline_method} if traced != "jax_ub" else {})},
                             impls[traced])
            timeline_ok = tl is not None  # a skip says why once, then no more tries
            timelines += [tl] if tl else []
        auto = _auto_method(a.op, tp, M, K, N, a.dtype) if cuda else "xla"
        jax_ub.shutdown()
        case = case_records({"op": op_name, "M": M, "K": K, "N": N, "tp": tp, "dtype": a.dtype}, res)
        for r in case:
            if r["impl"] == "jax_ub":
                r["method"] = auto  # what auto ran (jax_ub._measured ignores this key)
        records += case
        rows.append((tp, M, K, N, res, auto))
    write_json(a, stem, records, path=path.split(" ")[1], **({"timelines": timelines} if timelines else {}))
    png = plot(records, stem + ".png", f"jax_ub {a.op} ({os.path.basename(stem)}, {a.dtype})", AG_RS_CHART,
               lambda r: f"tp{r['tp']}\n{r['M']}x{r['K']}x{r['N']}")
    _wrote(stem, png)
    _agrs_table(a.op, rows, path)
    return 0


def _auto_method(op: str, tp: int, M: int, K: int, N: int, dtype: str) -> str:
    """The method ``method="auto"`` runs at this global shape (the bench's communicator is still
    up): AG x[M/tp, K] @ w[K, N/tp]; RS x[M, K/tp] @ w[K/tp, N]."""
    from jax_ub import overlap

    x, w = ((M // tp, K), (K, N // tp)) if op == "ag" else ((M, K // tp), (K // tp, N))
    return overlap.choose(op, x, w, dtype, "tp")


def same_program_spread(rows: list) -> list[float]:
    """|jax_ub / jax_ub_<method auto ran> - 1| per row: one program timed twice in one run (two
    compilations of the same schedule), so the run's own noise. Differences between impls smaller
    than this are not resolved by the run."""
    out = []
    for *_, r, auto in rows:
        twin = r.get("xla_plain" if auto == "xla" else f"jax_ub_{auto}")  # auto may run XLA's path
        if twin and r.get("jax_ub"):
            out.append(abs(r["jax_ub"] / twin - 1.0))
    return out


def _agrs_table(op: str, rows: list, path: str) -> None:
    alts = "ring/all_peer" if op == "ag" else "ring/pipeline/chain"
    print(f"{path}\ntp  M,K,N               gemm   nccl  ub_comm  xla_plain  windowed  jax_ub  (auto runs)  "
          f"({alts})  speedup  T/T_ideal  (gemm on all GPUs, T/max(it, ub_comm))")
    speedups = []
    for tp, M, K, N, r, auto in rows:
        g = lambda k, r=r: r.get(k, float("nan"))  # noqa: E731
        alt = (f"{g('jax_ub_all_peer'):.3f}" if op == "ag" else
               f"{g('jax_ub_pipeline'):.3f}/{g('jax_ub_chain'):.3f}")
        ideal = _ideal(g("gemm_alone"), g("comm_jax_ub"))
        sp = g("xla_plain") / g("jax_ub")
        speedups.append(sp)
        print(f"{tp:<3} {M},{K},{N:<10} {g('gemm_alone'):6.3f} {g('comm_nccl'):6.3f} {g('comm_jax_ub'):7.3f} "
              f"{g('xla_plain'):9.3f} {g('xla_windowed'):9.3f} {g('jax_ub'):7.3f}  ({auto:<8})  "
              f"{g('jax_ub_ring'):.3f}/{alt}  {sp:6.2f}x  {g('jax_ub') / ideal:8.2f}"
              f"  ({g('gemm_all_gpus'):.3f}, {g('jax_ub') / _ideal(g('gemm_all_gpus'), g('comm_jax_ub')):.2f})")
    gm = _geomean(speedups)
    if gm is not None:
        print(f"geometric mean speedup vs xla_plain: {gm:.2f}x")
    spread = same_program_spread(rows)
    if spread:
        print(f"same program timed twice (jax_ub and jax_ub_<the method auto runs>): differ by "
              f"{100 * statistics.median(spread):.1f}% (median), {100 * max(spread):.1f}% (max) "
              f"over {len(spread)} shapes: this run's noise")


# ------------------------------------------------------------------------------------------------
# mlp


def run_mlp(a: argparse.Namespace) -> int:
    import jax

    import jax_ub
    from jax_ub.bench import mlp

    if a.tp > len(jax.devices()):
        print(f"error: --tp {a.tp} needs {a.tp} devices; found {len(jax.devices())}", file=sys.stderr)
        return 2
    for what, v in (("--tokens", a.tokens), ("--hidden", a.hidden), ("--ffn", a.ffn)):
        if v % a.tp:
            print(f"error: {what} ({v}) must be divisible by --tp ({a.tp})", file=sys.stderr)
            return 2
    cuda, path = path_info()
    print(path)
    if not cuda:
        _progress("xla_windowed: the windowed-einsum flags are GPU flags; off GPU this is plain SPMD")
    mesh = make_mesh(a.tp, cuda)
    records, rows = [], []
    for model in a.models:
        ffn = 3 * a.hidden if model == "attn_proj" else a.ffn
        label = f"{model} tp={a.tp} hidden={a.hidden} ffn={ffn} tokens={a.tokens} {a.dtype}"
        try:
            impls = mlp.build(model, mesh, hidden=a.hidden, ffn=a.ffn, tokens=a.tokens, dtype_name=a.dtype,
                              windowed_flags=WINDOWED_FLAGS, remat=a.remat)
        except Exception as e:
            _progress(f"{label}: building the model failed: {type(e).__name__}: {str(e)[:300]}")
            continue
        checks: dict[str, Any] = {}
        res = time_impls(label, impls, a, probe=mlp.check, probes=checks)
        print(f"{model} check (loss, |dx|): "
              + ", ".join(f"{k} ({v[0]:.6g}, {v[1]:.6g})" for k, v in checks.items()))
        common = {"op": model, "hidden": a.hidden, "ffn": ffn, "tokens": a.tokens, "tp": a.tp, "dtype": a.dtype}
        if a.remat != "none":
            common["remat"] = a.remat
        records += case_records(common, res)
        rows.append((model, ffn, res))
    jax_ub.shutdown()
    stem = out_stem(a, "mlp" if a.remat == "none" else f"mlp-remat-{a.remat}")
    write_json(a, stem, records, path=path.split(" ")[1])
    png = plot(records, stem + ".png", f"jax_ub mlp fwd+bwd ({os.path.basename(stem)}, {a.dtype})", MLP_CHART,
               lambda r: f"{r['op']} tp{r['tp']}\nh{r['hidden']} f{r['ffn']} t{r['tokens']}")
    _wrote(stem, png)
    for model, _, r in rows:
        sp = r.get("xla_plain", float("nan")) / r.get("jax_ub", float("nan"))
        print(f"{model}: jax_ub speedup vs xla_plain {sp:.2f}x")
    print(f"{path}\nmodel      tp  hidden  ffn     tokens  xla_plain  windowed  jax_ub  speedup  "
          f"no_comm  (best possible)")
    for model, ffn, r in rows:
        g = lambda k, r=r: r.get(k, float("nan"))  # noqa: E731
        print(f"{model:<10} {a.tp:<3} {a.hidden:<7} {ffn:<7} {a.tokens:<7} {g('xla_plain'):9.3f} "
              f"{g('xla_windowed'):9.3f} {g('jax_ub'):7.3f}  {g('xla_plain') / g('jax_ub'):6.2f}x  "
              f"{g('no_comm'):7.3f}  ({g('xla_plain') / g('no_comm'):.2f}x)")
    if a.remat != "none":
        for model, _, r in rows:
            g = lambda k, r=r: r.get(k, float("nan"))  # noqa: E731
            print(f"{model}: remat {a.remat}: jax_ub with jax_ub.checkpoint_policy {g('jax_ub'):.3f} ms, "
                  f"with the bare policy {g('jax_ub_base_policy'):.3f} ms "
                  f"({g('jax_ub_base_policy') / g('jax_ub'):.2f}x slower)")
    return 0


# ------------------------------------------------------------------------------------------------
# bulk


def run_bulk(a: argparse.Namespace) -> int:
    import jax_ub
    from jax_ub.bench import bulk

    cuda, path = path_info()
    print(path)
    stem = out_stem(a, "bulk")
    timeline_ok = _timeline_wanted(a, cuda, path)
    if not cuda:
        _progress("comm_jax_ub skipped: the copy-engine collective needs the CUDA path")
    records, rows, timelines = [], [], []
    cases = list(_cases(a, BULK_SHAPES))
    if not cases:
        return _nothing_to_run(a)
    for tp, M, K, N in cases:
        mesh = make_mesh(tp, cuda)
        for kind in bulk.KINDS:
            impls = bulk.build(kind, mesh, M, K, N, dtype_name=a.dtype, cuda=cuda)
            res = time_impls(f"bulk_{kind} tp={tp} {M}x{K}x{N} {a.dtype}", impls, a)
            case = {"op": f"bulk_{kind}", "M": M, "K": K, "N": N, "tp": tp}
            if timeline_ok and "jax_ub" in res:
                tl = traced_case(a, stem, case, impls["jax_ub"])
                timeline_ok = tl is not None
                timelines += [tl] if tl else []
            records += case_records({**case, "dtype": a.dtype}, res)
            rows.append((f"bulk_{kind}", tp, M, K, N, res))
        jax_ub.shutdown()
    write_json(a, stem, records, path=path.split(" ")[1], **({"timelines": timelines} if timelines else {}))
    png = plot(records, stem + ".png", f"jax_ub bulk overlap ({os.path.basename(stem)}, {a.dtype})", BULK_CHART,
               lambda r: f"{r['op']} tp{r['tp']}\n{r['M']}x{r['K']}x{r['N']}")
    _wrote(stem, png)
    print(f"{path}\nop       tp  M,K,N               gemm  ub_comm    nccl  xla_plain  jax_ub  "
          "jax_ub/max(gemm,ub_comm) (target <= 1.10)")
    for op, tp, M, K, N, r in rows:
        g = lambda k, r=r: r.get(k, float("nan"))  # noqa: E731
        ratio = g("jax_ub") / _ideal(g("gemm_alone"), g("comm_jax_ub"))
        print(f"{op:<8} {tp:<3} {M},{K},{N:<10} {g('gemm_alone'):6.3f} {g('comm_jax_ub'):7.3f} {g('comm_nccl'):7.3f} "
              f"{g('xla_plain'):9.3f} {g('jax_ub'):7.3f}  {ratio:6.2f}")
    return 0


# ------------------------------------------------------------------------------------------------
# CLI


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--dtype", default="bfloat16")
    common.add_argument("--warmup", type=int, default=3)
    common.add_argument("--iters", type=int, default=10)
    common.add_argument("--reps", type=int, default=7)
    common.add_argument("--settle-ms", type=float, default=25.0,
                        help="untimed run of an impl before each of its timed bursts (0: none)")
    common.add_argument("--out", default="benchmarks/results")
    common.add_argument("--machine", default=None, help="name in the output files (default: <n>x<device kind>)")
    chained = argparse.ArgumentParser(add_help=False)
    chained.add_argument("--chain", type=int, default=1,
                         help="ops per timed dispatch: each impl's program runs its op CHAIN times in a "
                              "row (one dispatch per CHAIN ops, as in a model step; a lone dispatch of "
                              "a small op is bound by the host); ms are per op")
    ap = argparse.ArgumentParser(prog="python -m jax_ub.bench", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="op", required=True)
    for op in ("ag", "rs"):
        p = sub.add_parser(op, parents=[common, chained], help=f"{'AG→GEMM' if op == 'ag' else 'GEMM→RS'} vs XLA")
        p.add_argument("--tp", type=int, nargs="+", default=[4, 2])
        p.add_argument("--shapes", nargs="+", default=None, help="global M,K,N triples")
        p.add_argument("--timeline", action="store_true",
                       help="also trace one jax_ub call per shape: Gantt PNG + records in the JSON (CUDA)")
        p.add_argument("--timeline-method", default="auto",
                       help="the method the --timeline call uses (default: auto, the jax_ub impl)")
    p = sub.add_parser("mlp", parents=[common], help="fwd+bwd step of ParallelMLP and the attention projections")
    p.add_argument("--tp", type=int, default=4, help="mesh of the first TP devices")
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--ffn", type=int, default=28672)
    p.add_argument("--tokens", type=int, default=8192, help="batch 1 x seq TOKENS")
    p.add_argument("--models", nargs="+", default=list(MLP_MODELS), choices=MLP_MODELS,
                   help="which steps to time (swiglu: the gated MLP, up = hidden -> 2*ffn)")
    p.add_argument("--remat", default="none", choices=("none", "dots", "dots_no_batch"),
                   help="the forward under jax.checkpoint with this policy (jax_ub: "
                        "jax_ub.checkpoint_policy of it; jax_ub_base_policy: the bare policy)")
    p = sub.add_parser("bulk", parents=[common, chained], help="AG / RS under an independent GEMM (backward pass)")
    p.add_argument("--tp", type=int, nargs="+", default=[4])
    p.add_argument("--shapes", nargs="+", default=None,
                   help="global M,K,N triples of the forward layer (see jax_ub.bench.bulk)")
    p.add_argument("--timeline", action="store_true",
                   help="also trace one jax_ub call per shape: Gantt PNG + records in the JSON (CUDA)")
    p = sub.add_parser("tune", parents=[common, chained], help="every method at the shapes a program recorded "
                       "(JAX_UB_RECORD_SHAPES): a file for JAX_UB_TUNING_FILE")
    p.add_argument("shapes_file", help="a shapes JSON written by JAX_UB_RECORD_SHAPES=PATH or "
                   "jax_ub.tuning.record() (see jax_ub.tuning)")
    p.add_argument("--forward-only", action="store_true",
                   help="skip the shapes recorded as the backward of an op (inference)")
    p.add_argument("--full", action="store_true",
                   help="also time the GEMM and collectives alone and XLA's windowed einsum")
    p.set_defaults(out="jax_ub_tuning", chain=8)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    a.machine = a.machine or _machine()
    a.date = datetime.date.today().strftime("%Y%m%d")
    if a.op == "tune":
        from jax_ub.bench import tune

        return tune.run(a)
    run = {"ag": run_agrs, "rs": run_agrs, "mlp": run_mlp, "bulk": run_bulk}[a.op]
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
