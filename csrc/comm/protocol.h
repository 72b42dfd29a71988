// The flag layout the communicator and its watchdog share (the protocol itself is described in
// comm/communicator.h).
#pragma once

#include <cstdint>

namespace jax_ub {

enum FlagSlot : int { kDataReady = 0, kAck = 1, kReady = 2, kPiece = 3, kNumFlagSlots = 4 };
constexpr uint64_t kPieceScale = 64;  // pieces per op: (world - 1) * pieces <= 15 * 4
constexpr int kMaxWorld = 16;
constexpr int kNumComputeStreams = 2;
static_assert(kMaxWorld + kNumComputeStreams <= 32, "stream bits of Communicator::Use");

}  // namespace jax_ub
