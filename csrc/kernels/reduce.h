// Reduction kernels for GEMM→RS: out = sum of `num_inputs` same-shaped buffers, accumulated in
// float32 whatever the storage type. Plain CUDA, no XLA headers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "common/status.h"
#include "gemm/cublaslt.h"

namespace jax_ub {

constexpr int kMaxReduceInputs = 16;

// out[i] = sum_j inputs[j][i] for i < count. `out` must not overlap any input (the kernels take it
// __restrict__). Inputs may live on peer GPUs (peer-mapped). Launches one kernel on `stream` using
// at most `max_blocks` blocks.
Status LaunchSumReduce(DType dtype, void* out, const void* const* inputs, int num_inputs,
                       size_t count, int max_blocks, cudaStream_t stream);
// The same over a [rows, cols] block whose rows are `ld` elements apart in `out` and every input
// (the column-block sums of GEMM->RS "columns").
Status LaunchSumReduceBlock(DType dtype, void* out, const void* const* inputs, int num_inputs,
                            size_t rows, size_t cols, size_t ld, int max_blocks,
                            cudaStream_t stream);

}  // namespace jax_ub
