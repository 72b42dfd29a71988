"""What every ``python -m jax_ub.bench`` subcommand shares: timing (built and warmed first, then
interleaved, settled repetitions; optionally chained), the check of each timed output against its
reference impl's, the mesh and which path runs, the record files (JSON rewritten after every case,
PNG chart), and one traced call's timeline. Nothing here imports jax at import time.

The workloads and their runners live beside it: :mod:`jax_ub.bench.agrs` (``ag``/``rs``),
:mod:`jax_ub.bench.bulk`, :mod:`jax_ub.bench.mlp`, :mod:`jax_ub.bench.tune`; the command line is
:mod:`jax_ub.bench.__main__`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

DEFAULT_SHAPES = [(8192, 8192, 28672), (8192, 8192, 8192), (16384, 12288, 12288), (2048, 8192, 28672)]
BULK_SHAPES = DEFAULT_SHAPES[:3]
WINDOWED_FLAGS = {  # xla_windowed: XLA's windowed einsum with the collective-matmul flags
    "xla_gpu_threshold_for_windowed_einsum_mib": 0,
    "xla_gpu_multi_streamed_windowed_einsum": True,
    "xla_gpu_use_memcpy_local_p2p": True,
}
# xla_windowed_nccl: the same loop with its chunks moved by NCCL instead of local peer memcpys. On
# 4xH200 (jax 0.11.2, one process) xla_windowed returned wrong outputs at every tp=4 shape (relative
# error 0.866 for AG, 0.707 for RS, 2026-11-28); openxla/xla#19555 is an open report of
# wrong numbers from xla_gpu_use_memcpy_local_p2p. This one says whether the loop itself is at fault.
WINDOWED_NCCL_FLAGS = {k: v for k, v in WINDOWED_FLAGS.items() if k != "xla_gpu_use_memcpy_local_p2p"}
WINDOWED = ("xla_windowed", "xla_windowed_nccl")


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


def _warm_up(fn, args, warmup: int) -> Any:
    """``max(1, warmup)`` untimed calls (the first compiles: never timed, even with ``--warmup 0``);
    the last call's output."""
    import jax

    out = None
    for _ in range(max(1, warmup)):
        out = jax.block_until_ready(fn(*args))
    return out


def time_fn(fn, args, *, warmup: int, iters: int, reps: int) -> float:
    _warm_up(fn, args, warmup)
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


class Times(dict):
    """:func:`time_impls`' result: ``{impl: median ms per op}``, and in ``chain`` the ops each timed
    dispatch of an impl ran (``--chain`` where it could be chained; 1 for a compiled executable,
    which :func:`chain_fn` cannot chain), in ``spread`` the fastest and slowest of its ``--reps``
    bursts (ms per op), and in ``host`` the host us per op of the impls that ran jax_ub ops
    (:func:`host_per_op`: enqueueing, waiting for peers). A plain dict elsewhere (fakes in tests)
    means chain 1, no spread and no host time."""

    def __init__(
        self,
        ms: dict[str, float] | None = None,
        chain: dict[str, int] | None = None,
        spread: dict[str, tuple[float, float]] | None = None,
        host: dict[str, tuple[float, float]] | None = None,
    ):
        super().__init__(ms or {})
        self.chain = dict(chain or {})
        self.spread = dict(spread or {})
        self.host = dict(host or {})


def chain_of(res: dict[str, float], impl: str) -> int:
    """Ops per timed dispatch of ``impl`` in ``res`` (:class:`Times`; 1 for a plain dict)."""
    return getattr(res, "chain", {}).get(impl, 1)


