#!/usr/bin/env bash
# What issues 4 and 5 still owe a 4-GPU machine (nvidia-h200-x4), as three device calls of < 600 s:
#   bash scripts/tp4_owed.sh a    # tests not yet run on 2+ GPUs in one process; bench ag|rs|bulk --tp 4
#   bash scripts/tp4_owed.sh b    # the same ops chained 4 to a dispatch, rs with the heuristic's GEMMs, probes
#   bash scripts/tp4_owed.sh c    # ag with the heuristic's GEMMs, ag with push's peer chunks merged (JAX_UB_AG_PUSH_MERGE),
#                                 # the split/tuning probes, the bare reduce-scatter by method and pieces
#   bash scripts/tp4_owed.sh t    # the one-process multi-GPU tier whole (its element-wise checks of session 39
#                                 # ran on 4 GPUs only for 6 AG cases, session 41); first on any 2- or 4-GPU
#                                 # machine. The zero-size case runs alone first: jax 0.11.2's XLA crashed on it
#                                 # before session 40's fix
#   bash scripts/tp4_owed.sh d    # why AG got slower (session 41: push 0.47 -> 0.61 ms at 8192^3): timelines of
#                                 # the two small shapes, chained 4 against one per dispatch
# Session 41 ran ag and rs of a (AG 1.16x, RS 1.37x, merged); a again times xla_windowed_nccl, new since.
# Session 42 cut the CUDA calls per op (push at tp=4: ~75 -> ~40; host us/op -12..-28% with ranks as
# processes on one GPU, NOTES): the bench's host line at tp=4 (150-260 us per op and device in
# session 41) says what one process driving 4 GPUs gained; t runs that mode's tests first.
# A wheel built here for the device's Python saves the build: SESSION_WHEEL=.whl/<wheel> (session_steps.sh),
# with .whl in carry; DEADLINE_S=<s> makes the last tarball land inside a short device limit.
# GEMM tuning is on by default (JAX_UB_GEMM_TUNE=8) since the twenty-fifth session; the committed tp=4
# records were taken with the heuristic's GEMMs (JAX_UB_GEMM_TUNE=0), which b and c time again.
# Each step has its own limit (session_steps.sh); results land in $OUT/out.tgz (results/, logs/).
# bench ag|rs|bulk time one op per dispatch unless --chain says otherwise (b: 4), and rewrite their JSON
# after every shape ("complete": false until the end), so a step its limit kills keeps what it timed.
# Afterwards: python -m jax_ub.bench summary --tp 4 FRESH/*-{ag,rs,bulk}.json (the targets, judged against
# the run's noise line), then per op python scripts/merge_results.py FRESH.json COMMITTED.json, e.g.
#   python scripts/merge_results.py FRESH/4xNVIDIA_H200-<date>-ag.json benchmarks/results/4xNVIDIA_H200-20261122-ag.json
# (its cases replace the committed ones whole; each record keeps its run's date and chain), then
#   python scripts/measured_table.py benchmarks/results/*-ag.json benchmarks/results/*-rs.json
# and README's performance table from the merged files (tests/cpu/test_bench_summary.py checks it).
set -uo pipefail
here="$(dirname "$0")"
case "${1:-}" in
  a)
    TAILN=${TAILN:-20} bash "$here/session_steps.sh" \
      'unrun|100|python3 -m pytest -q -rs tests/multigpu/test_overlap.py tests/multigpu/test_one_process.py -k "traced_again_after_shutdown or zero_size_operands_give or persistent_compilation_cache"' \
      'ag|150|python3 -m jax_ub.bench ag --tp 4 --out $R' \
      'rs|150|python3 -m jax_ub.bench rs --tp 4 --out $R' \
      'bulk|90|python3 -m jax_ub.bench bulk --tp 4 --out $R' \
      'summary|20|python3 -m jax_ub.bench summary --tp 4 $R/*-ag.json $R/*-rs.json $R/*-bulk.json'
    ;;
  b)
    TAILN=${TAILN:-20} bash "$here/session_steps.sh" \
      'ag_chain|130|python3 -m jax_ub.bench ag --tp 4 --chain 4 --out $R/chain' \
      'rs_chain|130|python3 -m jax_ub.bench rs --tp 4 --chain 4 --out $R/chain' \
      'rs_heuristic|130|JAX_UB_GEMM_TUNE=0 python3 -m jax_ub.bench rs --tp 4 --out $R/heuristic' \
      'bare|70|python3 scripts/bare_probe.py 4' \
      'a2a|60|nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/a2a scripts/a2a_probe.cu && /tmp/a2a 32 128'
    ;;
  c)
    TAILN=${TAILN:-20} bash "$here/session_steps.sh" \
      'ag_heuristic|150|JAX_UB_GEMM_TUNE=0 python3 -m jax_ub.bench ag --tp 4 --out $R/heuristic' \
      'ag_merge|150|JAX_UB_AG_PUSH_MERGE=1 python3 -m jax_ub.bench ag --tp 4 --out $R/merge' \
      'split|110|python3 scripts/tune_ab_probe.py 7 10 && python3 scripts/split_gemm_probe.py 7 10' \
      'bare_rs|80|python3 scripts/rs_pieces_probe.py 4 8192,28672 16384,12288 8192,8192 2048,28672'
    ;;
  t)
    TAILN=${TAILN:-20} bash "$here/session_steps.sh" \
      'zero_size|60|python3 -m pytest -q -rs tests/multigpu/test_overlap.py -k zero_size_operands' \
      'overlap|300|python3 -m pytest -q -rs -x tests/multigpu/test_overlap.py tests/multigpu/test_nccl_transport.py -k "not zero_size_operands"' \
      'rest|200|python3 -m pytest -q -rs tests/multigpu/test_one_process.py tests/multigpu/test_layers_cuda.py tests/multigpu/test_tuning_cuda.py'
    ;;
  d)
    TAILN=${TAILN:-20} bash "$here/session_steps.sh" \
      'ag_small_timeline|150|python3 -m jax_ub.bench ag --tp 4 --timeline --shapes 8192,8192,8192 2048,8192,28672 --out $R/timeline' \
      'ag_small_chain|120|python3 -m jax_ub.bench ag --tp 4 --chain 4 --shapes 8192,8192,8192 2048,8192,28672 --out $R/chain' \
      'ag_small_heuristic|120|JAX_UB_GEMM_TUNE=0 python3 -m jax_ub.bench ag --tp 4 --shapes 8192,8192,8192 2048,8192,28672 --out $R/heuristic'
    ;;
  *) echo "usage: bash scripts/tp4_owed.sh a|b|c|d|t" >&2; exit 2 ;;
esac
