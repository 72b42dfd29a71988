#!/usr/bin/env bash
# One device call made of named steps, each under its own time limit, logs tarred into $OUT:
#   bash scripts/session_steps.sh 'name|seconds|command' ...
# e.g. 'rs|150|python3 -m jax_ub.bench rs --tp 4 --timeline --out $R'  ($R: results dir, $L: logs)
set -uo pipefail
OUT_DIR="${OUT:-./gpu_out}"
export R="$OUT_DIR/results" L="$OUT_DIR/logs"
mkdir -p "$R" "$L"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 UB_SKIPMC=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_UB_TIMEOUT=${JAX_UB_TIMEOUT:-30}
t0=$(date +%s)
step() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }
step build
JAX_UB_CUDA_ARCHS=90a JAX_UB_REQUIRE_CUDA=1 python3 -m pip install --no-build-isolation --no-deps -e . > "$L/build.log" 2>&1 || { tail -30 "$L/build.log"; exit 1; }
for spec in "$@"; do
  IFS='|' read -r name limit cmd <<< "$spec"
  step "$name"
  timeout -k 5 "$limit" bash -c "$cmd" > "$L/$name.log" 2>&1
  echo "rc=$?"
  grep -v "^\[bench\]\|^W0\|^I0\|^E0" "$L/$name.log" | grep -E "passed|failed|error|Error|speedup|merged|T/T|jax_ub|gemm|comm|xla|ms" | tail -${TAILN:-16}
done
step done
tar czf "$OUT_DIR/out.tgz" -C "$OUT_DIR" results logs && rm -rf "$R" "$L"
