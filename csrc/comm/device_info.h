// Host-side queries of the visible CUDA devices (no GPU work): what jax_ub.comm needs to name
// GPUs alike across processes and to check peer access, and what build_info() reports.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "common/status.h"

namespace jax_ub {

// The CUDA driver's version and the device count as the runtime sees them; `error` says why the
// count is unknown ("" where it is known).
struct RuntimeFacts {
  int driver_version = 0;  // 0 where the driver cannot say
  int device_count = 0;
  std::string error;
};
RuntimeFacts QueryRuntime();  // never fails

// PCI bus id ("0000:18:00.0", lower case) of every visible device; "" where CUDA cannot say. Lets
// processes that see different devices (CUDA_VISIBLE_DEVICES) name the same GPU alike.
std::vector<std::string> PciBusIds();

// can_access[i][j] for every pair of visible devices (1 on the diagonal).
std::vector<std::vector<int>> P2PMatrix();

// Free and total bytes of `device`.
Status DeviceMemory(int device, size_t* free_bytes, size_t* total_bytes);

// "" when the driver entry points jax_ub needs are present, else why not.
std::string DriverProblem();

}  // namespace jax_ub
