// The NCCL part of the _jax_ub_cuda module (BindNccl, called from bind/module.cc): library
// queries, unique ids, and the table of NCCL communicators (comm/nccl_table.h) that
// jax_ub.comm uses for bootstrap="nccl".
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <string>

#include "bind/bind.h"
#include "comm/nccl.h"
#include "comm/nccl_table.h"

namespace jax_ub {
namespace {

std::string LoadError() {
  Status s = NcclLoad();
  return s.ok() ? std::string() : s.message();
}

nb::bytes UniqueId() {
  std::string id;
  Status s;
  {
    nb::gil_scoped_release nogil;
    s = NcclUniqueId(&id);
  }
  Raise(s);
  return nb::bytes(id.data(), id.size());
}

void CommCreate(int key, nb::bytes unique_id, int rank, int world, int device, double timeout_s) {
  std::string id(unique_id.c_str(), unique_id.size());
  Status s;
  {
    nb::gil_scoped_release nogil;
    s = NcclTableCreate(key, id, rank, world, device, timeout_s);
  }
  Raise(s);
}

int CommDestroy(int key) {
  int count = 0;
  Raise(NcclTableDestroy(key, &count));
  return count;
}

nb::bytes AllGatherBytes(int key, int device, nb::bytes data, double timeout_s) {
  std::shared_ptr<NcclComm> comm;
  Raise(NcclTableGet(key, device, &comm));
  std::string in(data.c_str(), data.size()), out;
  Status s;
  {
    nb::gil_scoped_release nogil;
    s = comm->AllGatherHost(in, &out, timeout_s);
  }
  Raise(s);
  return nb::bytes(out.data(), out.size());
}

// '' while healthy, else the pending asynchronous error or why the communicator is unusable.
std::string CommError(int key, int device) {
  std::shared_ptr<NcclComm> comm;
  Raise(NcclTableGet(key, device, &comm));
  Status s = comm->CheckAsync();
  return s.ok() ? std::string() : s.message();
}

}  // namespace

void BindNccl(nb::module_& m) {
  using nb::arg;
  auto nogil = nb::call_guard<nb::gil_scoped_release>();
  m.def("nccl_version", &NcclVersion, nogil,
        "ncclGetVersion() of the NCCL library jax_ub loads (e.g. 23203), or -1 when it cannot "
        "be loaded (never raises; nccl_load_error() says why).");
  m.def("nccl_library", &NcclLibraryPath, nogil,
        "Path of the loaded NCCL library, or '' when it cannot be loaded.");
  m.def("nccl_load_error", &LoadError, nogil, "'' when NCCL loads, else why it cannot.");
  m.def("nccl_api_checked", &NcclApiCheckedVersion,
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
  m.def("nccl_comm_list", &NcclTableList, "(key, device) of every live local NCCL communicator.");
}

}  // namespace jax_ub