def time_impls(
    label: str,
    impls: dict[str, Any],
    a: argparse.Namespace,
    probe: Callable[[str, Any], Any] | None = None,
    probes: dict[str, Any] | None = None,
    failures: list[tuple[str, str]] | None = None,
) -> Times:
    """Median ms per op of each impl (:class:`Times`); an entry is ``(fn, args)`` or a thunk
    returning it (built here, so a failure to build is reported like a failure to run: one progress
    line, no record, and ``(name, "<label>: <error>")`` appended to ``failures`` if given). With
    ``probe``, ``probes[name] = probe(name, out)`` where ``out`` is the output of the impl's last
    warm-up call (of a chained program, its last op's): an exception from the probe (e.g.
    :class:`Check`'s :class:`WrongOutput`) fails the impl like a failure to run.

    Every impl is built and warmed up first (``a.warmup`` untimed calls, at least one: the compile
    is never timed); then the repetitions are interleaved: repetition r
    times each impl once, in an order shuffled by r (seeded), so a drift of clocks or power during
    the run weighs on every impl alike. Each timed burst follows an untimed burst of the same impl
    (``a.settle_ms`` of it, see :func:`settle_calls`): a GPU at its power cap runs at clocks that
    depend on the load of the last few ms, so without it an impl timed after a light one (a
    collective) ran up to 10% faster than the same program timed after a GEMM (2xH200, tp=2,
    8192,8192,28672: 2.745 against 3.072 ms)."""
    import random

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
                progress(f"  {name}: not chained (one op per dispatch; its record says chain 1)")
            fn, per_call[name] = (chained, chain) if chained is not None else (fn, 1)
            out = _warm_up(fn, args, a.warmup)
            if probe is not None:
                value = probe(name, out[-1] if per_call[name] > 1 else out)
                if probes is not None:
                    probes[name] = value
            del out
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
    timed = {name: statistics.median(ms) / per_call[name] for name, ms in samples.items() if ms}
    host_us = {name: host_per_op(host[name]) for name in timed if host.get(name)}
    return Times(
        timed,
        {name: per_call[name] for name in timed},
        {name: (min(samples[name]) / per_call[name], max(samples[name]) / per_call[name]) for name in timed},
        {name: us for name, us in host_us.items() if us is not None},
    )


# ------------------------------------------------------------------------------------------------
# What is timed must be right: each impl's output against its reference impl's


# ||out - ref|| / ||ref|| (fp32, Frobenius) an impl may reach against its reference impl's output,
# both computed in the op's dtype (tests/multigpu/test_overlap.py holds jax_ub to 1e-2 in bf16 and
# 1e-5 in fp32 against an fp32 reference; two TF32 GEMMs of the same operands agree far closer).
# fp8: jax_ub's FP8 op against XLA's FP8 dot on the same float8 operands (bfloat16 outputs).
REL_ERR_BOUND = {"bfloat16": 1e-2, "float16": 1e-2, "float32": 1e-4, "fp8": 1e-2}


class WrongOutput(Exception):
    """An impl's output is not its reference's (:class:`Check`): it gets no time."""


def reference(impl: str) -> str | None:
    """The impl whose output ``impl``'s must equal in bench ag/rs/bulk: ``comm_nccl`` for
    ``comm_jax_ub`` (the same collective), ``xla_plain`` for the op itself (``jax_ub``,
    ``jax_ub_<method>``, ``xla_windowed``, ``xla_windowed_nccl``, ``variant_<...>``), ``xla_fp8``
    for jax_ub's FP8 ops (``jax_ub_fp8``, ``jax_ub_fp8_<method>``); None for what
    computes something else (the GEMM alone or in chunks, on other data)."""
    if impl == "comm_jax_ub":
        return REFERENCES[0]
    if impl == "jax_ub_fp8" or impl.startswith("jax_ub_fp8_"):  # the same float8 operands as XLA's
        return REFERENCES[2]
    if ours(impl) or impl in WINDOWED or impl.startswith("variant_"):
        return REFERENCES[1]
    return None


REFERENCES = ("comm_nccl", "xla_plain", "xla_fp8")  # what :func:`reference` returns


@functools.cache
def _rel_err_fn() -> Callable[[Any, Any], Any]:
    import jax
    import jax.numpy as jnp

    def rel(out, ref):
        out, ref = out.astype(jnp.float32), ref.astype(jnp.float32)
        return jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref)

    return jax.jit(rel)


