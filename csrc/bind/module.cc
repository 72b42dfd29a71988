// The nanobind module _jax_ub_cuda: the registry of FFI handlers (one entry per custom-call target,
// registered for platform CUDA by jax_ub/_ext.py) and the bindings of host-side functions. Each
// binding decodes its arguments, calls jax_ub's core, and converts the result or error; the work
// is done elsewhere. No GPU work happens at import.
#include <cuda_runtime_api.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "bind/bind.h"
#include "comm/communicator.h"
#include "comm/device_info.h"
#include "comm/nccl_table.h"
#include "comm/process.h"
#include "comm/test_hooks.h"
#include "comm/trace.h"
#include "common/dynlib.h"
#include "common/nvtx.h"
#include "ffi/bulk.h"
#include "ffi/gemm.h"
#include "ffi/overlap.h"
#include "ffi/test_hooks.h"
#include "gemm/cublaslt.h"
#include "gemm/warmup.h"

namespace nb = nanobind;

namespace jax_ub {
namespace {

template <typename Fn>
nb::capsule Capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

nb::dict Registrations() {
  nb::dict d;
  // target name -> execute-stage handler capsule; jax_ub/_ext.py registers every entry.
  d["jax_ub_gemm"] = Capsule(JaxUbGemm);
  d["jax_ub_ag_gemm"] = Capsule(JaxUbAgGemm);
  d["jax_ub_all_gather"] = Capsule(JaxUbAllGather);
  d["jax_ub_gemm_rs"] = Capsule(JaxUbGemmRs);
  d["jax_ub_reduce_scatter"] = Capsule(JaxUbReduceScatter);
  d["jax_ub_bulk"] = Capsule(JaxUbBulk);
  d["jax_ub_test_unwritten"] = Capsule(JaxUbTestUnwritten);  // tests/gpu/test_poison.py
  return d;
}

nb::dict BuildInfo() {
  nb::dict d;
  d["cuda_runtime_version"] = CUDART_VERSION;
  d["cublaslt_api_checked"] = CublasLtApiChecked();
  d["nvtx"] = nvtx::kCompiled;  // ops and chunk steps open NVTX ranges (common/nvtx.h)
#ifdef JAX_UB_CUDA_ARCHS
  d["cuda_archs"] = std::string(JAX_UB_CUDA_ARCHS);
#endif
#ifdef JAX_UB_NVCC_VERSION
  d["nvcc_version"] = std::string(JAX_UB_NVCC_VERSION);
#endif
#ifdef JAX_UB_SOURCE_HASH
  d["source_hash"] = std::string(JAX_UB_SOURCE_HASH);  // of csrc/ (cmake/source_hash.cmake)
#endif
  return d;
}

// Driver and devices as seen by the CUDA runtime; never raises.
nb::dict RuntimeInfo() {
  const RuntimeFacts f = QueryRuntime();
  nb::dict d;
  d["driver_version"] = f.driver_version;
  d["device_count"] = f.device_count;
  if (!f.error.empty()) d["error"] = f.error;
  return d;
}

Communicator* Get(int set_id, int device) {
  // The Python bindings run under jax_ub.comm's lock, as do initialize and shutdown: the registry
  // keeps the object alive while they use it.
  Communicator* c = RegistryGet(set_id, device).get();
  if (c == nullptr) {
    throw std::runtime_error(StrCat()
                             << "no communicator for device " << device << " in set " << set_id);
  }
  return c;
}

void CommCreate(int set_id, int group, int rank, int world, int device, size_t capacity,
                double timeout_s, bool local_only, bool nccl, bool abort_on_stall) {
  Communicator::Options o;
  o.set_id = set_id;
  o.group = group;
  o.rank = rank;
  o.world = world;
  o.device = device;
  o.capacity = capacity;
  o.timeout_s = timeout_s;
  o.local_only = local_only && !nccl;
  o.nccl = nccl;
  o.abort_on_stall = abort_on_stall;
  std::unique_ptr<Communicator> c;
  Raise(Communicator::Create(o, &c));
  Raise(RegistryAdd(std::move(c)));
}

void CommAttachNccl(int set_id, int device, int key) {
  std::shared_ptr<NcclComm> n = NcclTableFind(key, device);
  if (n == nullptr) {
    throw std::runtime_error(StrCat() << "comm_attach_nccl: no NCCL communicator " << key
                                      << " on device " << device);
  }
  // Out of the table only once attached: a failed attach leaves it there, where
  // nccl_comm_destroy still finds and frees it (dropping it would leak the NCCL
  // communicator, whose destructor makes no NCCL call).
  Raise(Get(set_id, device)->AttachNccl(n));
  NcclTableForget(key, device, n.get());
}

void CommConnectLocal(int set_id, int device, int peer, int peer_device) {
  Raise(Get(set_id, device)->ConnectLocal(peer, *Get(set_id, peer_device)));
}

nb::bytes CommExportIpc(int set_id, int device) {
  std::string blob = Get(set_id, device)->ExportIpc();
  if (blob.empty()) {
    throw std::runtime_error(StrCat()
                             << "cudaIpcGetMemHandle failed on device " << device
                             << ": this GPU/driver cannot export memory to other processes");
  }
  return nb::bytes(blob.data(), blob.size());
}

// Returns "" when the peer's process can be watched for an exit, else why not.
std::string CommConnectIpc(int set_id, int device, int peer, nb::bytes blob) {
  std::string unchecked;
  Raise(Get(set_id, device)->ConnectIpc(peer, std::string(blob.c_str(), blob.size()), &unchecked));
  return unchecked;
}

void CommInjectFailure(int set_id, int device, int what) {
  Failure f;
  if (!ToFailure(what, &f)) {
    throw std::invalid_argument(StrCat()
                                << "comm_inject_failure: what must be 0 to 4; got " << what);
  }
  Raise(InjectFailure(Get(set_id, device), f));
}

nb::dict GemmWarmupBinding(int device, int64_t m, int64_t n, int64_t k, int dtype, bool tf32,
                           size_t workspace_bytes, int tune_candidates, bool accumulate,
                           int reserve_sms, int64_t ld, int tune_reps, bool unaligned_a,
                           bool unaligned_c, bool trans_a, bool trans_b) {
  GemmWarmupArgs a;
  a.device = device;
  a.m = m;
  a.n = n;
  a.k = k;
  a.dtype = static_cast<DType>(dtype);
  a.tf32 = tf32;
  a.workspace_bytes = workspace_bytes;
  a.tune_candidates = tune_candidates;
  a.accumulate = accumulate;
  a.reserve_sms = reserve_sms;
  a.ld = ld;
  a.tune_reps = tune_reps;
  a.unaligned_a = unaligned_a;
  a.unaligned_c = unaligned_c;
  a.trans_a = trans_a;
  a.trans_b = trans_b;
  GemmTuneResult tune;
  Status status;
  {
    nb::gil_scoped_release nogil;
    status = GemmWarmup(a, &tune);
  }
  Raise(status);
  nb::dict d;
  d["tuned"] = tune.candidates > 0 || tune.cached;
  d["candidates"] = tune.candidates;
  d["chosen"] = tune.chosen;
  d["heuristic_ms"] = tune.heuristic_ms;
  d["best_ms"] = tune.best_ms;
  return d;
}

std::pair<size_t, size_t> CopyCheckBinding(int device, size_t bytes, int dst_offset, int src_offset,
                                           int max_blocks) {
  if (dst_offset < 0 || dst_offset > 15 || src_offset < 0 || src_offset > 15) {
    throw std::invalid_argument(StrCat() << "copy_check: offsets must be in [0, 15]; got "
                                         << dst_offset << ", " << src_offset);
  }
  size_t wrong = 0, outside = 0;
  Raise(CopyCheck(device, bytes, dst_offset, src_offset, max_blocks, &wrong, &outside));
  return {wrong, outside};
}

std::pair<size_t, size_t> DeviceMemoryBinding(int device) {
  size_t free_b = 0, total_b = 0;
  Raise(DeviceMemory(device, &free_b, &total_b));
  return {free_b, total_b};
}

nb::list TraceCollectBinding() {
  nb::list out;
  for (const TraceRecord& r : TraceCollect()) {
    nb::dict d;
    d["device"] = r.device;
    d["rank"] = r.rank;
    d["op"] = r.op;
    d["epoch"] = r.epoch;
    d["name"] = r.name;
    d["chunk"] = r.chunk;
    d["stream"] = r.stream;
    d["start_ms"] = r.start_ms;
    d["end_ms"] = r.end_ms;
    d["op_start_ms"] = r.op_start_ms;
    out.append(d);
  }
  return out;
}

std::vector<uint64_t> ThisProcessBinding() {
  const ProcessId p = ThisProcess();
  return {static_cast<uint64_t>(p.pid), p.start_ticks, p.pidns_dev, p.pidns_ino};
}

nb::tuple ProcessGoneBinding(std::vector<uint64_t> p) {
  if (p.size() != 4) throw std::invalid_argument("process_gone: need 4 numbers");
  ProcessId id;
  id.pid = static_cast<int32_t>(p[0]);
  id.start_ticks = p[1];
  id.pidns_dev = p[2];
  id.pidns_ino = p[3];
  return nb::make_tuple(Checkable(id), ProcessGone(id), WhyNotCheckable(id));
}

}  // namespace
}  // namespace jax_ub

