// A same-device copy as a kernel of a bounded number of blocks. Plain CUDA, no XLA headers.
//
// A same-device cudaMemcpyAsync runs on SMs too (docs/performance.md, "Copy engines and
// SMs"), but on as many as it finds: beside a persistent GEMM that holds every SM it waits for the
// GEMM to end. This kernel takes at most `max_blocks` blocks, so it runs at once beside a GEMM
// that was told to leave that many SMs free (cuBLASLt's SM-count target).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "common/status.h"

namespace jax_ub {

// dst[0, bytes) = src[0, bytes) on `stream`, one kernel of at most `max_blocks` blocks (>= 1).
// Every block keeps several 16-byte loads per thread in flight, so a few SMs move data at a large
// share of what the whole GPU's copy reaches.
// Every copy kernel loaded on the current device, and the bulk (TMA) copy's shared memory allowed
// there: once per device (communicator creation) before any LaunchCopy on it.
Status PreloadCopyKernels();

Status LaunchCopy(void* dst, const void* src, size_t bytes, int max_blocks, cudaStream_t stream);

}  // namespace jax_ub