def rel_err(out: Any, ref: Any) -> float:
    """``||out - ref|| / ||ref||`` in float32 (Frobenius), the largest over the arrays of two outputs
    of one structure (NaN where ``out`` has a NaN). An output of another structure or shape (e.g.
    with an extra array, such as ``return_gathered``'s) is a :class:`WrongOutput`, not a comparison
    of whichever arrays happen to line up."""
    import jax

    outs, tree = jax.tree.flatten(out)
    refs, ref_tree = jax.tree.flatten(ref)
    if cast(Any, tree) != ref_tree or [o.shape for o in outs] != [r.shape for r in refs]:
        raise WrongOutput(
            f"output {tree} of shapes {[o.shape for o in outs]} is not the reference's "
            f"{ref_tree} of shapes {[r.shape for r in refs]}"
        )
    return max(float(_rel_err_fn()(o, r)) for o, r in zip(outs, refs, strict=True))


class Check:
    """A ``probe`` for :func:`time_impls`: the output of every impl that has a :func:`reference`
    must be that reference's within ``REL_ERR_BOUND[dtype]``. Returns the error (the record's
    ``rel_err``), None for an impl without a reference, or raises :class:`WrongOutput` (the impl
    gets no time, and a failure). The references must come before the impls checked against them
    in the impls' order (their outputs are kept here, for the case); one whose reference gave no
    output (failed) is timed unchecked: its record has no ``rel_err``."""

    def __init__(self, dtype: str):
        self.dtype = dtype
        self.bound = REL_ERR_BOUND[dtype]
        self.outs: dict[str, Any] = {}

    def __call__(self, name: str, out: Any) -> float | None:
        if name in REFERENCES:
            self.outs[name] = out
        ref = reference(name)
        if ref is None:
            return None
        if ref not in self.outs:
            progress(f"  {name}: output not checked ({ref} gave none)")
            return None
        err = rel_err(out, self.outs[ref])
        if not err <= self.bound:  # NaN too
            raise WrongOutput(
                f"wrong output: relative error {err:.3g} against {ref} (bound {self.bound:g} in {self.dtype})"
            )
        return err


def _failed(label: str, name: str, e: Exception, failures: list[tuple[str, str]] | None) -> None:
    why = f"{type(e).__name__}: {str(e)[:300]}"
    progress(f"  {'the case' if name == WHOLE_CASE else name} failed: {why}")
    if failures is not None:
        failures.append((name, f"{label}: {why}"))


def _host_stats() -> dict:
    from jax_ub import comm

    return comm.host_stats()


def _host_delta(h0: dict, h1: dict) -> dict:
    """Per device: ops run and host seconds spent enqueueing them between two host_stats."""
    return {k: {f: h1[k][f] - h0[k][f] for f in h1[k]} for k in h1 if k in h0}


def host_per_op(deltas: list[dict]) -> tuple[float, float] | None:
    """Host us per op of one impl's bursts (:func:`_host_delta` of each): the slowest device's
    enqueueing, and of it the wait for same-process peers; None where it ran no jax_ub op."""
    ops = sum(d[k]["ops"] for d in deltas for k in d)
    if not ops:
        return None
    per_dev = ops / max(len(d) for d in deltas)
    spent, waited = max(
        (sum(d[k]["host_s"] for d in deltas if k in d), sum(d[k]["meet_s"] for d in deltas if k in d))
        for k in deltas[0]
    )
    return spent / per_dev * 1e6, waited / per_dev * 1e6


def host_line(host: dict[str, list[dict]]) -> str:
    """``host us per op`` of every impl that ran jax_ub ops (:func:`host_per_op`): near the ms per
    op, the impl is bound by the host."""
    parts = []
    for name, deltas in host.items():
        us = host_per_op(deltas)
        if us is not None:
            parts.append(f"{name} {us[0]:.0f} ({us[1]:.0f})")
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


