// The NCCL part of the _jax_ub_cuda module (bound by BindNccl from module.cc): library queries,
// unique ids, and a process-wide table of NCCL communicators keyed by (key, CUDA device), used by
// jax_ub/_nccl.py for bootstrap="nccl". Python never sees an ncclComm_t.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "comm/nccl.h"

namespace nb = nanobind;

namespace {

using CommKey = std::pair<int, int>;  // (key, device)

std::mutex g_mu;
std::map<CommKey, std::shared_ptr<jax_ub::NcclComm>>& Comms() {
  static auto* m = new std::map<CommKey, std::shared_ptr<jax_ub::NcclComm>>();  // never destroyed
  return *m;
}

void Raise(const jax_ub::Status& s) {
  if (!s.ok()) throw std::runtime_error(s.message());
}

std::shared_ptr<jax_ub::NcclComm> Find(int key, int device) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = Comms().find({key, device});
  if (it == Comms().end()) {
    throw std::runtime_error(jax_ub::StrCat() << "jax_ub NCCL: no NCCL communicator with key "
                                              << key << " on CUDA device " << device
                                              << " (nccl_comm_create was not called, or it was "
                                                 "destroyed)");
  }
  return it->second;
}

int Version() { return jax_ub::NcclVersion(); }

std::string LoadError() {
  jax_ub::Status s = jax_ub::NcclLoad();
  return s.ok() ? std::string() : s.message();
}

nb::bytes UniqueId() {
  std::string id;
  jax_ub::Status s;
  {
    nb::gil_scoped_release nogil;
    s = jax_ub::NcclUniqueId(&id);
  }
  Raise(s);
  return nb::bytes(id.data(), id.size());
}

void CommCreate(int key, nb::bytes unique_id, int rank, int world, int device, double timeout_s) {
  std::string id(unique_id.c_str(), unique_id.size());
  jax_ub::Status s;
  {
    nb::gil_scoped_release nogil;
    s = [&]() -> jax_ub::Status {
      {
        std::lock_guard<std::mutex> lock(g_mu);
        if (Comms().count({key, device})) {
          return jax_ub::Status::Error(jax_ub::StrCat()
                                       << "jax_ub NCCL: an NCCL communicator with key " << key
                                       << " already exists on CUDA device " << device
                                       << "; nccl_comm_destroy(" << key << ") it first");
        }
      }
      std::unique_ptr<jax_ub::NcclComm> comm;
      JAX_UB_RETURN_IF_ERROR(
          jax_ub::NcclComm::Create(id, rank, world, device, timeout_s, &comm));
      std::lock_guard<std::mutex> lock(g_mu);
      auto& slot = Comms()[{key, device}];
      if (slot) {  // a concurrent create for the same (key, device) won
        comm->Destroy();
        return jax_ub::Status::Error(jax_ub::StrCat()
                                     << "jax_ub NCCL: two communicators with key " << key
                                     << " were created concurrently on CUDA device " << device);
      }
      slot = std::move(comm);
      return jax_ub::Status::Ok();
    }();
  }
  Raise(s);
}

// Destroys every communicator with `key` (all local devices); returns how many there were.
int CommDestroy(int key) {
  std::vector<std::shared_ptr<jax_ub::NcclComm>> doomed;
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
  std::string errors;
  for (auto& c : doomed) {
    jax_ub::Status s = c->Destroy();
    if (!s.ok()) errors += (errors.empty() ? "" : "\n") + s.message();
  }
  if (!errors.empty()) throw std::runtime_error(errors);
  return static_cast<int>(doomed.size());
}

nb::bytes AllGatherBytes(int key, int device, nb::bytes data, double timeout_s) {
  std::shared_ptr<jax_ub::NcclComm> comm = Find(key, device);
  std::string in(data.c_str(), data.size()), out;
  jax_ub::Status s;
  {
    nb::gil_scoped_release nogil;
    s = comm->AllGatherHost(in, &out, timeout_s);
  }
  Raise(s);
  return nb::bytes(out.data(), out.size());
}

// '' while healthy, else the pending asynchronous error or why the communicator is unusable.
std::string CommError(int key, int device) {
  std::shared_ptr<jax_ub::NcclComm> comm = Find(key, device);
  jax_ub::Status s = comm->CheckAsync();
  return s.ok() ? std::string() : s.message();
}

std::vector<std::pair<int, int>> CommList() {
  std::lock_guard<std::mutex> lock(g_mu);
  std::vector<std::pair<int, int>> out;
  for (const auto& kv : Comms()) out.push_back(kv.first);
  return out;
}

}  // namespace

std::shared_ptr<jax_ub::NcclComm> NcclFind(int key, int device) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = Comms().find({key, device});
  return it == Comms().end() ? nullptr : it->second;
}

void NcclForget(int key, int device, const jax_ub::NcclComm* which) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = Comms().find({key, device});
  if (it != Comms().end() && it->second.get() == which) Comms().erase(it);
}

void BindNccl(nb::module_& m) {
  using nb::arg;
  auto nogil = nb::call_guard<nb::gil_scoped_release>();
  m.def("nccl_version", &Version, nogil,
        "ncclGetVersion() of the NCCL library jax_ub loads (e.g. 23203), or -1 when it cannot "
        "be loaded (never raises; nccl_load_error() says why).");
  m.def("nccl_library", &jax_ub::NcclLibraryPath, nogil,
        "Path of the loaded NCCL library, or '' when it cannot be loaded.");
  m.def("nccl_load_error", &LoadError, nogil, "'' when NCCL loads, else why it cannot.");
  m.def("nccl_api_checked", &jax_ub::NcclApiCheckedVersion,
        "NCCL_VERSION_CODE of the nccl.h jax_ub's declarations were checked against at build "
        "time, or 0.");
  m.def("nccl_unique_id", &UniqueId,
        "A new ncclUniqueId (128 bytes). Call on one rank (rank 0) and publish it; this process "
        "hosts NCCL's bootstrap root until every rank has created its communicator.");
  m.def("nccl_comm_create", &CommCreate, arg("key"), arg("unique_id"), arg("rank"), arg("world"),
        arg("device"), arg("timeout_s"),
        "Creates rank `rank` of `world` on `device` (ncclCommInitRank), stored under (key, "
        "device). Blocks until every rank has joined, at most timeout_s (then raises naming this "
        "member). Several ranks living in one process: one thread per rank (the GIL is released).");
  m.def("nccl_comm_destroy", &CommDestroy, arg("key"), nogil,
        "Destroys every local communicator with `key`; returns how many.");
  m.def("nccl_allgather_bytes", &AllGatherBytes, arg("key"), arg("device"), arg("data"),
        arg("timeout_s") = 0.0,
        "All-gathers `data` (same length on every rank) over NCCL: world * len(data) bytes in "
        "rank order. Bounded by timeout_s (<= 0: the communicator's); on timeout the "
        "communicator is aborted.");
  m.def("nccl_comm_error", &CommError, arg("key"), arg("device"),
        "'' while the communicator is healthy, else its asynchronous error / why it is unusable.");
  m.def("nccl_comm_list", &CommList, "(key, device) of every live local NCCL communicator.");
}
