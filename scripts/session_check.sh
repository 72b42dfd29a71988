#!/usr/bin/env bash
# One device call: build, doctor (auto and nccl), the NCCL-transport and multi-process tiers, a
# subset of the overlap tier, the GEMM tuning probe. Logs under $OUT, one tarball.
#   bash scripts/session_check.sh [pytest -k expression for test_overlap.py]
set -uo pipefail
OUT_DIR="${OUT:-./gpu_out}"
mkdir -p "$OUT_DIR/logs"
L="$OUT_DIR/logs"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 UB_SKIPMC=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_UB_TIMEOUT=30
K="${1:-push or gradients or bulk or timeline or scan or dp_by_tp}"
t0=$(date +%s)
step() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }
step build
JAX_UB_CUDA_ARCHS=90a JAX_UB_REQUIRE_CUDA=1 python3 -m pip install --no-build-isolation --no-deps -e . > "$L/build.log" 2>&1 || { tail -30 "$L/build.log"; exit 1; }
step doctor
timeout -k 5 120 python3 -m jax_ub.doctor > "$L/doctor.txt" 2>&1; echo "doctor rc=$?" >> "$L/doctor.txt"
JAX_UB_TRANSPORT=nccl timeout -k 5 120 python3 -m jax_ub.doctor > "$L/doctor_nccl.txt" 2>&1; echo "doctor rc=$?" >> "$L/doctor_nccl.txt"
tail -3 "$L/doctor.txt" "$L/doctor_nccl.txt"
step tune
timeout -k 5 120 python3 scripts/tune_probe.py > "$L/tune.txt" 2>&1; tail -20 "$L/tune.txt"
step nccl
timeout -k 5 200 python3 -m pytest -q -x -rs -p no:cacheprovider tests/multigpu/test_nccl_transport.py > "$L/nccl.log" 2>&1; tail -15 "$L/nccl.log"
step multiprocess
timeout -k 5 260 python3 -m pytest -q -rs -s -p no:cacheprovider tests/multigpu/test_multiprocess.py > "$L/mp.log" 2>&1; grep -E "rank|passed|failed|Error" "$L/mp.log" | tail -30
step overlap
timeout -k 5 150 python3 -m pytest -q -x -rs -p no:cacheprovider tests/multigpu/test_overlap.py -k "$K" > "$L/overlap.log" 2>&1; tail -8 "$L/overlap.log"
step done
tar czf "$OUT_DIR/logs.tgz" -C "$OUT_DIR" logs && rm -rf "$L"
