"""``python -m jax_ub.bench ag|rs|mlp|bulk|layer|gemm|tune|summary|breakdown [options]``
(``--help`` on each for its options).

``ag`` / ``rs`` — for each global shape (M, K, N) and tp, in one process and one run, the median
milliseconds of:

* ``gemm_alone``   cuBLASLt GEMM of the whole local problem on one GPU (AG: x_gathered[M, K] @
  w[K, N/tp]; RS: x[M, K/tp] @ w[K/tp, N]);
* ``gemm_all_gpus`` the same GEMM on every GPU of the mesh at once (no communication): what a GEMM
  costs while the whole machine computes, as in every overlapped op (power and clocks are shared);
* ``gemm_chunks``  on every GPU at once, that GEMM as the tp row-chunk GEMMs an overlapped op runs
  (AG: one per rank's chunk, RS: one partial per owner), back to back, no communication: what
  splitting the GEMM costs before any overlap (at tp=4 up to 1.2x the whole GEMM);
* ``comm_nccl``    XLA's own collective alone (``lax.all_gather`` / ``lax.psum_scatter``, NCCL);
* ``comm_jax_ub``  jax_ub's collective alone (copy engine);
* ``xla_plain``    collective then dot in ``shard_map`` (no overlap);
* ``xla_windowed`` the jit-partitioned dot with XLA's windowed-einsum flags;
* ``xla_windowed_nccl`` (ag, rs) the same without ``xla_gpu_use_memcpy_local_p2p`` (the loop's
  chunks over NCCL): with it, jax 0.11.2's XLA gave wrong outputs at tp=4 (harness.WINDOWED_NCCL_FLAGS);
* ``jax_ub``       the overlapped op (``method="auto"``), plus ``jax_ub_<algo>`` per algorithm
  (ag: push, push_merge, ring, all_peer; rs: ring, pipeline, chain, columns).

With ``--timeline`` (``ag``, ``rs``, ``bulk``; CUDA path only), each shape's ``jax_ub`` op also
runs traced (``jax_ub.trace.trace_enable``/``trace_collect``), ``TIMELINE_CALLS`` calls back to
back of which the last is kept (a lone call after a sync starts cold): a Gantt PNG per shape
(``<stem>-timeline-[<op>-]tp<tp>-<M>x<K>x<N>.png``, see :mod:`jax_ub.bench.timeline`) and the records
under the JSON's ``"timelines"`` key: ``[{"M", "K", "N", "tp", "dtype", "impl", "records"}, ...]``.

``mlp`` — forward+backward step of ``ParallelMLP`` (plain and gated, ``--models``) and of the
attention-projection pair with jax_ub's layers: ``jax_ub`` vs ``xla_plain`` vs ``xla_windowed``
(see :mod:`jax_ub.bench.mlp`).

``layer`` — forward+backward step of a whole Llama-style decoder layer (attention and MLP) at a
preset (``--preset 8b|70b``) or given sizes, remat off and on: ``jax_ub`` vs ``xla`` vs ``xla_cm``
(XLA's collective-matmul flags, in a subprocess) and the floor ``no_comm``; step ms, tokens/s, MFU,
the hidden fraction E, a chart and a Chrome/Perfetto trace of jax_ub's step (see
:mod:`jax_ub.bench.layer`).

``tune SHAPES.json ...`` — every method at the shapes a program recorded (``JAX_UB_RECORD_SHAPES``;
one file per process of a multi-process run), written as a file for ``JAX_UB_TUNING_FILE`` (see
:mod:`jax_ub.bench.tune`, :mod:`jax_ub.tuning`); each shape in its recorded dtype (no ``--dtype``).

``breakdown TRACE.json [--records LAYER.json]`` — where the time inside jax_ub's ops of a traced
``bench layer`` step goes, per device: GEMM, waits, copies (see :mod:`jax_ub.bench.breakdown`;
reads JSON only).

``summary FILE.json ...`` — records of ``ag``/``rs``/``bulk`` runs against jax_ub's performance
targets, as a markdown table (see :mod:`jax_ub.bench.summary`; reads JSON only).

``bulk`` — an all-gather / reduce-scatter under an independent GEMM (the backward pass's bulk
overlap): the collective and the GEMM alone, XLA's program, and ``jax_ub.bulk_all_gather`` /
``bulk_reduce_scatter`` (see :mod:`jax_ub.bench.bulk`).

Off the CUDA path (CPU, ``JAX_UB_DISABLE=1``) everything runs with jax_ub on its pure-XLA reference
("path: xla-reference"), which is how the harness is tested; CUDA-only impls are skipped (and
``tune``, which has no method to compare there, exits 2).

Arguments are checked before anything runs (``M,K,N`` triples of positive integers, counts >= 1,
one of ``DTYPES``, ``--machine`` a plain name): argparse's ``error:`` and exit 2. A repeated
``--tp`` or shape runs once. Runs that measure nothing write no file (nor the ``--out`` folder):
exit 2 when no case fits the devices (:func:`jax_ub.bench.harness.nothing_to_run`), exit 1 when no
jax_ub impl gave a time in any case (:func:`jax_ub.bench.harness.nothing_measured`, which says why).

Correct first (``ag``, ``rs``, ``bulk``, ``tune``): the output of each op (``jax_ub``,
``jax_ub_<algo>``, ``xla_windowed``, ``variant_*``) is compared once per shape with ``xla_plain``'s,
and ``comm_jax_ub``'s with ``comm_nccl``'s (fp32 relative Frobenius error,
:class:`jax_ub.bench.harness.Check`); above ``REL_ERR_BOUND`` of the dtype (bf16/fp16 1e-2, fp32
1e-4) the impl gets no time and a failure; the error is the record's ``rel_err``.

Timing: every impl of a shape is built and warmed up (``--warmup`` calls, at least one: the compile
is never timed), then ``reps`` interleaved repetitions (each
times every impl once, in a shuffled order) of ``iters`` back-to-back dispatches closed by one
``block_until_ready``, each after an untimed ``--settle-ms`` burst of the same impl (the GPU's
clocks under its power cap follow the last few ms of load); the median per-call time is recorded.
With ``--chain N`` (``ag``, ``rs``, ``bulk``, default 1; ``tune``, default 8) a call runs the op N
times in a row in one program (:func:`jax_ub.bench.harness.chain_fn`) and the time per op is
recorded: a lone dispatch of a small op is bound by the host, which a model's step, many ops per
dispatch, is not. A compiled program (``xla_windowed``, ``xla_windowed_nccl``) cannot be chained
and runs one op per dispatch: each record says its own ``chain``, and a ratio of two impls of
different chains is not printed ("n/a").

Writes ``<out>/<machine>-<yyyymmdd>-<op>.json``: ``{"machine", "date", "jax", "jax_ub",
"device_kind", "chain" (only where every record has that chain), "config" (the jax_ub settings away
from their defaults, e.g. ``{"ag_push_merge": true}``), "path", "complete", "failures": [{<the
case's keys>, "impl" ("*": the case outside its impls), "error"}, ...], "records": [{"op", ...,
"tp", "dtype", "impl", "ms", "ms_min", "ms_max", "gemm_tune", "chain", ["rel_err"], ["host_us",
"host_meet_us"]}, ...]}`` (``ms``: the median of ``--reps`` timed bursts, per op; ``ms_min``/``ms_max``:
the fastest and the slowest of them; ``host_us``: for an impl that ran jax_ub ops, the slowest
device's FFI handler time per op, of it ``host_meet_us`` waiting for same-process peers). The file
is rewritten after every case (``"complete": false`` until the last; replaced whole, so a reader
never sees part of it), so a crash or a killed run keeps what it timed; a case that fails outside
its impls (mesh, data) is a failure and the run goes on. Then a PNG bar chart beside it (a missing
impl: "n/a"), and a table last (``ag``/``rs``: one geometric mean speedup per tp, over the shapes
that have both times).
``tune`` writes its file once, at the end (no ``complete`` or ``failures``).

This module is the command line only. Each subcommand's workload and runner is a module of its own
(:mod:`~jax_ub.bench.agrs` for ``ag``/``rs``, :mod:`~jax_ub.bench.mlp`, :mod:`~jax_ub.bench.layer`,
:mod:`~jax_ub.bench.bulk`, :mod:`~jax_ub.bench.tune`, each with ``run(args)``); what they share
(timing, records, charts, timelines) is :mod:`jax_ub.bench.harness`, and what the two training-step
benches share :mod:`jax_ub.bench.step`.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import re
import sys
from typing import Any

from jax_ub import methods

MLP_MODELS = ("mlp", "attn_proj", "swiglu")  # jax_ub.bench.mlp.MODELS, without importing it here
LAYER_PRESETS = ("8b", "70b")  # jax_ub.bench.layer.PRESETS
DTYPES = ("bfloat16", "float16", "float32")  # the floating dtypes jax_ub's ops take
AGRS_DTYPES = (*DTYPES, "fp8")  # ag/rs also time FP8 (jax_ub.bench.agrs.build_fp8)
# The jax_ub_<method> impls of bench ag / rs: each op's schedules (see agrs.build).
CUDA_METHODS = methods.SCHEDULES


# The largest count or dimension the command line takes: a larger one is a typo (a count of
# 2**31 calls never ends; a dimension that large does not fit a GPU).
MAX_COUNT = 2**31 - 1


def at_least(low: float, kind: type = int) -> Any:
    """An argparse ``type``: a number (``kind``) >= ``low`` and <= :data:`MAX_COUNT` (so finite),
    else argparse's ``error:`` (exit 2) saying what was expected and what was given."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if kind is int else 'a number'} >= {low:g}; got {text!r}"
            ) from None
        if not value >= low:  # NaN too
            raise argparse.ArgumentTypeError(f"must be >= {low:g}; got {text}")
        if not value <= MAX_COUNT:  # inf too
            raise argparse.ArgumentTypeError(f"must be <= {MAX_COUNT}; got {text}")
        return value

    parse.__name__ = f"{kind.__name__} >= {low:g}"
    return parse


