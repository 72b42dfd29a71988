// Who a peer process of this host is, and whether it still runs: read from /proc, no CUDA.
// Transport ipc's watchdog uses it to fail an op at once when a peer it waits for has exited
// (instead of after JAX_UB_TIMEOUT, with "is its process alive?").
#pragma once

#include <cstdint>
#include <string>

namespace jax_ub {

// A process as another process of this host can check it: its pid, its start time (clock ticks
// since boot: a pid reused by a new process differs there) and its pid namespace (a pid only
// means something in the namespace it came from).
struct ProcessId {
  int32_t pid = 0;
  int32_t reserved = 0;      // explicit: no padding bytes travel to the peers
  uint64_t start_ticks = 0;  // 0: unknown
  uint64_t pidns_dev = 0, pidns_ino = 0;
};
static_assert(sizeof(ProcessId) == 32, "ProcessId travels in the IPC handle blob: no padding");

ProcessId ThisProcess();

// Whether `p` (as it described itself) can be checked from this process: the same pid namespace,
// and /proc shows that pid with that start time now. Not checkable: never judged gone.
bool Checkable(const ProcessId& p);

// "" where Checkable(p); else why not, in words ("it runs in another pid namespace", ...).
std::string WhyNotCheckable(const ProcessId& p);

// "" while `p` runs (or cannot be told); else what became of it: "has exited", "has exited (a
// zombie, not yet reaped by its parent)", "has exited (its pid now belongs to another process)".
std::string ProcessGone(const ProcessId& p);

}  // namespace jax_ub