NB_MODULE(_jax_ub_cuda, m) {
  namespace ub = jax_ub;
  using nb::arg;
  auto nogil = nb::call_guard<nb::gil_scoped_release>();
  m.doc() = "jax_ub CUDA extension: XLA FFI handlers for overlapped TP GEMM/communication.";
  m.def("registrations", &ub::Registrations, "FFI target name -> {stage: PyCapsule}");
  m.def("build_info", &ub::BuildInfo, "How this extension was compiled.");
  m.def("this_process", &ub::ThisProcessBinding,
        "[pid, start ticks, pid namespace dev, inode]: how this process describes itself to its "
        "ipc peers (the watchdog's liveness check).");
  m.def("process_gone", &ub::ProcessGoneBinding, arg("process"),
        "(checkable, what became of it ('' while it runs), why it is not checkable ('' where it "
        "is)) for a this_process() of another process of this host.");
  m.def("runtime_info", &ub::RuntimeInfo, "CUDA driver version and device count (no exceptions).");
  m.def("set_library_candidates", &ub::SetLibraryCandidates, arg("lib"), arg("paths"),
        "Paths to try, in order, when dlopen()ing `lib` ('cublasLt' or 'nccl').");
  m.def("cublaslt_description", &ub::CublasLtDescription,
        "Loads cuBLASLt if needed and says which library is used, or why it cannot be loaded.");
  m.def("gemm_plan_cache_size", &ub::GemmPlanCacheSize);
  m.def("comm_create", &ub::CommCreate, arg("set_id"), arg("group"), arg("rank"), arg("world"),
        arg("device"), arg("capacity"), arg("timeout_s"), arg("local_only") = false,
        arg("nccl") = false, arg("abort_on_stall") = true, nogil,
        "Creates the communicator of one group member (registered buffer, flags, streams); "
        "local_only: every peer is in this process (cuMem buffers, no IPC, no peer access); "
        "abort_on_stall: abort the process when a timed-out wait cannot be released.");
  m.def("comm_attach_nccl", &ub::CommAttachNccl, arg("set_id"), arg("device"), arg("key"),
        "Transport nccl: moves NCCL communicator (key, device) (nccl_comm_create) into the "
        "member's communicator, which owns it from then on.");
  m.def("comm_connect_local", &ub::CommConnectLocal, arg("set_id"), arg("device"), arg("peer"),
        arg("peer_device"), nogil, "Wires a same-process peer (peer access, direct pointers).");
  m.def("comm_export_ipc", &ub::CommExportIpc, arg("set_id"), arg("device"),
        "CUDA IPC handles of this member's buffer and flags (opaque bytes).");
  m.def("comm_connect_ipc", &ub::CommConnectIpc, arg("set_id"), arg("device"), arg("peer"),
        arg("blob"),
        "Wires a peer of another process from its exported handles; returns why that "
        "peer's process cannot be watched for an exit ('' where it can).");
  m.def(
      "comm_grow",
      [](int set_id, int device, size_t capacity) {
        ub::Raise(ub::Get(set_id, device)->Grow(capacity));
      },
      arg("set_id"), arg("device"), arg("capacity"), nogil);
  m.def(
      "comm_capacity", [](int set_id, int device) { return ub::Get(set_id, device)->capacity(); },
      arg("set_id"), arg("device"));
  m.def("comm_inject_failure", &ub::CommInjectFailure, arg("set_id"), arg("device"), arg("what"),
        "Test hook: the next op on this member fails before it begins (1) or right after (2); the "
        "watchdog's reader sits as if blocked in a CUDA call (3); the reader never copies the "
        "poison word to the GPU (4); 0 clears.");
  m.def(
      "comm_error", [](int set_id, int device) { return ub::Get(set_id, device)->error(); },
      arg("set_id"), arg("device"), "Sticky error of a member ('' when healthy).");
  m.def(
      "comm_host_stats",
      [](int set_id, int device) {
        const auto h = ub::Get(set_id, device)->host_stats();
        return nb::make_tuple(h.ops, h.total_ns, h.meet_ns);
      },
      arg("set_id"), arg("device"),
      "(ops, host ns enqueueing them in total, of which ns waiting for same-process peers) since "
      "the member was created.");
  m.def(
      "comm_drain",
      [](int set_id) {
        for (ub::Communicator* c : ub::RegistrySet(set_id)) ub::Raise(c->Drain());
      },
      arg("set_id"), nogil, "Waits (bounded) until every local member's streams are idle.");
  m.def(
      "comm_destroy_set", [](int set_id) { ub::Raise(ub::RegistryDestroySet(set_id)); },
      arg("set_id"), nogil, "Frees every local member of a set (drain and barrier first).");
  m.def("registry_size", &ub::RegistrySize);
  m.def("gemm_warmup", &ub::GemmWarmupBinding, arg("device"), arg("m"), arg("n"), arg("k"),
        arg("dtype"), arg("tf32"), arg("workspace_bytes"), arg("tune_candidates") = 0,
        arg("accumulate") = false, arg("reserve_sms") = 0, arg("ld") = 0, arg("tune_reps") = 5,
        arg("unaligned_a") = false, arg("unaligned_c") = false, arg("trans_a") = false,
        arg("trans_b") = false,
        "Builds the plan and loads the kernel of one GEMM configuration (dtype: 0 f32, 1 f16, "
        "2 bf16; accumulate: with an addend, C = A @ B + C_in; ld > n: B and C are column blocks "
        "with that row stride; unaligned_a / unaligned_c: also the plans for A and/or C (and C_in) "
        "at pointers short of 16-byte alignment; trans_a / trans_b: A stored [k, m], B stored "
        "[n, k]); with tune_candidates > 1 times that many of cuBLASLt's candidate algorithms "
        "and keeps the fastest (each timed over tune_reps back-to-back runs). Returns {tuned, "
        "candidates, chosen, heuristic_ms, best_ms}.");
  m.def("p2p_matrix", &ub::P2PMatrix, nogil);
  m.def("pci_bus_ids", &ub::PciBusIds, nogil,
        "PCI bus id of every visible device ('' where CUDA cannot say).");
  m.def("trace_enable", &ub::TraceEnable, arg("on"),
        "Record CUDA-event timelines of the overlap ops (bench --timeline).");
  m.def("trace_collect", &ub::TraceCollectBinding,
        "Waits for the traced spans and returns them as dicts (times in ms from each op's start; "
        "op_start_ms: the op's start from the first traced op's on that device).");
  m.def("copy_check", &ub::CopyCheckBinding, arg("device"), arg("bytes"), arg("dst_offset"),
        arg("src_offset"), arg("max_blocks"), nogil,
        "Test hook: the bounded-block copy kernel at the given byte offsets (0..15) of a random "
        "source and a poisoned destination; returns (wrong bytes copied, bytes changed outside).");
  m.def("device_memory", &ub::DeviceMemoryBinding, arg("device"),
        "(free, total) bytes of a device.");
  m.def("driver_check", &ub::DriverProblem,
        "'' when the driver entry points jax_ub needs are present, else why not.");
  ub::BindNccl(m);
  ub::BindEnums(m);
}