def shape(text: str) -> tuple[int, int, int]:
    """An argparse ``type``: one global ``M,K,N`` triple of positive integers."""
    want = "M,K,N: three positive integers separated by commas (e.g. 8192,8192,28672)"
    parts = text.split(",")
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(
            f"expected {want}; got {text!r} ({len(parts)} value{'s' if len(parts) != 1 else ''})"
        )
    values = []
    for part in parts:
        try:
            v = int(part)
        except ValueError:
            v = 0
        if v < 1:
            raise argparse.ArgumentTypeError(
                f"expected {want}; got {text!r} ({part.strip()!r} is not a positive integer)"
            )
        if v > MAX_COUNT:
            raise argparse.ArgumentTypeError(
                f"expected {want}; got {text!r} ({part.strip()!r} is above {MAX_COUNT})"
            )
        values.append(v)
    return values[0], values[1], values[2]


POSITIVE = at_least(1)


NAME_CHARS = "A-Za-z0-9._+-"  # what --machine (a part of the output files' names) may hold
NAME = re.compile(f"[A-Za-z0-9][{NAME_CHARS}]*")


def plain_name(text: str) -> str:
    """An argparse ``type``: a name used in a file name (letters, digits, ``._+-``; no path)."""
    if not NAME.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"expected a plain name (letters, digits and . _ + -, not starting with . _ + -); got {text!r}"
        )
    return text


