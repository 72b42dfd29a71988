// Scratch filling for trace-time GEMM tuning. Plain CUDA, no XLA headers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/status.h"
#include "gemm/cublaslt.h"

namespace jax_ub {

// p[i] = uniform in [-1, 1) from a hash of (i, seed), for i < count. A GEMM's speed depends on its
// data (a constant pattern toggles fewer bits, draws less power and runs at higher clocks than real
// activations, and ranks cuBLASLt's candidates otherwise), so tuning times random values.
Status LaunchFillUniform(DType dtype, void* p, size_t count, uint32_t seed, cudaStream_t stream);

}  // namespace jax_ub