def case_records(
    common: dict[str, Any], res: dict[str, float], rel_errs: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """One record per impl; each says which cuBLASLt plans it ran (``gemm_tune``: candidates timed
    per GEMM shape, 0 for the heuristic's first), how many ops a timed dispatch ran (``chain``:
    ``--chain``, or 1 where the impl could not be chained), and, where its output was checked
    against its :func:`reference`'s, the relative error (``rel_err``), and where ``res`` is a
    :class:`Times`, the fastest and slowest of the impl's timed bursts (``ms_min``, ``ms_max``, ms
    per op: ``ms`` is their median; a wide range says the run was noisy, for this impl alone) and,
    for an impl that ran jax_ub ops, the host us per op (``host_us``, of it ``host_meet_us``
    waiting for same-process peers: near ``ms`` * 1000, the impl was bound by the host); merged
    files mix runs."""
    from jax_ub import config

    tune = config.get().gemm_tune
    out = []
    for impl, ms in res.items():
        r = {**common, "impl": impl, "ms": round(ms, 4), "gemm_tune": tune, "chain": chain_of(res, impl)}
        lo_hi = getattr(res, "spread", {}).get(impl)
        if lo_hi is not None:
            r["ms_min"], r["ms_max"] = round(lo_hi[0], 4), round(lo_hi[1], 4)
        host = getattr(res, "host", {}).get(impl)
        if host is not None:
            r["host_us"], r["host_meet_us"] = round(host[0], 1), round(host[1], 1)
        if rel_errs and rel_errs.get(impl) is not None:
            r["rel_err"] = float(f"{rel_errs[impl]:.3g}")
        out.append(r)
    return out


def agreed(items: Sequence[dict], key: str) -> Any:
    """The value of ``key`` that every item has, or None where one lacks it or two differ (a file's
    header states a run's property only where it holds for every record)."""
    values = {json.dumps(i.get(key), sort_keys=True) for i in items}
    return items[0].get(key) if items and len(values) == 1 else None


def config_changes() -> dict[str, Any]:
    """The jax_ub settings (``JAX_UB_*``, :class:`jax_ub.config.Config`) this process runs with
    away from their defaults, ``{field: value}`` (e.g. ``{"ag_push_merge": True}``)."""
    from jax_ub import config

    active, default = config.get(), config.Config()
    return {
        f.name: getattr(active, f.name)
        for f in dataclasses.fields(active)
        if getattr(active, f.name) != getattr(default, f.name)
    }


def write_json(a: argparse.Namespace, stem: str, records: list[dict], **extra: Any) -> None:
    """Writes ``<stem>.json``: ``{"machine", "date", "jax", "jax_ub", "device_kind", ["chain"],
    "config", ...extra, "records"}`` (which GPUs and which jax_ub measured, so a tuning file used
    elsewhere is noticed: :func:`jax_ub.choice.check_bench_file`; ``config``: the jax_ub settings
    away from their defaults, :func:`config_changes`; ``chain`` only where every record ran that
    many ops per dispatch, each record says its own). Atomically (:func:`write_doc`)."""
    import jax

    import jax_ub

    chain = agreed(records, "chain")
    doc = {
        "machine": a.machine,
        "date": a.date,
        "jax": jax.__version__,
        "jax_ub": jax_ub.__version__,
        "device_kind": jax.devices()[0].device_kind,
        **({"chain": chain} if chain is not None else {}),
        "config": config_changes(),
        **extra,
        "records": records,
    }
    write_doc(stem + ".json", doc)


def write_doc(path: str, doc: dict) -> None:
    """``doc`` as JSON at ``path`` (its folder created), atomically: a job reading it meanwhile
    (e.g. as its ``JAX_UB_TUNING_FILE``) sees the old or the new file whole, never a part."""
    _make_folder(path)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1, default=_plain)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _make_folder(path: str) -> None:
    """The folder of a file about to be written (only then: a run that writes nothing leaves none)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)


def _plain(o: Any) -> Any:
    """JSON for numpy scalars and anything else a trace record may hold."""
    return o.item() if hasattr(o, "item") else str(o)


def out_stem(a: argparse.Namespace, tag: str) -> str:
    """``<out>/<machine>-<yyyymmdd>-<tag>`` (the folder is made when a file is written there)."""
    return os.path.join(a.out, f"{a.machine}-{a.date}-{tag}")


def plot(
    records: list[dict], path: str, title: str, impls: Sequence[str], case_label: Callable[[dict], str]
) -> bool:
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
        vals = [
            next((r["ms"] for r in records if case_label(r) == c and r["impl"] == impl), None) for c in cases
        ]
        xs = [i + j * width for i in range(len(cases))]
        bars = ax.bar(xs, [math.nan if v is None else v for v in vals], width, label=impl)
        for x, v in zip(xs, vals, strict=True):
            if v is None:  # a gap, not a 0 ms bar that reads as "very fast"
                ax.text(
                    x,
                    0,
                    "n/a",
                    rotation=90,
                    fontsize=6,
                    ha="center",
                    va="bottom",
                    color=bars.patches[0].get_facecolor(),
                )
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))])
    ax.set_xticklabels(cases, fontsize=8)
    ax.set_ylabel("ms (median)")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    _make_folder(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def wrote(stem: str, png: bool) -> None:
    print(f"\nwrote {stem}.json" + (f" and {stem}.png" if png else " (no PNG)"))


def ratio(res: dict[str, float], num: str, *dens: str) -> float:
    """``res[num] / max(res[d] for d in dens)`` (a speedup, or T over T_ideal): NaN where one is
    missing, or where they were timed with different ops per dispatch (:func:`chain_of`: a
    chained impl against one that could not be chained is no fair comparison)."""
    names = (num, *dens)
    if any(n not in res for n in names) or len({chain_of(res, n) for n in names}) > 1:
        return math.nan
    return res[num] / max(res[d] for d in dens)


def twin_impl(auto: str) -> str:
    """The impl that times the same program as ``jax_ub`` when auto ran method ``auto``: its
    ``jax_ub_<method>``, or ``xla_plain`` where auto ran XLA's path."""
    return "xla_plain" if auto == "xla" else f"jax_ub_{auto}"


