#include "comm/nccl_table.h"

#include <map>
#include <mutex>

namespace jax_ub {
namespace {

using CommKey = std::pair<int, int>;  // (key, device)

std::mutex g_mu;
std::map<CommKey, std::shared_ptr<NcclComm>>& Comms() {
  static auto* m = new std::map<CommKey, std::shared_ptr<NcclComm>>();  // never destroyed
  return *m;
}

}  // namespace

Status NcclTableCreate(int key, const std::string& unique_id, int rank, int world, int device,
                       double timeout_s) {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (Comms().count({key, device})) {
      return Status::Error(StrCat() << "jax_ub NCCL: an NCCL communicator with key " << key
                                    << " already exists on CUDA device " << device
                                    << "; nccl_comm_destroy(" << key << ") it first");
    }
  }
  std::unique_ptr<NcclComm> comm;
  JAX_UB_RETURN_IF_ERROR(NcclComm::Create(unique_id, rank, world, device, timeout_s, &comm));
  std::lock_guard<std::mutex> lock(g_mu);
  auto& slot = Comms()[{key, device}];
  if (slot) {  // a concurrent create for the same (key, device) won
    comm->Destroy();
    return Status::Error(StrCat() << "jax_ub NCCL: two communicators with key " << key
                                  << " were created concurrently on CUDA device " << device);
  }
  slot = std::move(comm);
  return Status::Ok();
}

Status NcclTableDestroy(int key, int* count) {
  std::vector<std::shared_ptr<NcclComm>> doomed;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    for (auto it = Comms().begin(); it != Comms().end();) {
      if (it->first.first == key) {
        doomed.push_back(std::move(it->second));
        it = Comms().erase(it);
      } else {
        ++it;
      }
    }
  }
  *count = static_cast<int>(doomed.size());
  std::string errors;
  for (auto& c : doomed) {
    Status s = c->Destroy();
    if (!s.ok()) errors += (errors.empty() ? "" : "\n") + s.message();
  }
  return errors.empty() ? Status::Ok() : Status::Error(errors);
}

std::shared_ptr<NcclComm> NcclTableFind(int key, int device) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = Comms().find({key, device});
  return it == Comms().end() ? nullptr : it->second;
}

Status NcclTableGet(int key, int device, std::shared_ptr<NcclComm>* out) {
  *out = NcclTableFind(key, device);
  if (*out != nullptr) return Status::Ok();
  return Status::Error(StrCat() << "jax_ub NCCL: no NCCL communicator with key " << key
                                << " on CUDA device " << device
                                << " (nccl_comm_create was not called, or it was destroyed)");
}

void NcclTableForget(int key, int device, const NcclComm* which) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = Comms().find({key, device});
  if (it != Comms().end() && it->second.get() == which) Comms().erase(it);
}

std::vector<std::pair<int, int>> NcclTableList() {
  std::lock_guard<std::mutex> lock(g_mu);
  std::vector<std::pair<int, int>> out;
  for (const auto& kv : Comms()) out.push_back(kv.first);
  return out;
}

}  // namespace jax_ub
