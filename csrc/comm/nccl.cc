#include "comm/nccl.h"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "common/dynlib.h"

namespace jax_ub {
namespace {

using nccl::Result;

// The loaded library and its entry points.
struct Api {
  DynLib lib;
  nccl::GetVersionFn* GetVersion = nullptr;
  nccl::GetUniqueIdFn* GetUniqueId = nullptr;
  nccl::CommInitRankConfigFn* CommInitRankConfig = nullptr;
  nccl::CommDestroyFn* CommDestroy = nullptr;
  nccl::CommAbortFn* CommAbort = nullptr;
  nccl::CommGetAsyncErrorFn* CommGetAsyncError = nullptr;
  nccl::GetErrorStringFn* GetErrorString = nullptr;
  nccl::GetLastErrorFn* GetLastError = nullptr;
  nccl::GroupStartFn* GroupStart = nullptr;
  nccl::GroupEndFn* GroupEnd = nullptr;
  nccl::SendFn* Send = nullptr;
  nccl::RecvFn* Recv = nullptr;
  nccl::AllGatherFn* AllGather = nullptr;
  nccl::CommCountFn* CommCount = nullptr;
  nccl::CommUserRankFn* CommUserRank = nullptr;
  int version = -1;

  template <typename Fn>
  Status Sym(const char* name, Fn** fn) {
    Status s = lib.Sym(name, fn);
    if (!s.ok()) {
      return Status::Error(StrCat() << "jax_ub NCCL: " << s.message()
                                    << " (jax_ub needs NCCL >= 2.14; install a newer "
                                       "nvidia-nccl-cu12/-cu13 wheel)");
    }
    return s;
  }

