"""``python -m jax_ub.bench gemm`` — the FP8 GEMM on one GPU: jax_ub's (cuBLASLt FP8, tuned at trace
time by ``JAX_UB_GEMM_TUNE``) against XLA's FP8 dot and against both bf16 GEMMs, in one run.

For each ``y[m, n] = x[m, k] @ w[k, n]`` (``--m`` times ``--nk``, or the ``--shapes`` M,N,K given;
the defaults are the chunk GEMMs the overlap schedules run for 8B/70B-class layers) the median
TFLOP/s (``2 m n k`` per op) of:

* ``jax_ub_fp8``  ``jax_ub.gemm.fp8_gemm_ffi``: float8_e4m3fn x and w (w stored ``[n, k]``, the
  layout cuBLASLt's FP8 kernels take, as the overlap ops pass it), float32 per-tensor scales,
  bfloat16 result, full accumulation (partial sums promoted to fp32 along k);
* ``jax_ub_fp8_fast`` the same GEMM with cuBLASLt's fast accumulation (``fast_accum=True``, what
  ``FP8Recipe(fwd_fast_accum=True)`` runs in the forward);
* ``xla_fp8``     ``lax.dot_general`` on the same float8 operands (w ``[n, k]`` too: contracting
  both on their last dimension, so XLA needs no transpose either) with
  ``preferred_element_type=bfloat16``, which XLA rewrites to its cuBLASLt FP8 GEMM;
* ``jax_ub_bf16`` ``jax_ub.matmul`` (cuBLASLt) on bfloat16 x ``[m, k]`` and w ``[k, n]``;
* ``xla_bf16``    ``jnp.matmul`` on the same bfloat16 operands.

Each impl runs ``--chain`` ops per dispatch (:func:`jax_ub.bench.harness.chain_fn`), after
``--warmup`` untimed dispatches; its time is the median of ``--reps`` bursts of ``--iters``
dispatches. Before timing, ``jax_ub_fp8`` is checked against ``xla_fp8`` (the same product of the
same float8 values; relative Frobenius error recorded as ``err_vs_xla_fp8``). The record (JSON,
``--out``/``<machine>-<date>-gemm-fp8.json`` or ``--record PATH``) holds every case's TFLOP/s and
the ratios ``fp8_vs_xla_fp8``, ``fp8_fast_vs_xla_fp8`` and ``fp8_vs_jax_ub_bf16`` (and
``err_fast_vs_xla_fp8``); it is rewritten after each case
(``"complete": false`` until the last, which adds the ``summary``), so a run cut short keeps what
it measured. The defaults take about 13 s a case on an H200 (compiles, tuning, four impls).
CUDA only (exit 2 elsewhere).
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

# The chunk GEMMs of the schedules at 8B/70B-class layers: (n, k) of y[m, n] = x[m, k] @ w[k, n].
NK = [(4096, 14336), (8192, 7168), (8192, 28672), (14336, 4096), (7168, 8192)]
MS = [1024, 2048, 4096, 8192]
IMPLS = ("jax_ub_fp8", "jax_ub_fp8_fast", "xla_fp8", "jax_ub_bf16", "xla_bf16")


def _nk(text: str) -> tuple[int, int]:
    try:
        n, k = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N,K (two positive integers); got {text!r}") from None
    if n < 1 or k < 1 or max(n, k) > 2**31 - 1:
        raise argparse.ArgumentTypeError(f"expected N,K (two positive integers); got {text!r}")
    return n, k


def _mnk(text: str) -> tuple[int, int, int]:
    try:
        m, n, k = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected M,N,K (three positive integers); got {text!r}") from None
    if min(m, n, k) < 1 or max(m, n, k) > 2**31 - 1:
        raise argparse.ArgumentTypeError(f"expected M,N,K (three positive integers); got {text!r}")
    return m, n, k


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}") from None
    if not 1 <= v <= 2**31 - 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}")
    return v


def add_parser(sub: Any, machine_name: Any = str) -> None:
    """The ``gemm`` subcommand (registered by :mod:`jax_ub.bench.__main__`, which passes its
    ``--machine`` check as ``machine_name``)."""
    p = sub.add_parser("gemm", help="FP8 GEMM: jax_ub (cuBLASLt FP8) vs XLA's FP8 dot vs bf16, one GPU")
    p.add_argument("--m", type=_positive, nargs="+", default=MS, help="rows of x (default: %(default)s)")
    p.add_argument("--nk", type=_nk, nargs="+", default=NK, help="N,K pairs (default: 8B/70B chunk GEMMs)")
    p.add_argument(
        "--shapes",
        type=_mnk,
        nargs="+",
        default=None,
        help="M,N,K triples to run instead of --m x --nk (e.g. 2048,8192,7168)",
    )
    p.add_argument("--warmup", type=_positive, default=3, help="untimed dispatches per impl")
    p.add_argument("--iters", type=_positive, default=5, help="dispatches per timed burst")
    p.add_argument("--reps", type=_positive, default=5, help="timed bursts (the median is kept)")
    p.add_argument("--chain", type=_positive, default=4, help="ops per dispatch")
    p.add_argument("--out", default="bench_out", help="folder of the record (default: bench_out)")
    p.add_argument("--record", default=None, help="the record's path (instead of --out's name)")
    p.add_argument(
        "--machine", type=machine_name, default=None, help="name in the record (default: <n>x<device kind>)"
    )


def _time(fn, args, a) -> float:
    """Median ms per op of ``fn`` chained ``--chain`` times per dispatch."""
    from jax_ub.bench import harness

    chained = harness.chain_fn(fn, a.chain) or fn
    per = a.chain if chained is not fn else 1
    harness._warm_up(chained, args, a.warmup)
    return statistics.median(harness._burst(chained, args, a.iters) for _ in range(a.reps)) / per


def run(a: argparse.Namespace) -> int:
    import jax
    import jax.numpy as jnp
    from jax import lax

    import jax_ub
    from jax_ub import _ext, gemm
    from jax_ub.bench import harness

    ok, why = _ext.cuda_path_available()
    if not ok:
        harness.progress(f"gemm: the CUDA path is unavailable ({why}): nothing to measure")
        return 2
    dev = jax.devices()[0]
    e4m3 = jnp.float8_e4m3fn
    fp8 = jax.jit(lambda x, w, s, t: gemm.fp8_gemm_ffi(x, w, s, t, jnp.bfloat16))
    fast = jax.jit(lambda x, w, s, t: gemm.fp8_gemm_ffi(x, w, s, t, jnp.bfloat16, fast_accum=True))
    xla8 = jax.jit(
        lambda x, w: lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16)
    )
    bf16 = jax.jit(lambda x, w: jax_ub.matmul(x, w, method="cublaslt"))
    xla16 = jax.jit(jnp.matmul)
    records: list[dict] = []
    path = a.record or os.path.join(a.out, f"{a.machine}-{a.date}-gemm-fp8.json")
    from jax_ub import config

    doc = {
        "machine": a.machine,
        "date": a.date,
        "jax": jax.__version__,
        "jax_ub": jax_ub.__version__,
        "device_kind": dev.device_kind,
        "bench": "gemm-fp8",
        "command": "python -m jax_ub.bench gemm",
        "gemm_tune": config.get().gemm_tune,
        "chain": a.chain,
        "impls": list(IMPLS),
        "complete": False,  # until every case ran: the record is rewritten after each one
        "records": records,
    }
    # (n, k) -> the m's, in the order given: w is made once per (n, k).
    groups: dict[tuple[int, int], list[int]] = {}
    for m, n, k in a.shapes or [(m, n, k) for n, k in a.nk for m in a.m]:
        groups.setdefault((n, k), []).append(m)
    for (n, k), ms_of in groups.items():
        kw, kx = jax.random.split(jax.random.key(n * 31 + k))
        w = jax.device_put(jax.random.normal(kw, (k, n), jnp.float32) * 0.05, dev)
        w16 = w.astype(jnp.bfloat16)
        ws = jnp.max(jnp.abs(w)) / 448.0
        w8_t = (w.T / ws).astype(e4m3)  # [n, k]
        del w
        for m in ms_of:
            x = jax.random.normal(jax.random.fold_in(kx, m), (m, k), jnp.float32)
            x16 = x.astype(jnp.bfloat16)
            xs = jnp.max(jnp.abs(x)) / 448.0
            x8 = (x / xs).astype(e4m3)
            del x
            flop = 2.0 * m * n * k
            y8, yx = fp8(x8, w8_t, xs, ws), xla8(x8, w8_t) * (xs * ws)
            err = float(harness.rel_err(y8, yx))
            err_fast = float(harness.rel_err(fast(x8, w8_t, xs, ws), yx))
            del y8, yx
            ms = {
                "jax_ub_fp8": _time(fp8, (x8, w8_t, xs, ws), a),
                "jax_ub_fp8_fast": _time(fast, (x8, w8_t, xs, ws), a),
                "xla_fp8": _time(xla8, (x8, w8_t), a),
                "jax_ub_bf16": _time(bf16, (x16, w16), a),
                "xla_bf16": _time(xla16, (x16, w16), a),
            }
            tflops = {i: flop / (v * 1e-3) / 1e12 for i, v in ms.items()}
            rec = {
                "m": m,
                "n": n,
                "k": k,
                "ms": ms,
                "tflops": tflops,
                "fp8_vs_xla_fp8": tflops["jax_ub_fp8"] / tflops["xla_fp8"],
                "fp8_fast_vs_xla_fp8": tflops["jax_ub_fp8_fast"] / tflops["xla_fp8"],
                "fp8_vs_jax_ub_bf16": tflops["jax_ub_fp8"] / tflops["jax_ub_bf16"],
                "err_vs_xla_fp8": err,
                "err_fast_vs_xla_fp8": err_fast,
            }
            records.append(rec)
            harness.write_doc(path, doc)
            print(
                f"gemm m={m} n={n} k={k}: TFLOP/s jax_ub_fp8 {tflops['jax_ub_fp8']:.0f} "
                f"jax_ub_fp8_fast {tflops['jax_ub_fp8_fast']:.0f} xla_fp8 "
                f"{tflops['xla_fp8']:.0f} jax_ub_bf16 {tflops['jax_ub_bf16']:.0f} xla_bf16 "
                f"{tflops['xla_bf16']:.0f} | fp8/xla_fp8 {rec['fp8_vs_xla_fp8']:.2f} "
                f"fp8_fast/xla_fp8 {rec['fp8_fast_vs_xla_fp8']:.2f} "
                f"fp8/jax_ub_bf16 {rec['fp8_vs_jax_ub_bf16']:.2f} | err {err:.1e} "
                f"err_fast {err_fast:.1e}",
                flush=True,
            )
            del x8, x16
    if not records:
        harness.progress("gemm: no case to measure")
        return 2
    vs_xla = [r["fp8_vs_xla_fp8"] for r in records]
    fast_vs_xla = [r["fp8_fast_vs_xla_fp8"] for r in records]
    vs_bf16 = [r["fp8_vs_jax_ub_bf16"] for r in records]
    summary = {
        "geomean_fp8_vs_xla_fp8": harness.geomean(vs_xla),
        "min_fp8_vs_xla_fp8": min(vs_xla),
        "geomean_fp8_fast_vs_xla_fp8": harness.geomean(fast_vs_xla),
        "min_fp8_fast_vs_xla_fp8": min(fast_vs_xla),
        "min_fp8_vs_jax_ub_bf16": min(vs_bf16),
        "cases_at_least_1.2x_xla_fp8": sum(v >= 1.2 for v in vs_xla),
        "cases_slower_than_jax_ub_bf16": sum(v < 1.0 for v in vs_bf16),
        "cases": len(records),
    }
    print(
        "gemm summary: "
        + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items())
    )
    doc.update(complete=True, summary=summary)
    harness.write_doc(path, doc)
    harness.progress(f"wrote {path}")
    return 0
