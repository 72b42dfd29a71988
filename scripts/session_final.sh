#!/usr/bin/env bash
# Final device calls of a session.  part a: the single-process GPU tiers (copy engine and NCCL).
# part b: multi-process tier, bench mlp with recompute_gathered, the example in both launch modes.
#   bash scripts/session_final.sh a|b|c   (c: the copy-engine single-process tier + multi-process)
set -uo pipefail
OUT_DIR="${OUT:-./gpu_out}"
L="$OUT_DIR/logs"; mkdir -p "$L"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 UB_SKIPMC=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_UB_TIMEOUT=30
t0=$(date +%s)
step() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }
step build
JAX_UB_CUDA_ARCHS=90a JAX_UB_REQUIRE_CUDA=1 python3 -m pip install --no-build-isolation --no-deps -e . > "$L/build.log" 2>&1 || { tail -30 "$L/build.log"; exit 1; }
if [[ "$1" == a ]]; then
  step overlap
  timeout -k 5 330 python3 -m pytest -q -rs -s -p no:cacheprovider tests/multigpu/test_overlap.py > "$L/overlap.log" 2>&1; echo "rc=$?"; grep -E "passed|failed|free bytes" "$L/overlap.log" | tail -4
  step nccl
  timeout -k 5 150 python3 -m pytest -q -rs -s -p no:cacheprovider tests/multigpu/test_nccl_transport.py > "$L/nccl.log" 2>&1; echo "rc=$?"; grep -E "passed|failed|free bytes" "$L/nccl.log" | tail -4
elif [[ "$1" == c ]]; then
  step overlap
  timeout -k 5 330 python3 -m pytest -q -rs -s -p no:cacheprovider tests/multigpu/test_overlap.py > "$L/overlap.log" 2>&1; echo "rc=$?"; grep -E "passed|failed|free bytes" "$L/overlap.log" | tail -4
  step multiprocess
  timeout -k 5 200 python3 -m pytest -q -rs -s -p no:cacheprovider tests/multigpu/test_multiprocess.py > "$L/mp.log" 2>&1; echo "rc=$?"; grep -E "passed|failed" "$L/mp.log" | tail -3
else
  step multiprocess
  timeout -k 5 200 python3 -m pytest -q -rs -s -p no:cacheprovider tests/multigpu/test_multiprocess.py > "$L/mp.log" 2>&1; echo "rc=$?"; grep -E "passed|failed|rank 0" "$L/mp.log" | tail -8
  step mlp_recompute
  JAX_UB_RECOMPUTE_GATHERED=1 timeout -k 5 110 python3 -m jax_ub.bench mlp --tp 4 --out "$L" > "$L/mlp_recompute.log" 2>&1; echo "rc=$?"; tail -4 "$L/mlp_recompute.log"
  step example_1proc
  timeout -k 5 150 python3 examples/train_tp_block.py --steps 100 --compare > "$L/example1.log" 2>&1; echo "rc=$?"; tail -6 "$L/example1.log"
fi
step done
tar czf "$OUT_DIR/logs-$1.tgz" -C "$OUT_DIR" logs && rm -rf "$L"
