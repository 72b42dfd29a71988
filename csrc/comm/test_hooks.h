// Test hooks of the communicator and the copy kernel: what jax_ub's own tests call to make an op
// fail on purpose, or to check a kernel in isolation. No jax_ub op calls them.
#pragma once

#include <cstddef>

#include "common/status.h"

namespace jax_ub {

class Communicator;

// comm_inject_failure's `what` (0 to 4; jax_ub.comm's _inject_failure names them).
Status InjectFailure(Communicator* c, int what);

// The bounded-block copy kernel (kernels/copy.h): copies `bytes` random bytes from offset
// src_offset of one buffer to offset dst_offset of a poisoned one (offsets 0..15 reach every
// misalignment); `wrong` receives the wrong bytes in the copied range, `outside` the bytes changed
// outside it.
Status CopyCheck(int device, size_t bytes, int dst_offset, int src_offset, int max_blocks,
                 size_t* wrong, size_t* outside);

}  // namespace jax_ub
