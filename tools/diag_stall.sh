#!/usr/bin/env bash
# Runs single-process multi-GPU tests one process each under a timeout; when one is still running
# after 30 s, dumps its Python stacks (faulthandler) and native stacks (gdb or cuda-gdb).
#   bash tools/diag_stall.sh OUT_DIR "pytest -k expression" ...
# TEST_FILE: the test file the expressions select from (default tests/multigpu/test_overlap.py).
set -u
OUT_DIR="$1"; shift
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 JAX_UB_TIMEOUT="${JAX_UB_TIMEOUT:-40}"
GDB=$(command -v gdb || command -v cuda-gdb || true)
n=0
for t in "$@"; do
  n=$((n + 1))
  start=$SECONDS
  timeout -k 5 90 python3 -m pytest -x -q -p no:cacheprovider -o faulthandler_timeout=30 \
    "${TEST_FILE:-tests/multigpu/test_overlap.py}" -k "$t" > "$OUT_DIR/diag-$n.log" 2>&1 &
  pid=$!
  ( sleep 32
    if kill -0 $pid 2>/dev/null && [[ -n "$GDB" ]]; then
      target=$(pgrep -P $pid | head -1)
      timeout 60 "$GDB" -p "$target" -batch -ex "thread apply all bt 25" > "$OUT_DIR/stacks-$n.txt" 2>&1
    fi ) &
  wait $pid; rc=$?
  printf "%-2s %-60s rc=%s %4ss %s\n" "$n" "$t" "$rc" "$((SECONDS - start))" "$(grep -E 'passed|failed' "$OUT_DIR/diag-$n.log" | tail -1)"
done
wait