  Status Load() {
    std::vector<std::string> candidates = LibraryCandidates("nccl");
    candidates.push_back("libnccl.so.2");
    JAX_UB_RETURN_IF_ERROR(lib.Open("NCCL (libnccl.so.2)", candidates));
    JAX_UB_RETURN_IF_ERROR(Sym("ncclGetVersion", &GetVersion));
    JAX_UB_RETURN_IF_ERROR(Sym("ncclGetUniqueId", &GetUniqueId));
    JAX_UB_RETURN_IF_ERROR(Sym("ncclCommInitRankConfig", &CommInitRankConfig));
    JAX_UB_RETURN_IF_ERROR(Sym("ncclCommDestroy", &CommDestroy));
    JAX_UB_RETURN_IF_ERROR(Sym("ncclCommAbort", &CommAbort));
    JAX_UB_RETURN_IF_ERROR(Sym("ncclCommGetAsyncError", &CommGetAsyncError));
    JAX_UB_RETURN_IF_ERROR(Sym("ncclGetErrorString", &GetErrorString));
    JAX_UB_RETURN_IF_ERROR(Sym("ncclGetLastError", &GetLastError));
    JAX_UB_RETURN_IF_ERROR(Sym("ncclGroupStart", &GroupStart));
    JAX_UB_RETURN_IF_ERROR(Sym("ncclGroupEnd", &GroupEnd));
    JAX_UB_RETURN_IF_ERROR(Sym("ncclSend", &Send));
    JAX_UB_RETURN_IF_ERROR(Sym("ncclRecv", &Recv));
    JAX_UB_RETURN_IF_ERROR(Sym("ncclAllGather", &AllGather));
    JAX_UB_RETURN_IF_ERROR(Sym("ncclCommCount", &CommCount));
    JAX_UB_RETURN_IF_ERROR(Sym("ncclCommUserRank", &CommUserRank));
    int v = 0;
    Result r = GetVersion(&v);
    if (r != nccl::kSuccess) {
      return Status::Error(StrCat()
                           << "jax_ub NCCL: ncclGetVersion failed in " << lib.path() << ": "
                           << GetErrorString(r) << " (" << static_cast<int>(r) << ")");
    }
    version = v;
    return Status::Ok();
  }
};

// The loaded API: set once, on the first successful load, and never freed (communicators and
// their detached init threads may outlive static destruction). A failed load is retried by the
// next call, since jax_ub/_ext.py may hand over the wheel's path only after an early query.
std::mutex g_load_mu;
std::atomic<Api*> g_api{nullptr};

// Loads NCCL if needed and returns the API, or null with *st saying why it cannot be loaded.
Api* LoadedApi(Status* st) {
  if (Api* api = g_api.load(std::memory_order_acquire)) {
    *st = Status::Ok();
    return api;
  }
  std::lock_guard<std::mutex> lock(g_load_mu);
  if (Api* api = g_api.load(std::memory_order_acquire)) {
    *st = Status::Ok();
    return api;
  }
  auto api = std::make_unique<Api>();
  *st = api->Load();
  if (!st->ok()) return nullptr;
  g_api.store(api.get(), std::memory_order_release);
  return api.release();
}

// The API of a library already loaded (every NcclComm exists only after a successful load).
Api* GetApi() { return g_api.load(std::memory_order_acquire); }

const char* ResultName(Result r) {
  switch (r) {
    case nccl::kSuccess: return "ncclSuccess";
    case nccl::kUnhandledCudaError: return "ncclUnhandledCudaError";
    case nccl::kSystemError: return "ncclSystemError";
    case nccl::kInternalError: return "ncclInternalError";
    case nccl::kInvalidArgument: return "ncclInvalidArgument";
    case nccl::kInvalidUsage: return "ncclInvalidUsage";
    case nccl::kRemoteError: return "ncclRemoteError";
    case nccl::kInProgress: return "ncclInProgress";
    case nccl::kTimeout: return "ncclTimeout";
  }
  return "ncclResult?";
}

// "ncclSystemError (2): <ncclGetErrorString>; NCCL last error: '<ncclGetLastError>'".
std::string Describe(const Api* api, Result r, const std::string& last_error) {
  const char* text = api->GetErrorString ? api->GetErrorString(r) : nullptr;
  return StrCat() << ResultName(r) << " (" << static_cast<int>(r)
                  << "): " << (text ? text : "(no description)") << "; NCCL last error: '"
                  << (last_error.empty() ? std::string("(none)") : last_error)
                  << "' (NCCL_DEBUG=INFO prints NCCL's own log)";
}

std::string LastError(const Api* api, nccl::Comm comm) {
  const char* s = api->GetLastError ? api->GetLastError(comm) : nullptr;
  return s ? std::string(s) : std::string();
}

std::string Who(int rank, int world, int device) {
  return StrCat() << "rank " << rank << " of world " << world << " (CUDA device " << device << ")";
}

// Makes `device` current for its scope and restores the previous device.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&prev_) != cudaSuccess) {
      cudaGetLastError();
      prev_ = -1;
    }
    err_ = prev_ == device ? cudaSuccess : cudaSetDevice(device);
  }
  ~DeviceScope() {
    if (prev_ >= 0 && err_ == cudaSuccess) cudaSetDevice(prev_);
  }
  cudaError_t error() const { return err_; }

 private:
  int prev_ = -1;
  cudaError_t err_ = cudaSuccess;
};

// Sleeps between polls of ncclCommGetAsyncError: 20 us, doubling up to 1 ms.
class Backoff {
 public:
  void Wait() {
    std::this_thread::sleep_for(pause_);
    if (pause_ < std::chrono::milliseconds(1)) pause_ *= 2;
  }

 private:
  std::chrono::microseconds pause_{20};
};

}  // namespace

Status NcclLoad() {
  Status st;
  LoadedApi(&st);
  return st;
}

int NcclVersion() {
  Status st;
  Api* api = LoadedApi(&st);
  return api ? api->version : -1;
}

std::string NcclLibraryPath() {
  Status st;
  Api* api = LoadedApi(&st);
  return api ? api->lib.path() : std::string();
}

