#include "comm/communicator.h"

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <thread>
#include <utility>

#include "comm/driver.h"
#include "comm/nccl.h"
#include "comm/process.h"
#include "kernels/flags.h"

namespace jax_ub {
namespace {

// Names the layout below (the earlier "JAXUBIPC" carried a bare pid).
constexpr char kIpcMagic[9] = "JAXUBIP2";

struct IpcBlob {
  char magic[8];
  ProcessId process;  // the exporter: the watchdog tells a peer that exited from a late one
  int32_t device;
  int32_t reserved;  // explicit: no padding bytes travel to the peers
  uint64_t capacity;
  cudaIpcMemHandle_t buffer;
  cudaIpcMemHandle_t flags;
};
static_assert(sizeof(IpcBlob) == 8 + sizeof(ProcessId) + 8 + 8 + 2 * sizeof(cudaIpcMemHandle_t),
              "IpcBlob has no padding: every byte sent to the peers is set");

}  // namespace

std::string Where(const Communicator& c, const char* op) {
  const auto& o = c.options();
  return StrCat() << "jax_ub " << op << " (set " << o.set_id << ", group " << o.group << ", rank "
                  << o.rank << " of " << o.world << ", device " << o.device << ")";
}

Status Communicator::Create(const Options& o, std::unique_ptr<Communicator>* out) {
  Status st = CreateMember(o, out);
  if (st.ok()) return st;
  return Status::Error(StrCat() << "jax_ub: cannot create the communicator of rank " << o.rank
                                << " of " << o.world << " on device " << o.device << " (set "
                                << o.set_id << ", group " << o.group << "): " << st.message());
}

Status Communicator::CreateMember(const Options& o, std::unique_ptr<Communicator>* out) {
  if (o.world < 1 || o.world > kMaxWorld || o.rank < 0 || o.rank >= o.world) {
    return Status::Error(StrCat() << "communicator: need 1 <= world <= " << kMaxWorld
                                  << " and 0 <= rank < world; got rank " << o.rank << ", world "
                                  << o.world);
  }
  const Driver* drv = nullptr;
  JAX_UB_RETURN_IF_ERROR(GetDriver(&drv));
  std::unique_ptr<Communicator> c(new Communicator());
  c->o_ = o;
  c->o_.capacity = 0;
  // Sized before anything can fail: Release() walks them for every rank.
  c->peer_buffer_.assign(o.world, nullptr);
  c->peer_flags_.assign(o.world, nullptr);
  c->local_peer_.assign(o.world, nullptr);
  c->ipc_buffer_.assign(o.world, false);
  c->ipc_flags_.assign(o.world, false);
  // Every early return below frees what was created so far (a retry with a smaller buffer after
  // an out-of-memory failure must not leak streams, events and flags).
  struct ReleaseOnFailure {
    Communicator* c;
    ~ReleaseOnFailure() {
      if (c == nullptr) return;
      c->Release();
      cudaGetLastError();  // the error being returned is the one that counts
    }
  } release_on_failure{c.get()};
  JAX_UB_CUDA_RETURN(cudaSetDevice(o.device));
  JAX_UB_CUDA_RETURN(cudaDeviceGetAttribute(&c->sms_, cudaDevAttrMultiProcessorCount, o.device));
  int lo = 0, hi = 0;  // numerically lower = higher priority
  JAX_UB_CUDA_RETURN(cudaDeviceGetStreamPriorityRange(&lo, &hi));
  for (int i = 0; i < o.world; ++i) {
    JAX_UB_CUDA_RETURN(cudaStreamCreateWithPriority(&c->comm_[i], cudaStreamNonBlocking, hi));
  }
  for (int i = 0; i < kNumComputeStreams; ++i) {
    JAX_UB_CUDA_RETURN(cudaStreamCreateWithPriority(&c->compute_[i], cudaStreamNonBlocking, lo));
  }
  JAX_UB_RETURN_IF_ERROR(c->watchdog_.Create());  // its streams, events and pinned memory
  // Load our kernels now: lazy module loading at execute time can synchronize the context while
  // peers wait on this device (one process, several GPUs).
  JAX_UB_RETURN_IF_ERROR(PreloadFlagKernels());
  JAX_UB_CUDA_RETURN(cudaEventCreateWithFlags(&c->start_, cudaEventDisableTiming));
  JAX_UB_CUDA_RETURN(cudaEventCreateWithFlags(&c->begun_, cudaEventDisableTiming));
  for (auto& e : c->join_) JAX_UB_CUDA_RETURN(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  for (auto& e : c->events_)
    JAX_UB_CUDA_RETURN(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  const size_t n_flags = kNumFlagSlots * o.world;
  // The peers' flags, the poison word, progress_[2], op_ids_[world].
  const size_t flag_words = n_flags + 3 + o.world;
  if (o.local_only) {
    JAX_UB_RETURN_IF_ERROR(VmmCreate(o.device, flag_words * sizeof(uint64_t), &c->flags_vmm_));
    c->flags_ = static_cast<uint64_t*>(c->flags_vmm_.get());
  } else {
    JAX_UB_CUDA_RETURN(
        cudaMalloc(reinterpret_cast<void**>(&c->flags_), flag_words * sizeof(uint64_t)));
  }
  JAX_UB_CUDA_RETURN(cudaMemset(c->flags_, 0, flag_words * sizeof(uint64_t)));
  c->poison_ = c->flags_ + n_flags;
  c->progress_ = c->flags_ + n_flags + 1;
  c->op_ids_ = c->flags_ + n_flags + 3;
  JAX_UB_CUDA_RETURN(cudaHostAlloc(reinterpret_cast<void**>(&c->report_host_),
                                   kReportWords * sizeof(uint64_t),
                                   cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(c->report_host_, 0, kReportWords * sizeof(uint64_t));
  JAX_UB_CUDA_RETURN(
      cudaHostGetDevicePointer(reinterpret_cast<void**>(&c->report_dev_), c->report_host_, 0));
  JAX_UB_RETURN_IF_ERROR(c->AllocBuffer(o.capacity));
  JAX_UB_CUDA_RETURN(cudaDeviceSynchronize());
  release_on_failure.c = nullptr;
  *out = std::move(c);
  return Status::Ok();
}

Status Communicator::AllocBuffer(size_t capacity) {
  if (capacity == 0) capacity = 1 << 20;
  capacity = (capacity + 4095) / 4096 * 4096;
  void* p = nullptr;
  std::string why;
  if (o_.local_only) {
    Status s = VmmCreate(o_.device, capacity, &buffer_vmm_);
    if (s.ok()) {
      p = buffer_vmm_.get();
      capacity = buffer_vmm_.size;
    } else {
      why = s.message();
    }
  } else {
    cudaError_t err = cudaMalloc(&p, capacity);
    if (err != cudaSuccess) {
      cudaGetLastError();
      why = cudaGetErrorString(err);
      p = nullptr;
    }
  }
  if (p == nullptr) {
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    return Status::Error(StrCat() << "could not allocate the " << capacity
                                  << "-byte registered buffer on "
                                  << "device " << o_.device << ": " << why << "; free " << free_b
                                  << " of " << total_b
                                  << " bytes. XLA preallocates 75% of GPU memory by default: set "
                                     "XLA_PYTHON_CLIENT_MEM_FRACTION lower (e.g. 0.6) or "
                                     "XLA_PYTHON_CLIENT_PREALLOCATE=false");
  }
  {
    std::lock_guard<std::mutex> lock(mu_);  // the watchdog's reader reads buffer_ under it
    buffer_ = p;
    o_.capacity = capacity;
  }
  peer_buffer_[o_.rank] = buffer_;
  peer_flags_[o_.rank] = flags_;
  return Status::Ok();
}

Status Communicator::Grow(size_t capacity) {
  std::lock_guard<std::mutex> op_lock(op_mu_);
  if (capacity <= o_.capacity) return Status::Ok();
  JAX_UB_CUDA_RETURN(cudaSetDevice(o_.device));
  JAX_UB_CUDA_RETURN(cudaDeviceSynchronize());
  for (int q = 0; q < o_.world; ++q) {
    if (ipc_buffer_[q] && peer_buffer_[q] != nullptr) cudaIpcCloseMemHandle(peer_buffer_[q]);
    ipc_buffer_[q] = false;
    if (q != o_.rank) peer_buffer_[q] = nullptr;
  }
  FreeBuffer();
  Status s = AllocBuffer(capacity);
  if (!s.ok()) {
    // No buffer now: later ops must fail naming this, not "not connected to all peers".
    {
      std::lock_guard<std::mutex> lock(mu_);
      o_.capacity = 0;
    }
    peer_buffer_[o_.rank] = nullptr;
    SetError(StrCat() << Where(*this, "buffer growth") << ": " << s.message());
  }
  return s;
}

void Communicator::FreeBuffer() {
  if (buffer_vmm_.ptr != 0) {
    VmmFree(&buffer_vmm_);
  } else if (buffer_ != nullptr) {
    cudaFree(buffer_);
  }
  std::lock_guard<std::mutex> lock(mu_);
  buffer_ = nullptr;
}

Status Communicator::GrantTo(int peer_device) const {
  if (!o_.local_only || peer_device == o_.device) return Status::Ok();
  JAX_UB_RETURN_IF_ERROR(VmmGrant(buffer_vmm_, peer_device));
  return VmmGrant(flags_vmm_, peer_device);
}

Status Communicator::Destroy() {
  std::lock_guard<std::mutex> op_lock(op_mu_);
  if (destroyed_) return Status::Ok();
  destroyed_ = true;
  JAX_UB_CUDA_RETURN(cudaSetDevice(o_.device));
  const Status drained = Drain();
  Status nccl_status;
  if (nccl_ != nullptr) {
    // Not drained: an NCCL kernel may still be queued, and ncclCommDestroy would wait for it
    // (forever, holding op_mu_) or free what it uses. Leave it, like the buffers below.
    if (drained.ok()) {
      nccl_status = nccl_->Destroy();
    } else {
      nccl_->Leak(drained.message());
    }
    nccl_->SetBeforeAbort(nullptr);  // it writes into report_host_, freed below
    nccl_.reset();
  }
  if (!drained.ok()) {
    // A side stream still waits or copies: freeing its memory now could fault the GPU (or block
    // in cudaFree). Leave it all allocated; the process is expected to end.
    return Status::Error(StrCat() << drained.message() << "; its buffer, flags, streams"
                                  << (o_.nccl ? " and NCCL communicator" : "")
                                  << " are left allocated");
  }
  Release();
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return Status::Error(StrCat() << "communicator teardown: " << cudaGetErrorString(err));
  }
  return nccl_status;
}

void Communicator::Release() {
  cudaSetDevice(o_.device);
  watchdog_.Release();
  for (int q = 0; q < o_.world; ++q) {
    if (ipc_buffer_[q] && peer_buffer_[q] != nullptr) cudaIpcCloseMemHandle(peer_buffer_[q]);
    if (ipc_flags_[q] && peer_flags_[q] != nullptr) cudaIpcCloseMemHandle(peer_flags_[q]);
  }
  FreeBuffer();
  if (flags_vmm_.ptr != 0) {
    VmmFree(&flags_vmm_);
  } else if (flags_ != nullptr) {
    cudaFree(flags_);
  }
  if (report_host_ != nullptr) cudaFreeHost(report_host_);
  auto destroy_stream = [](cudaStream_t& s) {
    if (s != nullptr) cudaStreamDestroy(s);
    s = nullptr;
  };
  auto destroy_event = [](cudaEvent_t& e) {
    if (e != nullptr) cudaEventDestroy(e);
    e = nullptr;
  };
  for (auto& s : comm_) destroy_stream(s);
  for (auto& s : compute_) destroy_stream(s);
  destroy_event(start_);
  destroy_event(begun_);
  for (auto& e : join_) destroy_event(e);
  for (auto& e : events_) destroy_event(e);
  buffer_ = nullptr;
  flags_ = nullptr;
  poison_ = nullptr;
  progress_ = nullptr;
  op_ids_ = nullptr;
  report_host_ = nullptr;
  report_dev_ = nullptr;
  local_peer_.assign(local_peer_.size(), nullptr);
}

Status Communicator::Drain() {
  if (destroyed_ && buffer_ == nullptr) return Status::Ok();
  JAX_UB_CUDA_RETURN(cudaSetDevice(o_.device));
  const auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    bool busy = false;
    for (int i = 0; i < o_.world; ++i)
      busy = busy || cudaStreamQuery(comm_[i]) == cudaErrorNotReady;
    for (auto s : compute_) busy = busy || cudaStreamQuery(s) == cudaErrorNotReady;
    cudaGetLastError();
    if (!busy) return Status::Ok();
    watchdog_.PollGpu();  // reads flags, delivers releases
    watchdog_.Judge();    // fires timed-out waits
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (waited > o_.timeout_s + 5) {
      return Status::Error(StrCat() << Where(*this, "drain") << ": streams still busy after "
                                    << waited << " s");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

Status Communicator::ConnectLocal(int peer, const Communicator& other) {
  if (peer < 0 || peer >= o_.world || peer == o_.rank) {
    return Status::Error(StrCat() << "ConnectLocal: bad peer " << peer);
  }
  JAX_UB_CUDA_RETURN(cudaSetDevice(o_.device));
  if (other.device() != o_.device) {
    int can = 0;
    JAX_UB_CUDA_RETURN(cudaDeviceCanAccessPeer(&can, o_.device, other.device()));
    if (!can) {
      return Status::Error(StrCat()
                           << "GPU " << o_.device << " cannot access GPU " << other.device()
                           << " (no P2P): use transport='nccl' for this group");
    }
  }
  if (other.device() != o_.device && o_.local_only && other.o_.local_only) {
    JAX_UB_RETURN_IF_ERROR(other.GrantTo(o_.device));  // only these two allocations are mapped
  } else if (other.device() != o_.device) {
    cudaError_t err = cudaDeviceEnablePeerAccess(other.device(), 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      cudaGetLastError();
    } else if (err != cudaSuccess) {
      JAX_UB_CUDA_RETURN(err);
    }
  }
  peer_buffer_[peer] = other.buffer_;
  peer_flags_[peer] = other.flags_;
  local_peer_[peer] = &other;
  return Status::Ok();
}

std::string Communicator::ExportIpc() const {
  if (o_.local_only) return std::string();  // cuMem allocations have no cudaIpc handle
  IpcBlob b{};
  std::memcpy(b.magic, kIpcMagic, 8);
  b.process = ThisProcess();
  b.device = o_.device;
  b.capacity = o_.capacity;
  cudaSetDevice(o_.device);
  if (cudaIpcGetMemHandle(&b.buffer, buffer_) != cudaSuccess ||
      cudaIpcGetMemHandle(&b.flags, flags_) != cudaSuccess) {
    cudaGetLastError();
    return std::string();
  }
  return std::string(reinterpret_cast<const char*>(&b), sizeof(b));
}

Status Communicator::ConnectIpc(int peer, const std::string& blob, std::string* unchecked) {
  if (peer < 0 || peer >= o_.world || peer == o_.rank) {
    return Status::Error(StrCat() << "ConnectIpc: bad peer " << peer);
  }
  IpcBlob b{};
  if (blob.size() != sizeof(b) || std::memcmp(blob.data(), kIpcMagic, 8) != 0) {
    return Status::Error(StrCat() << "ConnectIpc: peer " << peer
                                  << " sent a malformed handle blob (" << blob.size()
                                  << " bytes; empty means cudaIpcGetMemHandle failed there; "
                                     "otherwise most likely a different jax_ub build there)");
  }
  std::memcpy(&b, blob.data(), sizeof(b));
  if (b.capacity != o_.capacity) {
    return Status::Error(StrCat() << "ConnectIpc: peer " << peer << " has a " << b.capacity
                                  << "-byte buffer, this rank " << o_.capacity);
  }
  JAX_UB_CUDA_RETURN(cudaSetDevice(o_.device));
  void* buf = nullptr;
  JAX_UB_CUDA_RETURN(cudaIpcOpenMemHandle(&buf, b.buffer, cudaIpcMemLazyEnablePeerAccess));
  peer_buffer_[peer] = buf;
  ipc_buffer_[peer] = true;
  if (!ipc_flags_[peer]) {
    void* fl = nullptr;
    JAX_UB_CUDA_RETURN(cudaIpcOpenMemHandle(&fl, b.flags, cudaIpcMemLazyEnablePeerAccess));
    peer_flags_[peer] = static_cast<uint64_t*>(fl);
    ipc_flags_[peer] = true;
  }
  const std::string why_not = WhyNotCheckable(b.process);
  if (unchecked != nullptr) *unchecked = why_not;
  watchdog_.SetPeerProcess(peer, why_not.empty() ? b.process : ProcessId{});
  return Status::Ok();
}

Status Communicator::AttachNccl(std::shared_ptr<NcclComm> n) {
  if (!o_.nccl) {
    return Status::Error(StrCat() << Where(*this, "attach_nccl")
                                  << ": this communicator was created for transport ipc");
  }
  if (nccl_ != nullptr) {
    return Status::Error(StrCat() << Where(*this, "attach_nccl")
                                  << ": an NCCL communicator is attached already");
  }
  if (n == nullptr || n->rank() != o_.rank || n->world() != o_.world || n->device() != o_.device) {
    return Status::Error(StrCat() << Where(*this, "attach_nccl")
                                  << ": the NCCL communicator does not match (rank "
                                  << (n ? n->rank() : -1) << " of " << (n ? n->world() : -1)
                                  << " on device " << (n ? n->device() : -1) << ")");
  }
  // Any abort (the watchdog's, or an op's own when NCCL failed under it) first marks the op
  // failed in host-mapped memory: End's check reads it, so an op whose kernels the abort releases
  // fails instead of returning what they left in its output.
  volatile uint64_t* mark = report_host_ + kAbortMark;
  const uint64_t value = PoisonValue(o_.rank);
  n->SetBeforeAbort([mark, value] {
    *mark = value;
    std::atomic_thread_fence(std::memory_order_seq_cst);
  });
  nccl_ = std::move(n);
  return Status::Ok();
}

bool Communicator::Connected() const {
  if (o_.nccl) return nccl_ != nullptr;
  for (int q = 0; q < o_.world; ++q) {
    if (peer_buffer_[q] == nullptr || peer_flags_[q] == nullptr) return false;
  }
  return true;
}

std::string Communicator::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

void Communicator::SetError(const std::string& msg) {
  std::lock_guard<std::mutex> lock(mu_);
  if (error_.empty()) error_ = msg;
}

Status Communicator::Usable() const {
  std::string err = error();
  if (err.empty()) return Status::Ok();
  return Status::Error(StrCat() << "communicator unusable after an earlier failure: " << err);
}

namespace {

uint32_t Fnv1a(const std::string& s) {
  uint32_t h = 2166136261u;
  for (unsigned char ch : s) h = (h ^ ch) * 16777619u;
  return h;
}

}  // namespace

Status Communicator::Begin(const char* op, cudaStream_t xla, uint64_t* epoch,
                           const std::string& what) {
  JAX_UB_RETURN_IF_ERROR(Usable());
  if (!Connected()) {
    return Status::Error(
        "communicator is not connected to all peers (jax_ub.initialize() "
        "did not complete on every rank)");
  }
  if (!o_.nccl) JAX_UB_RETURN_IF_ERROR(HostMeet(epoch_ + 1, op));
  const uint64_t e = ++epoch_;
  *epoch = e;
  op_ = op;
  op_hash_ = Fnv1a(std::string(op) + " " + what);
  watchdog_.RecordOp(e, std::string(op) + " " + what);
  // This GPU is inside op e from here (the watchdog times its waits only while it is).
  JAX_UB_RETURN_IF_ERROR(StreamWrite(xla, progress_, e));
  JAX_UB_CUDA_RETURN(cudaEventRecord(start_, xla));
  // Side streams follow XLA's work from their first use in this op on (Use).
  in_op_ = true;
  used_ = 0;
  use_error_ = cudaSuccess;
  // NCCL matches sends with receives itself: a rank's buffer is only written once it has posted
  // the receive, i.e. after its previous op (stream order). No handshake. The watchdog follows
  // the op from here: enqueueing can block the host too (NCCL connects peers on first use).
  if (o_.nccl) {
    watchdog_.BeginNcclOp(op, e);
    return Status::Ok();
  }
  cudaStream_t s = comm(0);
  // The buffer-free signal below must follow every read of this rank's buffer by the previous
  // op, which ran on side streams joined into that op's XLA stream only: XLA may launch this op
  // on another stream. The previous Join's events are still recorded (Abandon records them too).
  // Streams that op did not use were last used by an earlier op, whose work comm(0) (used and
  // joined by every op) already follows.
  if (e > 1) {
    for (int bit = 0; bit < kMaxWorld + kNumComputeStreams; ++bit) {
      if (joined_ & (1u << bit)) JAX_UB_CUDA_RETURN(cudaStreamWaitEvent(s, join_[bit], 0));
    }
  }
  // The handshake, one batch in this order: the peers' acks of e - 1, the op's id (a peer that
  // saw this rank's buffer-free signal, or any later one on this stream, sees the id too), the
  // buffer-free signals.
  MemOps hs;
  for (int q = 0; q < o_.world; ++q) {
    if (q != o_.rank && e > 1) Wait(&hs, kAck, q, e - 1, op);
  }
  for (int q = 0; q < o_.world; ++q) {
    if (q != o_.rank) hs.Write(peer_flags_[q] + (op_ids_ - flags_) + o_.rank, (e << 32) | op_hash_);
  }
  for (int q = 0; q < o_.world; ++q) {
    if (q != o_.rank) Signal(&hs, kReady, q, e);
  }
  JAX_UB_RETURN_IF_ERROR(hs.Enqueue(s));
  JAX_UB_CUDA_RETURN(cudaEventRecord(begun_, s));
  std::lock_guard<std::mutex> lock(mu_);
  begun_epoch_ = e;
  begun_op_ = op;
  return Status::Ok();
}

Status Communicator::HostMeet(uint64_t e, const char* op) {
  entered_.store(e, std::memory_order_release);
  const auto t0 = std::chrono::steady_clock::now();
  struct MeetTime {  // every return path adds the time waited
    std::atomic<uint64_t>& into;
    std::chrono::steady_clock::time_point t0;
    ~MeetTime() {
      into.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(
                         std::chrono::steady_clock::now() - t0)
                         .count(),
                     std::memory_order_relaxed);
    }
  } meet_time{host_meet_ns_, t0};
  for (int q = 0; q < o_.world; ++q) {
    const Communicator* p = local_peer_[q];
    if (p == nullptr) continue;
    for (uint64_t spins = 0; p->entered_.load(std::memory_order_acquire) < e; ++spins) {
      if (spins < 256) {
        std::this_thread::yield();
        continue;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
      if (spins % 512 != 0) continue;  // about every 10 ms: a failed peer, the timeout
      const std::string peer_err = p->error();
      const double waited =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (peer_err.empty() && waited < o_.timeout_s) continue;
      std::string why;
      if (peer_err.empty()) {
        why = StrCat() << "within " << waited << " s (its latest: epoch "
                       << p->entered_.load(std::memory_order_acquire)
                       << "). Does every rank run the same sequence of jax_ub ops? (timeout: "
                          "JAX_UB_TIMEOUT)";
      } else {
        why = StrCat() << "and cannot: " << peer_err;
      }
      std::string msg = StrCat() << "rank " << q << " (device " << p->device()
                                 << ", this process) did not start op epoch " << e
                                 << " on the host " << why;
      // The sticky error names the op (later ops and jax_ub.comm.errors() report it); the
      // returned one does not: the FFI layer prefixes every failure with the same location.
      SetError(StrCat() << Where(*this, op) << ": " << msg);
      return Status::Error(msg);
    }
  }
  return Status::Ok();
}

Status Communicator::Join(cudaStream_t xla) {
  // Whatever happens below, the op is over: later uses of a stream fan out no more.
  const uint32_t used = used_;
  in_op_ = false;
  used_ = 0;
  joined_ = 0;
  for (int bit = 0; bit < kMaxWorld + kNumComputeStreams; ++bit) {
    if ((used & (1u << bit)) == 0) continue;
    cudaStream_t side = bit < kMaxWorld ? comm_[bit] : compute_[bit - kMaxWorld];
    JAX_UB_CUDA_RETURN(cudaEventRecord(join_[bit], side));
    joined_ |= 1u << bit;
    JAX_UB_CUDA_RETURN(cudaStreamWaitEvent(xla, join_[bit], 0));
  }
  if (use_error_ != cudaSuccess) {
    const cudaError_t err = use_error_;
    use_error_ = cudaSuccess;
    return Status::Error(StrCat() << "a side stream's wait for XLA's work (cudaStreamWaitEvent): "
                                  << cudaGetErrorString(err));
  }
  return Status::Ok();
}

Status Communicator::End(cudaStream_t xla) {
  JAX_UB_RETURN_IF_ERROR(Join(xla));
  JAX_UB_RETURN_IF_ERROR(StreamWrite(xla, progress_ + 1, epoch_));
  if (o_.nccl) {
    JAX_UB_RETURN_IF_ERROR(watchdog_.TrackNccl(xla, op_, epoch_));
    // One check per op, after everything: no kernel between a flag wait and its copy (a kernel
    // there would queue behind a running GEMM that holds every SM).
    return LaunchCheckFlag(poison_, report_dev_ + kAbortMark, xla);
  }
  return LaunchCheckOp(poison_, op_ids_, o_.world, o_.rank, (epoch_ << 32) | op_hash_, report_dev_,
                       xla);
}

void Communicator::Abandon(cudaStream_t xla, const std::string& why) {
  SetError(why);
  Status st = Join(xla);
  if (st.ok() && o_.nccl) st = watchdog_.TrackNccl(xla, op_, epoch_);
  if (!st.ok()) {
    std::fprintf(stderr, "%s (and joining its streams failed: %s)\n", why.c_str(),
                 st.message().c_str());
  }
  cudaGetLastError();
}

Status Communicator::Signal(cudaStream_t s, int slot, int peer, uint64_t value) {
  uint64_t* remote = peer_flags_[peer] + slot * o_.world + o_.rank;
  return StreamWrite(s, remote, value);
}

void Communicator::Signal(MemOps* b, int slot, int peer, uint64_t value) {
  b->Write(peer_flags_[peer] + slot * o_.world + o_.rank, value);
}

Status Communicator::Wait(cudaStream_t s, int slot, int peer, uint64_t value, const char* op) {
  if (value == 0) return Status::Ok();
  return StreamWaitGeq(s, watchdog_.Watch(slot, peer, value, op), value);
}

void Communicator::Wait(MemOps* b, int slot, int peer, uint64_t value, const char* op) {
  if (value != 0) b->WaitGeq(watchdog_.Watch(slot, peer, value, op), value);
}

// ----------------------------------------------------------------------------- registry

namespace {

struct Registry {
  std::mutex mu;
  std::map<std::pair<int, int>, std::shared_ptr<Communicator>> comms;
};

Registry& Reg() {
  static auto* r = new Registry();  // never destroyed: no work at process exit
  return *r;
}

}  // namespace

Status RegistryAdd(std::unique_ptr<Communicator> c) {
  Registry& r = Reg();
  std::lock_guard<std::mutex> lock(r.mu);
  const auto key = std::make_pair(c->options().set_id, c->device());
  if (r.comms.count(key)) {
    c->Destroy();  // never connected, never ran an op
    return Status::Error(StrCat() << "device " << c->device()
                                  << " already has a communicator in set " << c->options().set_id);
  }
  c->watchdog().Start();
  r.comms[key] = std::move(c);
  return Status::Ok();
}

std::shared_ptr<Communicator> RegistryGet(int set_id, int device) {
  Registry& r = Reg();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.comms.find(std::make_pair(set_id, device));
  return it == r.comms.end() ? nullptr : it->second;
}

std::vector<Communicator*> RegistrySet(int set_id) {
  Registry& r = Reg();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<Communicator*> out;
  for (auto& kv : r.comms) {
    if (kv.first.first == set_id) out.push_back(kv.second.get());
  }
  return out;
}

Status RegistryDestroySet(int set_id) {
  Registry& r = Reg();
  std::vector<std::shared_ptr<Communicator>> doomed;
  {
    std::lock_guard<std::mutex> lock(r.mu);
    for (auto it = r.comms.begin(); it != r.comms.end();) {
      if (it->first.first == set_id) {
        doomed.push_back(std::move(it->second));
        it = r.comms.erase(it);
      } else {
        ++it;
      }
    }
  }
  // The watchdog threads let go of them first (the last member's Stop joins the threads): Destroy
  // drains and judges on this thread.
  for (auto& c : doomed) c->watchdog().Stop();
  Status first;
  for (auto& c : doomed) {
    Status s = c->Destroy();
    if (!s.ok() && first.ok()) first = s;
  }
  return first;
}

size_t RegistrySize() {
  Registry& r = Reg();
  std::lock_guard<std::mutex> lock(r.mu);
  return r.comms.size();
}

}  // namespace jax_ub