def geomean(values: Sequence[float]) -> float | None:
    """The geometric mean of the finite positive values, or None where there is none."""
    good = [v for v in values if math.isfinite(v) and v > 0]
    return math.exp(sum(map(math.log, good)) / len(good)) if good else None


def _shapes(a: argparse.Namespace, default: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """``--shapes`` (M,K,N triples, parsed and checked by the command line; each once), or ``default``."""
    if not a.shapes:
        return default
    triples = (tuple(s) if not isinstance(s, str) else tuple(int(v) for v in s.split(",")) for s in a.shapes)
    return cast("list[tuple[int, int, int]]", list(dict.fromkeys(triples)))


def cases(a: argparse.Namespace, default: list[tuple[int, int, int]]):
    """(tp, M, K, N) to run, each once (a repeated ``--tp`` or shape is run once), skipping (with a
    progress line) what the devices/tp cannot do."""
    import jax

    for tp in dict.fromkeys(a.tp):
        if tp > len(jax.devices()):
            progress(f"skip tp={tp}: only {len(jax.devices())} devices")
            continue
        for M, K, N in _shapes(a, default):
            if M % tp or K % tp or N % tp:
                progress(f"skip {M}x{K}x{N}: not divisible by tp={tp}")
                continue
            yield tp, M, K, N


def warn_gpu_sized_defaults(a: argparse.Namespace, cuda: bool, default: list[tuple[int, int, int]]) -> None:
    """Off the CUDA path (a CPU trial of the harness), the default shapes, sized for GPUs, take
    minutes each: say so, and how to pick small ones, before the first starts."""
    if cuda or a.shapes:
        return
    largest = max(default, key=lambda s: s[0] * s[1] * s[2])
    progress(
        f"note: the default shapes are sized for GPUs (up to {'x'.join(map(str, largest))}); on "
        f"the XLA reference path each may take minutes: --shapes 512,256,768 tries the harness "
        f"quickly"
    )


def nothing_to_run(a: argparse.Namespace, cuda: bool = True) -> int:
    """Exit status 2 with a message for a run whose every case was skipped (no JSON is written:
    an empty record file would only mislead a later merge)."""
    import jax

    ndev = len(jax.devices())
    hint = (
        "; off the CUDA path, XLA_FLAGS=--xla_force_host_platform_device_count=4 gives a CPU trial 4 devices"
        if not cuda and ndev < max(a.tp)
        else ""
    )
    print(
        f"error: nothing to measure with --tp {' '.join(map(str, a.tp))} on {ndev} "
        f"device(s): each tp needs that many devices and shapes whose M, K and N it divides "
        f"(the skip lines above say which){hint}",
        file=sys.stderr,
    )
    return 2


def ours(impl: str) -> bool:
    """Whether ``impl`` is jax_ub's own (``jax_ub``, ``jax_ub_<method>``): what a bench is for."""
    return impl == "jax_ub" or impl.startswith("jax_ub_")


def nothing_measured(
    a: argparse.Namespace, results: Sequence[dict[str, float]], failures: Sequence[tuple[str, str]]
) -> int | None:
    """None where some case timed one of jax_ub's impls (:func:`ours`); else exit status 1 with a
    message saying that nothing was measured and why (the first failures of jax_ub's impls, from
    :func:`time_impls`'s ``failures``; the progress lines above have all of them). As with
    :func:`nothing_to_run`, the caller writes no JSON: the bench measured nothing it is for, and
    its baselines alone would only mislead a later merge."""
    if any(ours(impl) for res in results for impl in res):
        return None
    print(
        f"error: nothing was measured: jax_ub's impls gave no time in any case of bench {a.op} "
        f"(expected at least one; {failure_summary(failures) or 'none of them was timed'}); no file "
        f"written",
        file=sys.stderr,
        flush=True,
    )
    return 1


def failure_summary(failures: Sequence[tuple[str, str]], shown: int = 3) -> str:
    """The first ``shown`` failures of jax_ub's impls or of whole cases (:data:`WHOLE_CASE`),
    ``"<impl> at <label>: <error>; ..."``."""
    whys = [
        f"{'the case' if name == WHOLE_CASE else name} at {why}"
        for name, why in failures
        if ours(name) or name == WHOLE_CASE
    ]
    more = len(whys) - shown
    return "; ".join(whys[:shown]) + (f"; and {more} more (the lines above)" if more > 0 else "")


# ------------------------------------------------------------------------------------------------
# A run's record file, written after every case

WHOLE_CASE = "*"  # the impl of a failure of the case outside its impls (mesh, data, build, timeline)


@dataclasses.dataclass
class Case:
    """What the body of :meth:`Results.case` leaves for the case's records: the times, the probes'
    relative errors (:class:`Check`), extra keys per impl (e.g. what ``auto`` ran)."""

    res: dict[str, float] = dataclasses.field(default_factory=Times)
    rel_err: dict[str, Any] = dataclasses.field(default_factory=dict)
    extra: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)