Status NcclUniqueId(std::string* out) {
  Status st;
  Api* api = LoadedApi(&st);
  if (api == nullptr) return st;
  nccl::UniqueId id{};
  Result r = api->GetUniqueId(&id);
  if (r != nccl::kSuccess) {
    return Status::Error(StrCat() << "jax_ub NCCL: ncclGetUniqueId failed: "
                                  << Describe(api, r, LastError(api, nullptr))
                                  << ". It opens NCCL's bootstrap socket in this process: check "
                                     "that a network interface is usable (NCCL_SOCKET_IFNAME)");
  }
  out->assign(id.internal, sizeof(id.internal));
  return Status::Ok();
}

Status NcclComm::Create(const std::string& unique_id, int rank, int world, int device,
                        double timeout_s, std::unique_ptr<NcclComm>* out) {
  const std::string who = Who(rank, world, device);
  if (world < 1 || rank < 0 || rank >= world) {
    return Status::Error(StrCat() << "jax_ub NCCL: invalid communicator member " << who
                                  << ": need 0 <= rank < world");
  }
  if (device < 0) {
    return Status::Error(StrCat() << "jax_ub NCCL: invalid CUDA device for " << who);
  }
  if (!(timeout_s > 0)) {
    return Status::Error(StrCat() << "jax_ub NCCL: timeout_s must be > 0 for " << who << "; got "
                                  << timeout_s);
  }
  if (unique_id.size() != nccl::kUniqueIdBytes) {
    return Status::Error(StrCat() << "jax_ub NCCL: the unique id given to " << who << " has "
                                  << unique_id.size() << " bytes; an ncclUniqueId has "
                                  << nccl::kUniqueIdBytes
                                  << " (it must come from ncclGetUniqueId on rank 0)");
  }
  Status load;
  Api* api = LoadedApi(&load);
  if (api == nullptr) return load;

  nccl::UniqueId id{};
  std::memcpy(id.internal, unique_id.data(), nccl::kUniqueIdBytes);
  DeviceScope scope(device);  // the communicator binds to the current device
  if (scope.error() != cudaSuccess) {
    cudaError_t e = scope.error();
    cudaGetLastError();
    return Status::Error(StrCat() << "jax_ub NCCL: cannot create the communicator of " << who
                                  << ": cudaSetDevice(" << device << ") failed: "
                                  << cudaGetErrorName(e) << " (" << cudaGetErrorString(e) << ")");
  }
  nccl::ConfigPrefix config{};
  config.size = sizeof(config);
  config.magic = nccl::kConfigMagic;
  config.version = nccl::kConfigVersion;
  config.blocking = 0;
  nccl::Comm comm = nullptr;
  Result r = api->CommInitRankConfig(&comm, world, id, rank, &config);
  auto failed = [&](Result why) {
    std::string msg = StrCat() << "jax_ub NCCL: ncclCommInitRankConfig failed on " << who << ": "
                               << Describe(api, why, LastError(api, comm));
    if (comm != nullptr) api->CommAbort(comm);
    return Status::Error(msg);
  };
  if (r != nccl::kSuccess && r != nccl::kInProgress) return failed(r);
  // Nonblocking: NCCL joins the ranks on its own thread; poll it here, bounded.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  Backoff backoff;
  for (;;) {
    Result state = nccl::kSuccess;
    Result q = api->CommGetAsyncError(comm, &state);
    if (q != nccl::kSuccess) return failed(q);
    if (state == nccl::kSuccess) break;
    if (state != nccl::kInProgress) return failed(state);
    if (std::chrono::steady_clock::now() > deadline) {
      api->CommAbort(comm);
      return Status::Error(
          StrCat() << "jax_ub NCCL: communicator creation timed out after " << timeout_s << " s on "
                   << who << ": it waits until all " << world
                   << " ranks of the communicator have joined, and some never did. Every rank of "
                      "the group must call jax_ub.initialize() (same configuration, same unique "
                      "id), and the processes must reach rank 0's process over the network "
                      "(NCCL_SOCKET_IFNAME, firewalls). The half-made communicator was aborted. "
                      "(timeout: JAX_UB_TIMEOUT)");
    }
    backoff.Wait();
  }
  out->reset(new NcclComm(comm, rank, world, device, timeout_s));
  return Status::Ok();
}

