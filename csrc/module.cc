// The nanobind module _jax_ub_cuda: the registry of FFI handlers (one entry per custom-call target,
// registered for platform CUDA by jax_ub/_ext.py) and small host-side queries. No GPU work happens
// at import.
#include <cuda_runtime_api.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include <nanobind/stl/pair.h>

#include <cctype>
#include <memory>
#include <stdexcept>

#include "comm/communicator.h"
#include "comm/trace.h"
#include "comm/driver.h"
#include "comm/nccl.h"
#include "comm/process.h"
#include "common/dynlib.h"
#include "ffi/gemm.h"
#include "ffi/overlap.h"
#include "ffi/test_hooks.h"
#include "gemm/cublaslt.h"
#include "kernels/copy.h"
#include "kernels/fill.h"

namespace nb = nanobind;

void BindNccl(nanobind::module_& m);  // module_nccl.cc
// NCCL communicator (key, device) of module_nccl.cc's table (null if absent), and its removal
// from the table (only if the entry is still `which`).
std::shared_ptr<jax_ub::NcclComm> NcclFind(int key, int device);
void NcclForget(int key, int device, const jax_ub::NcclComm* which);

namespace jax_ub {
bool CublasLtApiChecked();
}

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
  d["cublaslt_api_checked"] = jax_ub::CublasLtApiChecked();
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
  nb::dict d;
  int driver = 0;
  cudaError_t err = cudaDriverGetVersion(&driver);
  d["driver_version"] = err == cudaSuccess ? driver : 0;
  int count = 0;
  err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    d["device_count"] = 0;
    d["error"] = std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
    cudaGetLastError();
    return d;
  }
  d["device_count"] = count;
  return d;
}

void Raise(const jax_ub::Status& s) {
  if (!s.ok()) throw std::runtime_error(s.message());
}

jax_ub::Communicator* Get(int set_id, int device) {
  // The Python bindings run under comm.py's lock, as do initialize and shutdown: the registry
  // keeps the object alive while they use it.
  jax_ub::Communicator* c = jax_ub::RegistryGet(set_id, device).get();
  if (c == nullptr) {
    throw std::runtime_error(jax_ub::StrCat() << "no communicator for device " << device
                                              << " in set " << set_id);
  }
  return c;
}

constexpr int kStallWatchdog = 3;  // comm_inject_failure: the reader stalls (Communicator::StallReader)
constexpr int kDropPoison = 4;     // comm_inject_failure: no poison copy (Communicator::DropPoison)

void CommCreate(int set_id, int group, int rank, int world, int device, size_t capacity,
                double timeout_s, bool local_only, bool nccl, bool abort_on_stall) {
  jax_ub::Communicator::Options o;
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
  std::unique_ptr<jax_ub::Communicator> c;
  Raise(jax_ub::Communicator::Create(o, &c));
  Raise(jax_ub::RegistryAdd(std::move(c)));
}

void CommConnectLocal(int set_id, int device, int peer, int peer_device) {
  Raise(Get(set_id, device)->ConnectLocal(peer, *Get(set_id, peer_device)));
}

nb::bytes CommExportIpc(int set_id, int device) {
  std::string blob = Get(set_id, device)->ExportIpc();
  if (blob.empty()) {
    throw std::runtime_error(jax_ub::StrCat()
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

// PCI bus id ("0000:18:00.0", lower case) of every visible device; "" where CUDA cannot say. Lets
// processes that see different devices (CUDA_VISIBLE_DEVICES) name the same GPU alike.
std::vector<std::string> PciBusIds() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return {};
  }
  std::vector<std::string> out(n);
  for (int i = 0; i < n; ++i) {
    char buf[32] = {0};
    if (cudaDeviceGetPCIBusId(buf, sizeof(buf), i) != cudaSuccess) {
      cudaGetLastError();
      continue;
    }
    std::string id(buf);
    for (char& c : id) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    out[i] = id;
  }
  return out;
}

// (can_access[i][j]) for every pair of visible devices.
std::vector<std::vector<int>> P2PMatrix() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return {};
  }
  std::vector<std::vector<int>> m(n, std::vector<int>(n, 1));
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      if (i != j && cudaDeviceCanAccessPeer(&m[i][j], i, j) != cudaSuccess) m[i][j] = 0;
    }
  }
  cudaGetLastError();
  return m;
}

