#!/usr/bin/env bash
# Compiles csrc/comm/nccl_api_check.cc against the nccl.h of the installed nvidia-nccl wheel: the
# NCCL API that csrc/comm/nccl_api.h declares (types, values, signatures, the ncclConfig_t prefix)
# must match it. The build does the same when CMake finds that header; this says so explicitly.
set -euo pipefail
INC=$(python3 -c "import nvidia.nccl as m, os; print(os.path.join(list(m.__path__)[0], 'include'))")
CUDA_INC=$(dirname "$(dirname "$(command -v nvcc)")")/include
grep -m2 -E "define NCCL_(MAJOR|MINOR)" "$INC/nccl.h"
g++ -std=c++17 -fsyntax-only -DJAX_UB_HAVE_NCCL_H=1 -I csrc -I "$INC" -I "$CUDA_INC" \
  csrc/comm/nccl_api_check.cc
echo "API_CHECK_OK against $INC/nccl.h"
