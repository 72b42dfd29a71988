#!/usr/bin/env bash
# One device call made of named steps, each under its own time limit, logs tarred into $OUT:
#   bash scripts/session_steps.sh 'name|seconds|command' ...
# e.g. 'rs|150|python3 -m jax_ub.bench rs --tp 4 --timeline --out $R'  ($R: results dir, $L: logs)
# $OUT/out.tgz (results/, logs/) is rewritten after every step, so a call that the device's limit
# kills still returns what its finished steps wrote, as one file (the device returns at most 8).
# DEADLINE_S (seconds from the start, optional) cuts each step's limit so that the last tar lands
# before a device limit shorter than the steps' sum. SESSION_WHEEL (a wheel built elsewhere for the
# device's Python, e.g. .whl/jax_ub-*-cp312-*.whl carried) is installed instead of building, when its
# extension loads; otherwise the step builds from the checkout as usual. (Not JAX_UB_*: jax_ub warns
# at every import about a JAX_UB_ variable that is not one of its settings.) To make the wheel here:
#   JAX_UB_CUDA_ARCHS=90a JAX_UB_REQUIRE_CUDA=1 <python3.12 with jax==<device's> nanobind
#   scikit-build-core cmake ninja>/bin/pip wheel --no-build-isolation --no-deps -w .whl .
# (saved 30-60 s of a 4-GPU call in the forty-first session; .whl/ is git-ignored, name it in carry).
set -uo pipefail
OUT_DIR="${OUT:-./gpu_out}"
WORK="$(mktemp -d)"
export R="$WORK/results" L="$WORK/logs"
mkdir -p "$R" "$L" "$OUT_DIR"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 UB_SKIPMC=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_UB_TIMEOUT=${JAX_UB_TIMEOUT:-30}
t0=$(date +%s)
step() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }
pack() { tar czf "$OUT_DIR/out.tgz.tmp" -C "$WORK" results logs && mv "$OUT_DIR/out.tgz.tmp" "$OUT_DIR/out.tgz"; }
step build
built=0
if [[ -n "${SESSION_WHEEL:-}" ]]; then
  python3 -m pip install --no-deps --force-reinstall "$SESSION_WHEEL" > "$L/build.log" 2>&1 \
    && python3 -c "import jax_ub, sys; i = jax_ub.build_info(); print(i['reason']); sys.exit(0 if i['extension_loaded'] else 1)" >> "$L/build.log" 2>&1 \
    && built=1
  tail -2 "$L/build.log"
fi
if [[ $built == 0 ]]; then
  JAX_UB_CUDA_ARCHS=90a JAX_UB_REQUIRE_CUDA=1 python3 -m pip install --no-build-isolation --no-deps -e . >> "$L/build.log" 2>&1 || { tail -30 "$L/build.log"; pack; exit 1; }
fi
pack
for spec in "$@"; do
  IFS='|' read -r name limit cmd <<< "$spec"
  if [[ -n "${DEADLINE_S:-}" ]]; then
    left=$(( DEADLINE_S - ($(date +%s) - t0) ))
    (( left < 10 )) && { echo "== $name skipped: ${left} s left before DEADLINE_S"; continue; }
    (( left < limit )) && limit=$left
  fi
  step "$name (limit ${limit} s)"
  timeout -k 5 "$limit" bash -c "$cmd" > "$L/$name.log" 2>&1
  echo "rc=$?"
  grep -v "^\[bench\]\|^W0\|^I0\|^E0" "$L/$name.log" | grep -E "passed|failed|error|Error|speedup|merged|T/T|jax_ub|gemm|comm|xla|ms" | tail -${TAILN:-16}
  pack
done
step done