Status NcclComm::Fail(const char* call, Result r, const std::string& hint) const {
  Api* api = GetApi();
  return Status::Error(StrCat() << "jax_ub NCCL: " << call << " failed on "
                                << Who(rank_, world_, device_) << ": "
                                << Describe(api, r, LastError(api, comm_.load())) << hint);
}

Status NcclComm::Usable(const char* call) const {
  if (comm_.load() != nullptr) return Status::Ok();
  const std::string dead = dead_reason();
  return Status::Error(StrCat() << "jax_ub NCCL: " << call << " on " << Who(rank_, world_, device_)
                                << ": the communicator is no longer usable: "
                                << (dead.empty() ? std::string("destroyed") : dead));
}

void NcclComm::AbortAfter(const std::string& why) {
  std::lock_guard<std::mutex> call(call_mu_);
  AbortLocked(why);
}

void NcclComm::AbortLocked(const std::string& why) {
  std::lock_guard<std::mutex> lock(dead_mu_);
  nccl::Comm comm = comm_.exchange(nullptr);
  if (comm == nullptr) return;
  dead_ = "aborted after: " + why;
  if (before_abort_) before_abort_();
  GetApi()->CommAbort(comm);
}

void NcclComm::SetBeforeAbort(std::function<void()> hook) {
  std::lock_guard<std::mutex> call(call_mu_);
  before_abort_ = std::move(hook);
}

void NcclComm::Leak(const std::string& why) {
  std::lock_guard<std::mutex> call(call_mu_);
  std::lock_guard<std::mutex> lock(dead_mu_);
  if (comm_.exchange(nullptr) != nullptr) dead_ = "left allocated after: " + why;
}

Status NcclComm::Settle(const char* call, const std::string& what) {
  Api* api = GetApi();
  // A little over the watchdog's timeout: a GPU-side wait is the watchdog's to report (it names
  // the op); this bound is for NCCL's host side (connecting to a peer that never comes).
  const double limit = timeout_s_ + 2;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(limit);
  Backoff backoff;
  for (int polls = 0;; ++polls) {
    {
      std::lock_guard<std::mutex> lock(call_mu_);
      nccl::Comm comm = comm_.load();
      if (comm == nullptr) return Usable(call);  // aborted meanwhile: says after what
      Result state = nccl::kSuccess;
      Result q = api->CommGetAsyncError(comm, &state);
      if (q == nccl::kSuccess && state == nccl::kSuccess) return Status::Ok();
      std::string msg;
      if (q != nccl::kSuccess) {
        msg = Fail("ncclCommGetAsyncError", q, " (after " + std::string(call) + ")").message();
      } else if (state != nccl::kInProgress) {
        msg = Fail(call, state, what).message();
      } else if (std::chrono::steady_clock::now() > deadline) {
        msg = StrCat() << "jax_ub NCCL: " << call << what << " was still in progress after "
                       << limit << " s on " << Who(rank_, world_, device_)
                       << " (NCCL connects to a peer on first use, and some peer never answered). "
                          "Is every process alive, and does every rank run the same sequence of "
                          "jax_ub ops? (timeout: JAX_UB_TIMEOUT)";
      }
      if (!msg.empty()) {
        AbortLocked(msg);
        return Status::Error(msg + "; the communicator was aborted");
      }
    }
    if (polls < 64) {
      std::this_thread::yield();  // enqueueing usually settles within microseconds
    } else {
      backoff.Wait();
    }
  }
}

