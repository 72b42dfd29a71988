#!/usr/bin/env bash
# One device call: build, then the benchmarks (ag, rs with timelines at tp 4 and 2; mlp; bulk),
# results under $OUT/results, logs under $OUT/logs, all in one tarball.
set -uo pipefail
OUT_DIR="${OUT:-./gpu_out}"
R="$OUT_DIR/results"; L="$OUT_DIR/logs"
mkdir -p "$R" "$L"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 UB_SKIPMC=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_UB_TIMEOUT=60
t0=$(date +%s)
step() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }
step build
JAX_UB_CUDA_ARCHS=90a JAX_UB_REQUIRE_CUDA=1 python3 -m pip install --no-build-isolation --no-deps -e . > "$L/build.log" 2>&1 || { tail -30 "$L/build.log"; exit 1; }
for spec in "ag:190:--tp 4 2 --timeline" "rs:170:--tp 4 2 --timeline" "mlp:110:--tp 4" "bulk:70:--tp 4"; do
  IFS=: read -r what limit args <<< "$spec"
  step "$what"
  # shellcheck disable=SC2086
  timeout -k 5 "$limit" python3 -m jax_ub.bench "$what" $args --out "$R" > "$L/bench-$what.log" 2>&1
  echo "rc=$?"; grep -v "^\[bench\]" "$L/bench-$what.log" | grep -v "^W0\|^I0" | tail -14
done
step done
tar czf "$OUT_DIR/bench.tgz" -C "$OUT_DIR" results logs && rm -rf "$R" "$L"
