// Test hooks of the communicator and the copy kernel: what jax_ub's own tests call to make an op
// fail on purpose, or to check a kernel in isolation. No jax_ub op calls them.
#pragma once

#include <cstddef>

#include "common/enums.h"
#include "common/status.h"

namespace jax_ub {

class Communicator;

// comm_inject_failure's `what`: the next op on the member fails before it begins (kBefore) or right
// after (kAfter); the watchdog's reader sits as if blocked in a CUDA call (kStallWatchdog); the
// reader never copies the poison word to the GPU (kDropPoison); kNone clears them all.
#define JAX_UB_FAILURES(X)               \
  X(kNone, "none", 0)                    \
  X(kBefore, "before", 1)                \
  X(kAfter, "after", 2)                  \
  X(kStallWatchdog, "stall_watchdog", 3) \
  X(kDropPoison, "drop_poison", 4)
enum class Failure : int { JAX_UB_FAILURES(JAX_UB_ENUMERATOR) };
// false where `what` names no Failure.
bool ToFailure(int what, Failure* out);
Status InjectFailure(Communicator* c, Failure what);

// The bounded-block copy kernel (kernels/copy.h): copies `bytes` random bytes from offset
// src_offset of one buffer to offset dst_offset of a poisoned one (offsets 0..15 reach every
// misalignment); `wrong` receives the wrong bytes in the copied range, `outside` the bytes changed
// outside it.
Status CopyCheck(int device, size_t bytes, int dst_offset, int src_offset, int max_blocks,
                 size_t* wrong, size_t* outside);

}  // namespace jax_ub
