#!/usr/bin/env bash
# One-call GPU check: build jax_ub here (no network), run the GPU test tiers and the benchmarks,
# write logs/JSON under an output folder, print a short summary last.
#
#   bash tools/gpu_check.sh [OUT_DIR] [--bench ag,rs,...]
#
# OUT_DIR defaults to $OUT if set, else ./gpu_out. JAX_UB_CUDA_ARCHS defaults to the GPU's own
# arch (fast build). Extra pytest args: PYTEST_ARGS.
set -uo pipefail

OUT_DIR="${1:-${OUT:-./gpu_out}}"
shift || true
BENCH=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --bench) BENCH="$2"; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
# Never NVLink multicast on shared hosts (also for child processes).
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
PY="${PYTHON:-python3}"
status=0
summary=()

ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
nvidia-smi > "$OUT_DIR/nvidia-smi.txt" 2>&1 || true
nvidia-smi topo -m >> "$OUT_DIR/nvidia-smi.txt" 2>&1 || true
if [[ -z "${JAX_UB_CUDA_ARCHS:-}" ]]; then
  cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d '.')
  case "$cc" in 90) export JAX_UB_CUDA_ARCHS=90a ;; "") ;; *) export JAX_UB_CUDA_ARCHS="$cc" ;; esac
fi

t0=$(date +%s)
if JAX_UB_REQUIRE_CUDA=1 "$PY" -m pip install --no-build-isolation --no-deps -e . > "$OUT_DIR/build.log" 2>&1; then
  summary+=("build: ok ($(( $(date +%s) - t0 )) s, archs ${JAX_UB_CUDA_ARCHS:-default})")
else
  summary+=("build: FAILED (see build.log)"); tail -40 "$OUT_DIR/build.log"; status=1
fi

"$PY" - > "$OUT_DIR/build_info.json" 2>> "$OUT_DIR/build.log" <<'PYEOF'
import json, jax_ub
print(json.dumps(jax_ub.build_info(), indent=1, default=str))
PYEOF
path=$("$PY" -c "import json,sys; d=json.load(open('$OUT_DIR/build_info.json')); print(d['path'], '-', d['reason'])" 2>/dev/null)
summary+=("build_info: ${path:-unavailable}")

run_pytest() {  # name, paths...
  local name="$1"; shift
  "$PY" -m pytest -q -rs -p no:cacheprovider ${PYTEST_ARGS:-} "$@" > "$OUT_DIR/pytest-$name.log" 2>&1
  local rc=$?
  local line
  line=$(grep -E "(passed|failed|error|skipped)" "$OUT_DIR/pytest-$name.log" | tail -1)
  summary+=("pytest $name: ${line:-no result} (rc $rc)")
  if [[ $rc -ne 0 && $rc -ne 5 ]]; then status=1; tail -60 "$OUT_DIR/pytest-$name.log"; fi
}

run_pytest gpu tests/gpu
if [[ "$ngpu" -ge 2 && -d tests/multigpu ]]; then
  run_pytest multigpu tests/multigpu
fi

if [[ -n "$BENCH" ]]; then
  IFS=',' read -ra benches <<< "$BENCH"
  for b in "${benches[@]}"; do
    if "$PY" -m jax_ub.bench "$b" --out "$OUT_DIR" > "$OUT_DIR/bench-$b.log" 2>&1; then
      summary+=("bench $b: ok"); tail -25 "$OUT_DIR/bench-$b.log"
    else
      summary+=("bench $b: FAILED"); tail -40 "$OUT_DIR/bench-$b.log"; status=1
    fi
  done
fi

echo "================ jax_ub GPU check ($ngpu GPU(s), $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)) ================"
for s in "${summary[@]}"; do echo "$s"; done
exit $status
