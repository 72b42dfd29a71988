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
// A block of `rows` rows of `width` bytes, `pitch` bytes apart in both src and dst, to a peer
// GPU's memory: CopyAsync when the rows are contiguous, else one 2-D copy (peer copies run on a
// copy engine).
cudaError_t CopyBlockToPeerAsync(void* dst, const void* src, size_t width, size_t rows,
                                 size_t pitch, cudaStream_t stream);

}  // namespace jax_ub
