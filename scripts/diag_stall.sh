#!/usr/bin/env bash
# Runs the single-process multi-GPU tests that stalled, one process each, under a timeout, with
# environment variants; dumps native stacks of a stalled process when gdb is there.
#   bash scripts/diag_stall.sh OUT_DIR "VAR=1 VAR2=2" ...   (one variant per argument; "" = none)
set -u
OUT_DIR="$1"; shift
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 JAX_UB_TIMEOUT="${JAX_UB_TIMEOUT:-20}"
TESTS=(test_scan_batch_dims_repeated_and_mixed_shapes test_dp_by_tp_mesh "test_gradients_through_cuda_path and bfloat16")
for variant in "$@"; do
  for t in "${TESTS[@]}"; do
    tag=$(echo "$variant-$t" | tr -c 'A-Za-z0-9_=-' '_' | cut -c1-80)
    start=$SECONDS
    env $variant timeout -k 5 70 python3 -m pytest -x -q -p no:cacheprovider tests/multigpu/test_overlap.py -k "$t" > "$OUT_DIR/diag-$tag.log" 2>&1 &
    pid=$!
    # Stack dump if still running after 45 s (the watchdog fires at JAX_UB_TIMEOUT).
    ( sleep 45; if kill -0 $pid 2>/dev/null; then
        py=$(pgrep -P $pid -f pytest | head -1); py=${py:-$pid}
        if command -v gdb >/dev/null; then timeout 30 gdb -p "$(pgrep -f 'pytest -x -q' | tail -1)" -batch -ex "thread apply all bt 12" > "$OUT_DIR/gdb-$tag.txt" 2>&1; fi
      fi ) &
    wait $pid; rc=$?
    printf "%-45s %-60s rc=%s %4ss %s\n" "[$variant]" "$t" "$rc" "$((SECONDS - start))" "$(grep -E 'passed|failed' "$OUT_DIR/diag-$tag.log" | tail -1)"
  done
done