Status NcclComm::AllGatherBytes(const void* send, void* recv, size_t bytes, cudaStream_t stream) {
  {
    std::lock_guard<std::mutex> lock(call_mu_);
    JAX_UB_RETURN_IF_ERROR(Usable("ncclAllGather"));
    Result r = GetApi()->AllGather(send, recv, bytes, nccl::kUint8, comm_.load(), stream);
    if (r != nccl::kSuccess && r != nccl::kInProgress) return Fail("ncclAllGather", r);
  }
  return Settle("ncclAllGather", StrCat() << " (" << bytes << " bytes per rank)");
}

// Send and Recv run inside a group (GroupStart holds call_mu_).
Status NcclComm::Send(const void* buf, size_t bytes, int peer, cudaStream_t stream) {
  if (!group_.owns_lock()) {
    return Status::Error(StrCat() << "jax_ub NCCL: ncclSend on " << Who(rank_, world_, device_)
                                  << " outside a group (internal error: call GroupStart first)");
  }
  JAX_UB_RETURN_IF_ERROR(Usable("ncclSend"));
  Result r = GetApi()->Send(buf, bytes, nccl::kUint8, peer, comm_.load(), stream);
  return r == nccl::kSuccess ? Status::Ok()
                             : Fail("ncclSend", r, StrCat() << " (to peer " << peer << ")");
}

Status NcclComm::Recv(void* buf, size_t bytes, int peer, cudaStream_t stream) {
  if (!group_.owns_lock()) {
    return Status::Error(StrCat() << "jax_ub NCCL: ncclRecv on " << Who(rank_, world_, device_)
                                  << " outside a group (internal error: call GroupStart first)");
  }
  JAX_UB_RETURN_IF_ERROR(Usable("ncclRecv"));
  Result r = GetApi()->Recv(buf, bytes, nccl::kUint8, peer, comm_.load(), stream);
  return r == nccl::kSuccess ? Status::Ok()
                             : Fail("ncclRecv", r, StrCat() << " (from peer " << peer << ")");
}

Status NcclComm::GroupStart() {
  std::unique_lock<std::mutex> lock(call_mu_);
  JAX_UB_RETURN_IF_ERROR(Usable("ncclGroupStart"));
  Result r = GetApi()->GroupStart();
  if (r != nccl::kSuccess) return Fail("ncclGroupStart", r);
  group_ = std::move(lock);
  return Status::Ok();
}

Status NcclComm::GroupEnd() {
  if (!group_.owns_lock()) {
    return Status::Error(StrCat() << "jax_ub NCCL: ncclGroupEnd on " << Who(rank_, world_, device_)
                                  << " without a successful ncclGroupStart");
  }
  // Always: NCCL's group depth is per thread, and a group left open would swallow the next one.
  Result r = GetApi()->GroupEnd();
  Status st =
      r == nccl::kSuccess || r == nccl::kInProgress ? Status::Ok() : Fail("ncclGroupEnd", r);
  group_.unlock();
  group_.release();
  if (!st.ok()) return st;
  return Settle("ncclGroupEnd", " (ncclSend/ncclRecv)");
}

Status NcclComm::CheckAsync() {
  std::lock_guard<std::mutex> lock(call_mu_);
  JAX_UB_RETURN_IF_ERROR(Usable("ncclCommGetAsyncError"));
  Result async = nccl::kSuccess;
  Result r = GetApi()->CommGetAsyncError(comm_.load(), &async);
  if (r != nccl::kSuccess) return Fail("ncclCommGetAsyncError", r);
  if (async != nccl::kSuccess && async != nccl::kInProgress) {
    return Fail("an earlier NCCL operation (reported by ncclCommGetAsyncError)", async);
  }
  return Status::Ok();
}

