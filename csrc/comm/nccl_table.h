// A process-wide table of NCCL communicators keyed by (key, CUDA device): what bootstrap="nccl"
// (jax_ub.comm) creates, all-gathers over and destroys, and what transport nccl moves into a
// member's Communicator (AttachNccl). Python never sees an ncclComm_t.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "comm/nccl.h"
#include "common/status.h"

namespace jax_ub {

// Creates rank `rank` of `world` on `device` (ncclCommInitRank, bounded by timeout_s) under
// (key, device); fails where that entry exists.
Status NcclTableCreate(int key, const std::string& unique_id, int rank, int world, int device,
                       double timeout_s);
// Destroys every communicator with `key` (all local devices); `count` receives how many there
// were. The error joins every destroy's failure, one a line.
Status NcclTableDestroy(int key, int* count);
// The communicator (key, device), or null where there is none.
std::shared_ptr<NcclComm> NcclTableFind(int key, int device);
// The same, failing with a message that names the entry where there is none.
Status NcclTableGet(int key, int device, std::shared_ptr<NcclComm>* out);
// Removes (key, device) from the table, only if the entry is still `which`.
void NcclTableForget(int key, int device, const NcclComm* which);
// (key, device) of every entry.
std::vector<std::pair<int, int>> NcclTableList();

}  // namespace jax_ub