class Results:
    """One run's record file ``<stem>.json``, rewritten whole after every case with ``"complete":
    false`` (``true`` from :meth:`finish`), so a crash or a killed step keeps the cases timed so far.
    It is written only once some case timed one of jax_ub's impls (:func:`ours`): a run that
    measured nothing leaves no file (:func:`nothing_measured`). ``failures`` collects
    :func:`time_impls`' ``(impl, "<label>: <error>")``; the file lists them per case under
    ``"failures"``: ``{<the case's keys>, "impl", "error"}``, impl :data:`WHOLE_CASE` where the case
    failed outside its impls (before any ran, or after: its timeline)."""

    def __init__(self, a: argparse.Namespace, stem: str, path: str):
        self.a, self.stem, self.path = a, stem, path.split(" ")[1]
        self.records: list[dict] = []
        self.timelines: list[dict] = []
        self.failures: list[tuple[str, str]] = []
        self.failed: list[dict] = []  # the file's "failures"
        self.timed: list[dict[str, float]] = []  # each case's times

    @contextlib.contextmanager
    def case(self, common: dict[str, Any], label: str, shutdown: bool = True) -> Any:
        """``with results.case(common, label) as c:`` time one case into ``c`` (:class:`Case`). An
        exception in the body (making the mesh, the data, the impls) fails the case, not the run:
        a progress line and a :data:`WHOLE_CASE` failure (what ``c`` got before it is kept). Then
        the case's records are added and the file rewritten; ``jax_ub.shutdown()`` always runs
        last (``shutdown=False``: the caller keeps the communicators for its next case and shuts
        down itself)."""
        import jax_ub

        c = Case()
        first = len(self.failures)
        try:
            try:
                yield c
            except Exception as e:
                _failed(label, WHOLE_CASE, e, self.failures)
            for r in case_records(common, c.res, c.rel_err):
                self.records.append({**r, **c.extra.get(r["impl"], {})})
            self.failed += [
                {**common, "impl": name, "error": why.removeprefix(f"{label}: ")}
                for name, why in self.failures[first:]
            ]
            self.timed.append(c.res)
            self.save(complete=False)
        finally:
            if shutdown:
                jax_ub.shutdown()

    def save(self, complete: bool) -> bool:
        """Writes the file (see the class); whether it did."""
        if not any(ours(impl) for res in self.timed for impl in res):
            return False
        write_json(
            self.a,
            self.stem,
            self.records,
            path=self.path,
            complete=complete,
            failures=self.failed,
            **({"timelines": self.timelines} if self.timelines else {}),
        )
        return True

    def finish(self) -> int | None:
        """None with the file written complete; else :func:`nothing_measured`'s exit status (no file)."""
        stop = nothing_measured(self.a, self.timed, self.failures)
        if stop is None:
            self.save(complete=True)
        return stop