// Runs one GEMM of this configuration on scratch memory and waits: loads the cuBLASLt kernel and
// builds the plan at trace time, so no lazy module load (which may synchronize the context) happens
// inside an overlapped op while peers wait on this device.
nb::dict GemmWarmup(int device, int64_t m, int64_t n, int64_t k, int dtype, bool tf32,
                    size_t workspace_bytes, int tune_candidates, bool accumulate,
                    int reserve_sms, int64_t ld, int tune_reps, bool unaligned_a,
                    bool unaligned_c, bool trans_a, bool trans_b) {
  jax_ub::GemmTuneResult tune;
  jax_ub::Status status;
  {
  nb::gil_scoped_release nogil;
  status = [&]() -> jax_ub::Status {
    JAX_UB_CUDA_RETURN(cudaSetDevice(device));
    const auto t = static_cast<jax_ub::DType>(dtype);
    const size_t es = jax_ub::DTypeSize(t);
    // A private non-blocking stream: never ordered behind XLA's or the communicators' streams.
    cudaStream_t s = nullptr;
    JAX_UB_CUDA_RETURN(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    // Stream-ordered scratch (cudaMallocAsync / cudaFreeAsync on that stream): cudaFree may
    // synchronize the whole device, and this runs at trace time while earlier jax_ub ops can
    // still be in flight, spinning on flags of peers whose launches must not be held up.
    int pools = 0;
    cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, device);
    std::vector<void*> scratch;
    auto alloc = [&](void** p, size_t bytes) -> cudaError_t {
      cudaError_t err = pools ? cudaMallocAsync(p, bytes, s) : cudaMalloc(p, bytes);
      if (err == cudaSuccess) scratch.push_back(*p);
      return err;
    };
    jax_ub::Status st = [&]() -> jax_ub::Status {
      void *a = nullptr, *b = nullptr, *c = nullptr, *c_in = nullptr, *ws = nullptr;
      // ld > n: w, y and the addend are column blocks of wider matrices (the chain GEMM->RS's
      // column pieces): the plan key holds the row stride.
      const int64_t row = ld > n ? ld : n;
      // 16 bytes more than the operands: room to offset a pointer by one element (unaligned_*).
      JAX_UB_CUDA_RETURN(alloc(&a, m * k * es + 16));
      JAX_UB_CUDA_RETURN(alloc(&b, k * row * es));
      JAX_UB_CUDA_RETURN(alloc(&c, m * row * es + 16));
      if (accumulate) JAX_UB_CUDA_RETURN(alloc(&c_in, m * row * es + 16));
      if (workspace_bytes) JAX_UB_CUDA_RETURN(alloc(&ws, workspace_bytes));
      jax_ub::GemmArgs g = jax_ub::RowMajorGemm(m, n, k, t, tf32, a, b, c, ws, workspace_bytes);
      g.ldb = g.ldc = row;
      // jax_ub.matmul's backward GEMMs (dy @ w^T, x^T @ dy): A stored [k, m], B stored [n, k].
      g.trans_a = trans_a;
      g.trans_b = trans_b;
      if (trans_a) g.lda = m;
      if (trans_b) g.ldb = k;
      // With an addend (the GEMM->RS chain), cuBLASLt may launch another kernel than for
      // beta = 0: that one must be loaded here too, not lazily inside an op whose peers wait.
      g.accumulate = accumulate;
      g.c_in = c_in;
      // The bulk reduce-scatter's GEMM leaves `reserve_sms` SMs to the sum: same plan key as then.
      if (reserve_sms > 0) {
        int sms = 0;
        JAX_UB_CUDA_RETURN(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
        g.sm_count = sms > reserve_sms ? sms - reserve_sms : 0;
      }
      // Random values in [-1, 1): a GEMM's speed depends on its data (zeros or a constant
      // pattern run at higher clocks than real activations and rank the candidates otherwise:
      // scripts/chunk_algo_probe.cu, NOTES.md).
      const int64_t pad = static_cast<int64_t>(16 / es);  // the extra elements
      JAX_UB_RETURN_IF_ERROR(jax_ub::LaunchFillUniform(t, a, m * k + pad, 1u, s));
      JAX_UB_RETURN_IF_ERROR(jax_ub::LaunchFillUniform(t, b, k * row, 2u, s));
      if (c_in) JAX_UB_RETURN_IF_ERROR(jax_ub::LaunchFillUniform(t, c_in, m * row + pad, 3u, s));
      // Row offsets into operands whose rows are not a multiple of 16 bytes (the op's chunks,
      // pieces and runs) give pointers of the element-size alignment class (cublaslt.cc): every
      // class pair the op can meet gets its plan and kernel here. The result reported is the
      // aligned pair's (the first).
      for (int ua = 0; ua <= (unaligned_a ? 1 : 0); ++ua) {
        for (int uc = 0; uc <= (unaligned_c ? 1 : 0); ++uc) {
          jax_ub::GemmArgs v = g;
          v.a = static_cast<char*>(a) + (ua ? es : 0);
          v.c = static_cast<char*>(c) + (uc ? es : 0);
          if (c_in) v.c_in = static_cast<char*>(c_in) + (uc ? es : 0);
          JAX_UB_RETURN_IF_ERROR(jax_ub::Gemm(device, v, s));
          if (tune_candidates > 1) {
            jax_ub::GemmTuneResult r;
            JAX_UB_RETURN_IF_ERROR(jax_ub::GemmTune(device, v, tune_candidates,
                                                    tune_reps > 0 ? tune_reps : 5, s, &r));
            if (ua == 0 && uc == 0) tune = r;
          }
        }
      }
      return jax_ub::Status::Ok();
    }();
    for (void* p : scratch) {
      if (pools) {
        cudaFreeAsync(p, s);
      } else {
        cudaFree(p);
      }
    }
    const cudaError_t synced = cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
    if (st.ok() && synced != cudaSuccess) {
      return jax_ub::Status::Error(jax_ub::StrCat() << "gemm_warmup on device " << device << ": "
                                                    << cudaGetErrorString(synced));
    }
    return st;
  }();
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

// Test hook for the bounded-block copy kernel (kernels/copy.h): copies `bytes` random bytes from
// offset src_offset of one buffer to offset dst_offset of a poisoned one (offsets 0..15 reach every
// misalignment) and returns (wrong bytes in the copied range, bytes changed outside it).
std::pair<size_t, size_t> CopyCheck(int device, size_t bytes, int dst_offset, int src_offset,
                                    int max_blocks) {
  if (dst_offset < 0 || dst_offset > 15 || src_offset < 0 || src_offset > 15) {
    throw std::invalid_argument(jax_ub::StrCat() << "copy_check: offsets must be in [0, 15]; got "
                                                 << dst_offset << ", " << src_offset);
  }
  constexpr size_t kGuard = 64;  // poisoned bytes before and after the destination range
  const size_t src_len = bytes + 16, dst_len = bytes + 2 * kGuard;
  std::vector<unsigned char> src_h(src_len), dst_h(dst_len);
  jax_ub::Status st = [&]() -> jax_ub::Status {
    JAX_UB_CUDA_RETURN(cudaSetDevice(device));
    JAX_UB_RETURN_IF_ERROR(jax_ub::PreloadCopyKernels());  // as a communicator's creation does
    void *src = nullptr, *dst = nullptr;
    JAX_UB_CUDA_RETURN(cudaMalloc(&src, src_len + 16));
    JAX_UB_CUDA_RETURN(cudaMalloc(&dst, dst_len));
    jax_ub::Status run = [&]() -> jax_ub::Status {
      JAX_UB_RETURN_IF_ERROR(
          jax_ub::LaunchFillUniform(jax_ub::DType::kF32, src, (src_len + 15) / 4, 11u, nullptr));
      JAX_UB_CUDA_RETURN(cudaMemset(dst, 0xA5, dst_len));
      JAX_UB_RETURN_IF_ERROR(jax_ub::LaunchCopy(static_cast<char*>(dst) + kGuard + dst_offset,
                                                static_cast<char*>(src) + src_offset, bytes,
                                                max_blocks, nullptr));
      JAX_UB_CUDA_RETURN(cudaDeviceSynchronize());
      JAX_UB_CUDA_RETURN(cudaMemcpy(src_h.data(), src, src_len, cudaMemcpyDeviceToHost));
      JAX_UB_CUDA_RETURN(cudaMemcpy(dst_h.data(), dst, dst_len, cudaMemcpyDeviceToHost));
      return jax_ub::Status::Ok();
    }();
    cudaFree(src);
    cudaFree(dst);
    return run;
  }();
  Raise(st);
  size_t wrong = 0, outside = 0;
  const size_t begin = kGuard + dst_offset;
  for (size_t i = 0; i < dst_len; ++i) {
    if (i >= begin && i < begin + bytes) {
      wrong += dst_h[i] != src_h[src_offset + (i - begin)];
    } else {
      outside += dst_h[i] != 0xA5;
    }
  }
  return {wrong, outside};
}

std::pair<size_t, size_t> DeviceMemory(int device) {
  size_t free_b = 0, total_b = 0;
  if (cudaSetDevice(device) != cudaSuccess || cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error(jax_ub::StrCat() << "cudaMemGetInfo failed on device " << device);
  }
  return {free_b, total_b};
}

}  // namespace

NB_MODULE(_jax_ub_cuda, m) {
  m.doc() = "jax_ub CUDA extension: XLA FFI handlers for overlapped TP GEMM/communication.";
  m.def("registrations", &Registrations, "FFI target name -> {stage: PyCapsule}");
  m.def("build_info", &BuildInfo, "How this extension was compiled.");
  m.def("this_process", [] {
          const jax_ub::ProcessId p = jax_ub::ThisProcess();
          return std::vector<uint64_t>{static_cast<uint64_t>(p.pid), p.start_ticks, p.pidns_dev,
                                       p.pidns_ino};
        },
        "[pid, start ticks, pid namespace dev, inode]: how this process describes itself to its "
        "ipc peers (the watchdog's liveness check).");
  m.def("process_gone", [](std::vector<uint64_t> p) {
          if (p.size() != 4) throw std::invalid_argument("process_gone: need 4 numbers");
          jax_ub::ProcessId id;
          id.pid = static_cast<int32_t>(p[0]);
          id.start_ticks = p[1];
          id.pidns_dev = p[2];
          id.pidns_ino = p[3];
          return nb::make_tuple(jax_ub::Checkable(id), jax_ub::ProcessGone(id),
                                jax_ub::WhyNotCheckable(id));
        }, nb::arg("process"),
        "(checkable, what became of it ('' while it runs), why it is not checkable ('' where it "
        "is)) for a this_process() of another process of this host.");
  m.def("runtime_info", &RuntimeInfo, "CUDA driver version and device count (no exceptions).");
  m.def("set_library_candidates", &jax_ub::SetLibraryCandidates, nb::arg("lib"), nb::arg("paths"),
        "Paths to try, in order, when dlopen()ing `lib` ('cublasLt' or 'nccl').");
  m.def("cublaslt_description", &jax_ub::CublasLtDescription,
        "Loads cuBLASLt if needed and says which library is used, or why it cannot be loaded.");
  m.def("gemm_plan_cache_size", &jax_ub::GemmPlanCacheSize);
  using nb::arg;
  auto nogil = nb::call_guard<nb::gil_scoped_release>();
  m.def("comm_create", &CommCreate, arg("set_id"), arg("group"), arg("rank"), arg("world"),
        arg("device"), arg("capacity"), arg("timeout_s"), arg("local_only") = false,
        arg("nccl") = false, arg("abort_on_stall") = true, nogil,
        "Creates the communicator of one group member (registered buffer, flags, streams); "
        "local_only: every peer is in this process (cuMem buffers, no IPC, no peer access); "
        "abort_on_stall: abort the process when a timed-out wait cannot be released.");
  m.def("comm_attach_nccl", [](int set_id, int device, int key) {
          std::shared_ptr<jax_ub::NcclComm> n = NcclFind(key, device);
          if (n == nullptr) {
            throw std::runtime_error(jax_ub::StrCat() << "comm_attach_nccl: no NCCL communicator "
                                                      << key << " on device " << device);
          }
          // Out of the table only once attached: a failed attach leaves it there, where
          // nccl_comm_destroy still finds and frees it (dropping it would leak the NCCL
          // communicator, whose destructor makes no NCCL call).
          Raise(Get(set_id, device)->AttachNccl(n));
          NcclForget(key, device, n.get());
        }, arg("set_id"), arg("device"), arg("key"),
        "Transport nccl: moves NCCL communicator (key, device) (nccl_comm_create) into the "
        "member's communicator, which owns it from then on.");
  m.def("comm_connect_local", &CommConnectLocal, arg("set_id"), arg("device"), arg("peer"),
        arg("peer_device"), nogil, "Wires a same-process peer (peer access, direct pointers).");
  m.def("comm_export_ipc", &CommExportIpc, arg("set_id"), arg("device"),
        "CUDA IPC handles of this member's buffer and flags (opaque bytes).");
  m.def("comm_connect_ipc", &CommConnectIpc, arg("set_id"), arg("device"), arg("peer"),
        arg("blob"), "Wires a peer of another process from its exported handles; returns why that "
        "peer's process cannot be watched for an exit ('' where it can).");
  m.def("comm_grow", [](int set_id, int device, size_t capacity) {
    Raise(Get(set_id, device)->Grow(capacity));
  }, arg("set_id"), arg("device"), arg("capacity"), nogil);
  m.def("comm_capacity", [](int set_id, int device) { return Get(set_id, device)->capacity(); },
        arg("set_id"), arg("device"));
  m.def("comm_inject_failure", [](int set_id, int device, int what) {
    if (what < jax_ub::Communicator::kFailNone || what > kDropPoison) {
      throw std::invalid_argument(jax_ub::StrCat()
                                  << "comm_inject_failure: what must be 0 to 4; got " << what);
    }
    jax_ub::Communicator* c = Get(set_id, device);
    if (what == kStallWatchdog || what == kDropPoison) {
      if (what == kStallWatchdog) {
        c->StallReader(true);
      } else {
        c->DropPoison(true);
      }
      return;
    }
    if (what == jax_ub::Communicator::kFailNone) {
      c->StallReader(false);
      c->DropPoison(false);
    }
    c->Inject(static_cast<jax_ub::Communicator::Injected>(what));
  }, arg("set_id"), arg("device"), arg("what"),
  "Test hook: the next op on this member fails before it begins (1) or right after (2); the "
  "watchdog's reader sits as if blocked in a CUDA call (3); the reader never copies the poison "
  "word to the GPU (4); 0 clears.");
  m.def("comm_error", [](int set_id, int device) { return Get(set_id, device)->error(); },
        arg("set_id"), arg("device"), "Sticky error of a member ('' when healthy).");
  m.def("comm_host_stats", [](int set_id, int device) {
    const auto h = Get(set_id, device)->host_stats();
    return nb::make_tuple(h.ops, h.total_ns, h.meet_ns);
  }, arg("set_id"), arg("device"),
  "(ops, host ns enqueueing them in total, of which ns waiting for same-process peers) since "
  "the member was created.");
  m.def("comm_drain", [](int set_id) {
    for (jax_ub::Communicator* c : jax_ub::RegistrySet(set_id)) Raise(c->Drain());
  }, arg("set_id"), nogil, "Waits (bounded) until every local member's streams are idle.");
  m.def("comm_destroy_set", [](int set_id) { Raise(jax_ub::RegistryDestroySet(set_id)); },
        arg("set_id"), nogil, "Frees every local member of a set (drain and barrier first).");
  m.def("registry_size", &jax_ub::RegistrySize);
  m.def("gemm_warmup", &GemmWarmup, arg("device"), arg("m"), arg("n"), arg("k"), arg("dtype"),
        arg("tf32"), arg("workspace_bytes"), arg("tune_candidates") = 0, arg("accumulate") = false, arg("reserve_sms") = 0,
        arg("ld") = 0, arg("tune_reps") = 5, arg("unaligned_a") = false,
        arg("unaligned_c") = false, arg("trans_a") = false, arg("trans_b") = false,
        "Builds the plan and loads the kernel of one GEMM configuration (dtype: 0 f32, 1 f16, "
        "2 bf16; accumulate: with an addend, C = A @ B + C_in; ld > n: B and C are column blocks "
        "with that row stride; unaligned_a / unaligned_c: also the plans for A and/or C (and C_in) "
        "at pointers short of 16-byte alignment; trans_a / trans_b: A stored [k, m], B stored [n, k]); with tune_candidates > 1 times that many of cuBLASLt's candidate algorithms "
        "and keeps the fastest (each timed over tune_reps back-to-back runs). Returns {tuned, candidates, chosen, heuristic_ms, best_ms}.");
  m.def("p2p_matrix", &P2PMatrix, nogil);
  m.def("pci_bus_ids", &PciBusIds, nogil,
        "PCI bus id of every visible device ('' where CUDA cannot say).");
  m.def("trace_enable", &jax_ub::TraceEnable, arg("on"),
        "Record CUDA-event timelines of the overlap ops (bench --timeline).");
  m.def("trace_collect", [] {
    nb::list out;
    for (const jax_ub::TraceRecord& r : jax_ub::TraceCollect()) {
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
  }, "Waits for the traced spans and returns them as dicts (times in ms from each op's start; op_start_ms: the op's start from the first traced op's on that device).");
  m.def("copy_check", &CopyCheck, arg("device"), arg("bytes"), arg("dst_offset"),
        arg("src_offset"), arg("max_blocks"), nogil,
        "Test hook: the bounded-block copy kernel at the given byte offsets (0..15) of a random "
        "source and a poisoned destination; returns (wrong bytes copied, bytes changed outside).");
  m.def("device_memory", &DeviceMemory, arg("device"), "(free, total) bytes of a device.");
  m.def("driver_check", [] {
    const jax_ub::Driver* d = nullptr;
    jax_ub::Status s = jax_ub::GetDriver(&d);
    return s.ok() ? std::string() : s.message();
  }, "'' when the driver entry points jax_ub needs are present, else why not.");
  BindNccl(m);
}
