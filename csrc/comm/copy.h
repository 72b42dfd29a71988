// Device-to-device copies that stay on the copy engines while GEMMs run.
//
// A plain cudaMemcpyAsync within one GPU may run as a kernel; next to a persistent GEMM that holds
// every SM it then waits for SMs (and steals them back from the GEMM). CopyAsync asks for a copy
// engine (cudaMemcpyBatchAsync with cudaMemcpyFlagPreferOverlapWithCompute, CUDA >= 12.8) and
// falls back to cudaMemcpyAsync where that is not supported.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace jax_ub {

cudaError_t CopyAsync(void* dst, const void* src, size_t bytes, cudaStream_t stream);

}  // namespace jax_ub
