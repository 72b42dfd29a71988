"""What every ``python -m jax_ub.bench`` subcommand shares: timing (built and warmed first, then
interleaved, settled repetitions; optionally chained), the mesh and which path runs, the record
files (JSON, PNG chart), and one traced call's timeline. Nothing here imports jax at import time.

The workloads and their runners live beside it: :mod:`jax_ub.bench.agrs` (``ag``/``rs``),
:mod:`jax_ub.bench.bulk`, :mod:`jax_ub.bench.mlp`, :mod:`jax_ub.bench.tune`; the command line is
:mod:`jax_ub.bench.__main__`.
"""

from __future__ import annotations

import argparse
import contextlib
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


def progress(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


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
               failures: list[tuple[str, str]] | None = None) -> dict[str, float]:
    """Median ms of each impl; an entry is ``(fn, args)`` or a thunk returning it (built here, so a
    failure to build is reported like a failure to run: one progress line, no record, and
    ``(name, "<label>: <error>")`` appended to ``failures`` if given). With ``probe``,
    ``probes[name] = probe(fn(*args))`` of one more call (e.g. a loss to compare).

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
        progress(f"{label}: {name}")
        try:
            fn, args = entry() if callable(entry) else entry
            chained = chain_fn(fn, chain)
            if chain > 1 and chained is None:
                progress(f"  {name}: not chained (one op per dispatch)")
            fn, per_call[name] = (chained, chain) if chained is not None else (fn, 1)
            for _ in range(a.warmup):
                jax.block_until_ready(fn(*args))
            if probe is not None and probes is not None:
                probes[name] = probe(fn(*args))
            settle[name] = settle_calls(_burst(fn, args, 2), settle_ms, a.iters) if settle_ms > 0 else 0
            ready[name] = (fn, args)
        except Exception as e:
            _failed(label, name, e, failures)
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
                _failed(label, name, e, failures)
                del ready[name]
                samples[name] = []
    line = host_line(host)
    if line:
        progress(f"  {line}")
    return {name: statistics.median(ms) / per_call[name] for name, ms in samples.items() if ms}


def _failed(label: str, name: str, e: Exception, failures: list[tuple[str, str]] | None) -> None:
    why = f"{type(e).__name__}: {str(e)[:300]}"
    progress(f"  {name} failed: {why}")
    if failures is not None:
        failures.append((name, f"{label}: {why}"))


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


def machine() -> str:
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
    """One record per impl; each says which cuBLASLt plans it ran (``gemm_tune``: candidates timed
    per GEMM shape, 0 for the heuristic's first), since merged files mix runs."""
    from jax_ub import config

    tune = config.get().gemm_tune
    return [{**common, "impl": impl, "ms": round(ms, 4), "gemm_tune": tune} for impl, ms in res.items()]


def write_json(a: argparse.Namespace, stem: str, records: list[dict], **extra: Any) -> None:
    """Writes ``<stem>.json``: ``{"machine", "date", "jax", "jax_ub", "device_kind", ...extra,
    "records"}`` (which GPUs and which jax_ub measured, so a tuning file used elsewhere is noticed:
    :func:`jax_ub.choice.check_bench_file`). Atomically: a job reading it meanwhile (e.g. as its
    ``JAX_UB_TUNING_FILE``) sees the old or the new file whole, never a part."""
    import jax

    import jax_ub

    if getattr(a, "chain", 1) > 1:
        extra = {"chain": a.chain, **extra}  # ms are per op, CHAIN ops per dispatch
    doc = {"machine": a.machine, "date": a.date, "jax": jax.__version__, "jax_ub": jax_ub.__version__,
           "device_kind": jax.devices()[0].device_kind, **extra, "records": records}
    path = stem + ".json"
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1, default=_plain)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


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
        progress("matplotlib missing: no PNG")
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


def wrote(stem: str, png: bool) -> None:
    print(f"\nwrote {stem}.json" + (f" and {stem}.png" if png else " (no PNG)"))


def ideal(*ms: float) -> float:
    """max(ms), or NaN when one is missing (max() would silently drop a NaN)."""
    return float("nan") if any(m != m for m in ms) else max(ms)


