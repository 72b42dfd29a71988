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
// `host_mark` (host-mapped, may be null): a second word the watchdog sets by a plain host store
// (no copy to wait for) before it aborts NCCL; the check traps when either is nonzero.
Status LaunchCheckFlag(const uint64_t* flag, const uint64_t* host_mark, cudaStream_t stream);

// The poison word's value: 1 + the rank whose watchdog timed a wait out. That rank writes it into
// its own word and, on the ipc transport, into every peer's (see comm/communicator.h).
constexpr uint64_t PoisonValue(int rank) { return static_cast<uint64_t>(rank) + 1; }

// LaunchCheckFlag's check, then the op-id check of the ipc transport: `ids[q]` holds what peer q
// signalled at its Begin, (epoch << 32) | op hash. A peer whose entry has this op's epoch (`want`'s
// high half) but another hash ran another op at this epoch (its data may be wrong for this one):
// the report `report[1..3]` = (peer, its entry, want), then report[0] = epoch (host-mapped memory
// the judge reads), then __trap(). An entry of another epoch says nothing (not yet seen, or
// already overwritten by the peer's next op) and is skipped. A poisoned word is reported first:
// report[5] = epoch, then report[4] = the word, then __trap().
Status LaunchCheckOp(const uint64_t* poison, const uint64_t* ids, int world, int rank,
                     uint64_t want, uint64_t* report, cudaStream_t stream);

// Forces the current device to load jax_ub's kernels (flag check, copies, reductions) now.
Status PreloadFlagKernels();

}  // namespace jax_ub
