// CUDA driver entry points that jax_ub needs, reached at run time through the runtime's
// cudaGetDriverEntryPoint (no -lcuda at link time: build machines have no libcuda).
#pragma once

#include <cuda.h>  // types only
#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/status.h"

namespace jax_ub {

struct Driver {
  CUresult (*StreamWaitValue64)(CUstream, CUdeviceptr, cuuint64_t, unsigned int) = nullptr;
  CUresult (*StreamWriteValue64)(CUstream, CUdeviceptr, cuuint64_t, unsigned int) = nullptr;
  CUresult (*GetErrorString)(CUresult, const char**) = nullptr;
};

// Loaded once; returns an error naming the missing entry point.
Status GetDriver(const Driver** out);

// Stream-ordered 64-bit flag operations (0 SMs): wait until (int64)(*addr - value) >= 0; write value.
Status StreamWaitGeq(cudaStream_t s, const uint64_t* addr, uint64_t value);
Status StreamWrite(cudaStream_t s, uint64_t* addr, uint64_t value);

}  // namespace jax_ub