def _shapes(a: argparse.Namespace, default: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """``--shapes`` (M,K,N triples, parsed and checked by the command line), or ``default``."""
    if not a.shapes:
        return default
    return [tuple(s) if not isinstance(s, str) else tuple(int(v) for v in s.split(","))  # type: ignore[misc]
            for s in a.shapes]


def cases(a: argparse.Namespace, default: list[tuple[int, int, int]]):
    """(tp, M, K, N) to run, skipping (with a progress line) what the devices/tp cannot do."""
    import jax

    for tp in a.tp:
        if tp > len(jax.devices()):
            progress(f"skip tp={tp}: only {len(jax.devices())} devices")
            continue
        for M, K, N in _shapes(a, default):
            if M % tp or K % tp or N % tp:
                progress(f"skip {M}x{K}x{N}: not divisible by tp={tp}")
                continue
            yield tp, M, K, N


def nothing_to_run(a: argparse.Namespace) -> int:
    """Exit status 2 with a message for a run whose every case was skipped (no JSON is written:
    an empty record file would only mislead a later merge)."""
    import jax

    print(f"error: nothing to measure with --tp {' '.join(map(str, a.tp))} on {len(jax.devices())} "
          f"device(s): each tp needs that many devices and shapes whose M, K and N it divides "
          f"(the skip lines above say which)", file=sys.stderr)
    return 2


def ours(impl: str) -> bool:
    """Whether ``impl`` is jax_ub's own (``jax_ub``, ``jax_ub_<method>``): what a bench is for."""
    return impl == "jax_ub" or impl.startswith("jax_ub_")


def nothing_measured(a: argparse.Namespace, results: Sequence[dict[str, float]],
                     failures: Sequence[tuple[str, str]]) -> int | None:
    """None where some case timed one of jax_ub's impls (:func:`ours`); else exit status 1 with a
    message saying that nothing was measured and why (the first failures of jax_ub's impls, from
    :func:`time_impls`'s ``failures``; the progress lines above have all of them). As with
    :func:`nothing_to_run`, the caller writes no JSON: the bench measured nothing it is for, and
    its baselines alone would only mislead a later merge."""
    if any(ours(impl) for res in results for impl in res):
        return None
    print(f"error: nothing was measured: jax_ub's impls gave no time in any case of bench {a.op} "
          f"(expected at least one; {failure_summary(failures) or 'none of them was timed'}); no file "
          f"written", file=sys.stderr, flush=True)
    return 1


def failure_summary(failures: Sequence[tuple[str, str]], shown: int = 3) -> str:
    """The first ``shown`` failures of jax_ub's impls, ``"<impl> at <label>: <error>; ..."``."""
    whys = [f"{name} at {why}" for name, why in failures if ours(name)]
    more = len(whys) - shown
    return "; ".join(whys[:shown]) + (f"; and {more} more (the lines above)" if more > 0 else "")


# ------------------------------------------------------------------------------------------------
# One traced call: the timeline


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


def timeline_wanted(a: argparse.Namespace, cuda: bool, path: str) -> bool:
    if a.timeline and not cuda:
        progress(f"--timeline needs the CUDA path; skipped ({path})")
    return a.timeline and cuda


def traced_case(a: argparse.Namespace, stem: str, case: dict[str, Any], entry: Any) -> dict | None:
    """Traces the last of TIMELINE_CALLS back-to-back calls of ``entry`` (the jax_ub impl), draws
    ``<stem>-timeline-<case>.png``, prints a summary; returns the JSON ``timelines`` item, ``{}``
    when the calls ran no jax_ub op (a printed line; later cases may), or None when tracing is
    unavailable (a progress line; callers stop trying)."""
    from jax_ub.bench import timeline

    records, why = capture_timeline(*(entry() if callable(entry) else entry))
    if records is None:
        progress(f"timeline skipped: {why}")
        return None
    tag = f"{case.get('op', '')}-tp{case['tp']}-{case['M']}x{case['K']}x{case['N']}".lstrip("-")
    if case.get("method"):
        tag += f"-{case['method']}"
    path = f"{stem}-timeline-{tag}.png"
    title = (f"jax_ub {tag} {a.dtype}: the last of {TIMELINE_CALLS} traced calls back to back "
             "(ms from the op's start on each device)")
    if not records:  # nothing to draw; later cases may still trace (this is no tracing failure)
        print(f"timeline {tag}: no records: the traced calls ran no jax_ub CUDA op (at tp=1, or "
              f"where auto runs XLA's path, there is nothing to overlap)")
        return {}
    drawn = timeline.draw(records, path, title)
    print(f"timeline {tag}: {len(records)} records" + (f", {path}" if drawn else " (no PNG: matplotlib missing)"))
    print(timeline.summary(records))
    impl = f"jax_ub_{case['method']}" if case.get("method") else "jax_ub"
    return {**case, "dtype": a.dtype, "impl": impl, "records": records}