def rand(key: Any, shape: tuple[int, ...], dtype: Any, where: Any) -> Any:
    """Standard normal values (float32, rounded to ``dtype``) made where they live (``where``: a
    sharding or a device), each device drawing only its shard: nothing global lands on one GPU."""
    import jax
    import jax.numpy as jnp

    if isinstance(where, jax.Device):
        where = jax.sharding.SingleDeviceSharding(where)
    return jax.jit(lambda k: jax.random.normal(k, shape, jnp.float32).astype(dtype), out_shardings=where)(key)


# ------------------------------------------------------------------------------------------------
# One traced call: the timeline


TIMELINE_CALLS = 4


def capture_timeline(
    fn: Any,
    args: Sequence[Any],
    calls: int = TIMELINE_CALLS,
) -> tuple[list[dict] | None, str]:
    """Runs ``fn(*args)`` ``calls`` times back to back with jax_ub's tracing on and returns the last
    call's records: (records, "") or (None, why not). One call right after a host sync starts
    cold: on 2xH200 its first GEMM piece took 0.21-0.30 ms against 0.18 ms in every later call
    (lab-2026-11:scripts/rs_piece_probe.py), so a picture of it misstates where the time goes."""
    import jax

    from jax_ub import trace

    enable, collect = trace.trace_enable, trace.trace_collect
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
    title = (
        f"jax_ub {tag} {a.dtype}: the last of {TIMELINE_CALLS} traced calls back to back "
        "(ms from the op's start on each device)"
    )
    if not records:  # nothing to draw; later cases may still trace (this is no tracing failure)
        print(
            f"timeline {tag}: no records: the traced calls ran no jax_ub CUDA op (at tp=1, or "
            f"where auto runs XLA's path, there is nothing to overlap)"
        )
        return {}
    _make_folder(path)
    drawn = timeline.draw(records, path, title)
    print(
        f"timeline {tag}: {len(records)} records"
        + (f", {path}" if drawn else " (no PNG: matplotlib missing)")
    )
    print(timeline.summary(records))
    impl = f"jax_ub_{case['method']}" if case.get("method") else "jax_ub"
    return {**case, "dtype": a.dtype, "impl": impl, "records": records}