bool NcclComm::TryCheckAsync(std::string* error, int* code) {
  std::unique_lock<std::mutex> lock(call_mu_, std::try_to_lock);
  if (!lock.owns_lock()) return false;
  const nccl::Comm comm = comm_.load();
  if (comm == nullptr) return false;  // destroyed or aborted: that failure was reported
  Result async = nccl::kSuccess;
  const Result r = GetApi()->CommGetAsyncError(comm, &async);
  error->clear();
  *code = 0;
  if (r != nccl::kSuccess) {
    *error = Fail("ncclCommGetAsyncError", r).message();
    *code = static_cast<int>(r);
  } else if (async != nccl::kSuccess && async != nccl::kInProgress) {
    *error =
        Fail("an NCCL operation in flight (reported by ncclCommGetAsyncError)", async).message();
    *code = static_cast<int>(async);
  }
  return true;
}

Status NcclComm::AllGatherHost(const std::string& data, std::string* out, double timeout_s) {
  JAX_UB_RETURN_IF_ERROR(Usable("ncclAllGather"));
  if (!(timeout_s > 0)) timeout_s = timeout_s_;
  out->clear();
  // The lengths first, always: a rank with nothing to send (e.g. its IPC export failed) still
  // takes part, and every rank sees the same lengths, so all fail alike instead of some waiting
  // in a collective the others skipped.
  const uint64_t n = data.size();
  std::string lengths;
  JAX_UB_RETURN_IF_ERROR(
      GatherStaged(std::string(reinterpret_cast<const char*>(&n), sizeof(n)), &lengths, timeout_s));
  std::string differ;
  for (int q = 0; q < world_; ++q) {
    uint64_t len = 0;
    std::memcpy(&len, lengths.data() + q * sizeof(len), sizeof(len));
    differ += StrCat() << (q ? ", " : "") << "rank " << q << ": " << len;
    if (len != n) differ += " (differs)";
  }
  if (differ.find("(differs)") != std::string::npos) {
    return Status::Error(
        StrCat() << "jax_ub NCCL: host all-gather on " << Who(rank_, world_, device_)
                 << ": every rank must pass the same number of bytes; got " << differ
                 << " (a rank with 0 had nothing to send: see its error)");
  }
  if (n == 0) return Status::Ok();
  return GatherStaged(data, out, timeout_s);
}

