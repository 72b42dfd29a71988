// Tiny kernels around flag waits. No XLA headers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/status.h"

namespace jax_ub {

// Added by the watchdog to a flag it force-releases after a timeout (so the wait ends); epochs stay
// far below it.
constexpr uint64_t kTimeoutMark = uint64_t(1) << 40;

// One thread: if *flag != 0 (the communicator's poison word, set by the watchdog before it
// releases a timed-out wait), __trap(): the call fails; the watchdog has already printed why.
Status LaunchCheckFlag(const uint64_t* flag, cudaStream_t stream);

// Forces the current device to load jax_ub's kernels (flag check, copies, reductions) now.
Status PreloadFlagKernels();

}  // namespace jax_ub