def _options(*, out: str, dtype: bool | tuple[str, ...], chain: int | None) -> argparse.ArgumentParser:
    """The options of one subcommand that times, made anew for each: argparse shares a parent's
    actions with every subparser that names it, so a default set for one (``tune``'s ``--out`` and
    ``--chain``) would change every other's."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument(
        "--warmup",
        type=at_least(0),
        default=3,
        help="untimed calls of each impl before timing it (at least one always runs: the "
        "compile is never timed)",
    )
    p.add_argument("--iters", type=POSITIVE, default=10)
    p.add_argument("--reps", type=POSITIVE, default=7)
    p.add_argument(
        "--settle-ms",
        type=at_least(0, float),
        default=25.0,
        help="untimed run of an impl before each of its timed bursts (0: none)",
    )
    p.add_argument("--out", default=out, help=f"folder of the output files (default: {out})")
    p.add_argument(
        "--machine",
        type=plain_name,
        default=None,
        help="name in the output files (default: <n>x<device kind>)",
    )
    if dtype:
        p.add_argument("--dtype", default="bfloat16", choices=dtype if isinstance(dtype, tuple) else DTYPES)
    if chain is not None:
        p.add_argument(
            "--chain",
            type=POSITIVE,
            default=chain,
            help=f"ops per timed dispatch (default: {chain}): each impl's program runs its op "
            "CHAIN times in a row (one dispatch per CHAIN ops, as in a model step; a lone "
            "dispatch of a small op is bound by the host); ms are per op; an impl that "
            "cannot be chained (a compiled program) runs one op per dispatch, and its "
            "record says chain 1",
        )
    return p


def _parser() -> argparse.ArgumentParser:
    results = "bench_out"  # fresh runs; tools/merge_results.py takes them into benchmarks/records
    ap = argparse.ArgumentParser(
        prog="python -m jax_ub.bench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="op", required=True)
    for op in ("ag", "rs"):
        p = sub.add_parser(
            op,
            parents=[_options(out=results, dtype=AGRS_DTYPES, chain=1)],
            help=f"{'AG→GEMM' if op == 'ag' else 'GEMM→RS'} vs XLA",
        )
        p.add_argument("--tp", type=POSITIVE, nargs="+", default=[4, 2])
        p.add_argument("--shapes", type=shape, nargs="+", default=None, help="global M,K,N triples")
        p.add_argument(
            "--timeline",
            action="store_true",
            help="also trace one jax_ub call per shape: Gantt PNG + records in the JSON (CUDA)",
        )
        p.add_argument(
            "--timeline-method",
            default="auto",
            choices=("auto", *CUDA_METHODS[op]),
            help="the method the --timeline call uses (default: auto, the jax_ub impl)",
        )
    p = sub.add_parser(
        "mlp",
        parents=[_options(out=results, dtype=True, chain=None)],
        help="fwd+bwd step of ParallelMLP and the attention projections",
    )
    p.add_argument("--tp", type=POSITIVE, default=4, help="mesh of the first TP devices")
    p.add_argument("--hidden", type=POSITIVE, default=8192)
    p.add_argument("--ffn", type=POSITIVE, default=28672)
    p.add_argument("--tokens", type=POSITIVE, default=8192, help="batch 1 x seq TOKENS")
    p.add_argument(
        "--models",
        nargs="+",
        default=list(MLP_MODELS),
        choices=MLP_MODELS,
        help="which steps to time (swiglu: the gated MLP, up = hidden -> 2*ffn)",
    )
    p.add_argument(
        "--remat",
        default="none",
        choices=("none", "dots", "dots_no_batch"),
        help="the forward under jax.checkpoint with this policy (jax_ub: "
        "jax_ub.checkpoint_policy of it; jax_ub_base_policy: the bare policy)",
    )
    p = sub.add_parser(
        "layer",
        parents=[_options(out=results, dtype=True, chain=None)],
        help="fwd+bwd step of a whole Llama-style layer (attention + MLP)",
    )
    p.add_argument(
        "--preset",
        choices=LAYER_PRESETS,
        default=None,
        help="8b: hidden 4096, 32 heads, 8 kv heads, head_dim 128, ffn 14336; 70b: 8192, 64, 8, "
        "128, 28672 (default 8b; the size options below override it)",
    )
    for name in ("hidden", "heads", "kv-heads", "head-dim", "ffn"):
        p.add_argument(f"--{name}", type=POSITIVE, default=None, help="(default: the preset's)")
    p.add_argument("--seq", type=POSITIVE, default=4096, help="sequence length (split over tp)")
    p.add_argument("--batch", type=POSITIVE, default=1)
    p.add_argument("--tp", type=POSITIVE, default=4, help="mesh of the first TP devices")
    p.add_argument(
        "--remat",
        nargs="+",
        default=["none", "dots"],
        choices=("none", "dots", "dots_no_batch"),
        help="each a case: the forward under jax.checkpoint with this policy (none: off; jax_ub "
        "and no_comm: jax_ub.checkpoint_policy of it) (default: none dots)",
    )
    p.add_argument(
        "--xla-cm",
        choices=("auto", "on", "off"),
        default="auto",
        help="time xla_cm, the jit-partitioned layer under XLA's collective-matmul flags, in a "
        "subprocess (auto: on the CUDA path at tp > 1)",
    )
    p.add_argument("--xla-cm-timeout", type=POSITIVE, default=600, help="seconds for its subprocess")
    p.add_argument(
        "--profile",
        action="store_true",
        help="also a jax.profiler trace of jax_ub's step in <stem>-profile/ (to open beside the -trace.json)",
    )
    p.add_argument(
        "--fp8",
        action="store_true",
        help="every projection with fp8=jax_ub.FP8Recipe() (jax_ub, xla and no_comm; xla_cm is "
        "skipped); the files' tag gets -fp8",
    )
    p.add_argument("--xla-cm-child", default=None, help=argparse.SUPPRESS)
    p = sub.add_parser(
        "bulk",
        parents=[_options(out=results, dtype=True, chain=1)],
        help="AG / RS under an independent GEMM (backward pass)",
    )
    p.add_argument("--tp", type=POSITIVE, nargs="+", default=[4])
    p.add_argument(
        "--shapes",
        type=shape,
        nargs="+",
        default=None,
        help="global M,K,N triples of the forward layer (see jax_ub.bench.bulk)",
    )
    p.add_argument(
        "--timeline",
        action="store_true",
        help="also trace one jax_ub call per shape: Gantt PNG + records in the JSON (CUDA)",
    )
    # No --dtype: each recorded shape is measured in the dtype it was recorded with.
    p = sub.add_parser(
        "tune",
        parents=[_options(out="jax_ub_tuning", dtype=False, chain=8)],
        help="every method at the shapes a program recorded (JAX_UB_RECORD_SHAPES): a "
        "file for JAX_UB_TUNING_FILE",
    )
    p.add_argument(
        "shapes_file",
        nargs="+",
        help="shapes JSONs written by JAX_UB_RECORD_SHAPES=PATH (one per "
        "process with several processes) or jax_ub.tuning.record() (see jax_ub.tuning); "
        "their shapes are measured together",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace the tuning file of the same machine and day if it exists",
    )
    p.add_argument(
        "--forward-only",
        action="store_true",
        help="skip the shapes recorded as the backward of an op (inference)",
    )
    p.add_argument(
        "--full",
        action="store_true",
        help="also time the GEMM and collectives alone and XLA's windowed einsum",
    )
    from jax_ub.bench import summary  # reads JSON only

    summary.add_parser(sub)
    from jax_ub.bench import breakdown  # reads JSON only

    breakdown.add_parser(sub)
    from jax_ub.bench import gemm as gemm_bench  # the FP8 GEMM; imports jax only when it runs

    gemm_bench.add_parser(sub, plain_name)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    if a.op in ("summary", "breakdown"):  # JSON in, text out: no devices, no timing
        return importlib.import_module(f"jax_ub.bench.{a.op}").run(a)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    from jax_ub.bench import harness

    a.machine = a.machine or re.sub(f"[^{NAME_CHARS}]", "_", harness.machine())
    a.date = datetime.date.today().strftime("%Y%m%d")
    module = {"ag": "agrs", "rs": "agrs"}.get(a.op, a.op)  # bulk, mlp, tune: a module each
    return importlib.import_module(f"jax_ub.bench.{module}").run(a)


if __name__ == "__main__":
    sys.exit(main())
