// Tiny kernels around flag waits. No XLA headers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/status.h"

namespace jax_ub {

// Added by the watchdog to a flag it force-releases after a timeout; CheckFlag traps on it so the
// stream (and XLA's call) fails instead of computing on missing data. Epochs stay far below it.
constexpr uint64_t kTimeoutMark = uint64_t(1) << 40;

// One thread: if *flag >= kTimeoutMark, __trap() (the watchdog has already printed why).
Status LaunchCheckFlag(const uint64_t* flag, cudaStream_t stream);

// Forces the current device to load jax_ub's kernels (flag check, reductions) now.
Status PreloadFlagKernels();

}  // namespace jax_ub