Status NcclComm::GatherStaged(const std::string& data, std::string* out, double timeout_s) {
  const size_t n = data.size();
  out->clear();

  DeviceScope scope(device_);
  if (scope.error() != cudaSuccess) {
    cudaError_t e = scope.error();
    cudaGetLastError();
    return Status::Error(StrCat() << "jax_ub NCCL: cudaSetDevice(" << device_ << ") failed on "
                                  << Who(rank_, world_, device_) << ": " << cudaGetErrorName(e));
  }
  cudaStream_t stream = nullptr;
  cudaEvent_t done = nullptr;
  char* buf = nullptr;  // [world * n recv | n send]
  auto release = [&] {
    if (stream) cudaStreamSynchronize(stream);  // only reached once the collective is finished
    if (buf) cudaFree(buf);
    if (done) cudaEventDestroy(done);
    if (stream) cudaStreamDestroy(stream);
  };
  auto cuda_fail = [&](const char* what, cudaError_t e) {
    cudaGetLastError();
    release();
    return Status::Error(StrCat() << "jax_ub NCCL: " << what << " failed on "
                                  << Who(rank_, world_, device_) << " (all-gather of " << n
                                  << " bytes): " << cudaGetErrorName(e) << " ("
                                  << cudaGetErrorString(e) << ")");
  };
  cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  if (e != cudaSuccess) return cuda_fail("cudaStreamCreateWithFlags", e);
  if ((e = cudaEventCreateWithFlags(&done, cudaEventDisableTiming)) != cudaSuccess) {
    return cuda_fail("cudaEventCreateWithFlags", e);
  }
  void* mem = nullptr;
  if ((e = cudaMalloc(&mem, n * (static_cast<size_t>(world_) + 1))) != cudaSuccess) {
    return cuda_fail("cudaMalloc", e);
  }
  buf = static_cast<char*>(mem);
  char* send = buf + n * static_cast<size_t>(world_);
  if ((e = cudaMemcpyAsync(send, data.data(), n, cudaMemcpyHostToDevice, stream)) != cudaSuccess) {
    return cuda_fail("cudaMemcpyAsync (host to device)", e);
  }
  Status st = AllGatherBytes(send, buf, n, stream);
  if (!st.ok()) {
    release();
    return st;
  }
  if ((e = cudaEventRecord(done, stream)) != cudaSuccess) {
    // The collective is enqueued and may never finish: do not wait on the stream.
    cudaGetLastError();
    AbortAfter("cudaEventRecord failed after ncclAllGather");
    return Status::Error(StrCat() << "jax_ub NCCL: cudaEventRecord failed on "
                                  << Who(rank_, world_, device_) << ": " << cudaGetErrorName(e)
                                  << "; the communicator was aborted");
  }

  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  Backoff backoff;
  for (;;) {
    e = cudaEventQuery(done);
    if (e == cudaSuccess) break;
    if (e != cudaErrorNotReady) {
      cudaGetLastError();
      AbortAfter("a CUDA error during ncclAllGather");
      return Status::Error(StrCat()
                           << "jax_ub NCCL: ncclAllGather of " << n << " bytes failed on "
                           << Who(rank_, world_, device_) << ": " << cudaGetErrorName(e) << " ("
                           << cudaGetErrorString(e) << "); the communicator was aborted");
    }
    Status async = CheckAsync();
    if (!async.ok()) {
      AbortAfter(async.message());
      return Status::Error(async.message() + "; the communicator was aborted");
    }
    if (std::chrono::steady_clock::now() > deadline) {
      std::string msg =
          StrCat() << "jax_ub NCCL: ncclAllGather of " << n << " bytes did not complete within "
                   << timeout_s << " s on " << Who(rank_, world_, device_)
                   << ": some rank of the communicator never took part. Every rank must make "
                      "the same NCCL calls in the same order (did every process call "
                      "jax_ub.initialize()?) (timeout: JAX_UB_TIMEOUT)";
      AbortAfter(msg);
      return Status::Error(msg + "; the communicator was aborted");  // buffers leaked on purpose
    }
    backoff.Wait();
  }
  out->resize(n * static_cast<size_t>(world_));
  if ((e = cudaMemcpyAsync(&(*out)[0], buf, out->size(), cudaMemcpyDeviceToHost, stream)) !=
          cudaSuccess ||
      (e = cudaStreamSynchronize(stream)) != cudaSuccess) {
    out->clear();
    return cuda_fail("cudaMemcpyAsync (device to host)", e);
  }
  release();
  return Status::Ok();
}

Status NcclComm::Destroy() {
  std::lock_guard<std::mutex> call(call_mu_);
  std::lock_guard<std::mutex> lock(dead_mu_);
  nccl::Comm comm = comm_.exchange(nullptr);  // never retried: NCCL may free part of it on failure
  if (comm == nullptr) {
    if (dead_.empty()) dead_ = "destroyed";
    return Status::Ok();  // destroyed before, or aborted after a failure that was reported then
  }
  Api* api = GetApi();
  Result async = nccl::kSuccess;
  Result q = api->CommGetAsyncError(comm, &async);
  const bool broken =
      q != nccl::kSuccess || (async != nccl::kSuccess && async != nccl::kInProgress);
  Result r = broken ? api->CommAbort(comm) : api->CommDestroy(comm);
  dead_ = "destroyed";
  if (r != nccl::kSuccess && r != nccl::kInProgress) {
    return Status::Error(StrCat() << "jax_ub NCCL: "
                                  << (broken ? "ncclCommAbort" : "ncclCommDestroy") << " failed on "
                                  << Who(rank_, world_, device_) << ": "
                                  << Describe(api, r, LastError(api, nullptr)));
  }
  return Status::Ok();
}

}  // namespace jax_ub
