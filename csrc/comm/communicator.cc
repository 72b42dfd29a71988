#include "comm/communicator.h"

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <map>
#include <set>
#include <thread>
#include <utility>

#include "comm/driver.h"
#include "comm/nccl.h"
#include "kernels/flags.h"

namespace jax_ub {
namespace {

const char* SlotName(int slot) {
  switch (slot) {
    case kDataReady: return "data-ready";
    case kAck: return "done-reading";
    case kReady: return "buffer-free";
    case kPiece: return "chain-piece";
  }
  return "?";
}

// A flag value as the watchdog names it: "epoch E", or "epoch E piece J" for kPiece.
std::string FlagValue(int slot, uint64_t v) {
  if (slot != kPiece) return StrCat() << "epoch " << v;
  if (v == 0) return "epoch 0";
  return StrCat() << "epoch " << (v - 1) / kPieceScale << " piece " << (v - 1) % kPieceScale;
}

struct IpcBlob {
  char magic[8];
  int pid;
  int device;
  uint64_t capacity;
  cudaIpcMemHandle_t buffer;
  cudaIpcMemHandle_t flags;
};

}  // namespace

std::string Where(const Communicator& c, const char* op) {
  const auto& o = c.options();
  return StrCat() << "jax_ub " << op << " (set " << o.set_id << ", group " << o.group << ", rank "
                  << o.rank << " of " << o.world << ", device " << o.device << ")";
}

Status Communicator::Create(const Options& o, std::unique_ptr<Communicator>* out) {
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
  JAX_UB_CUDA_RETURN(cudaStreamCreateWithFlags(&c->watch_, cudaStreamNonBlocking));
  JAX_UB_CUDA_RETURN(cudaStreamCreateWithFlags(&c->release_, cudaStreamNonBlocking));
  JAX_UB_CUDA_RETURN(cudaEventCreateWithFlags(&c->read_done_, cudaEventDisableTiming));
  JAX_UB_CUDA_RETURN(cudaEventCreateWithFlags(&c->poisoned_, cudaEventDisableTiming));
  // Load our kernels now: lazy module loading at execute time can synchronize the context while
  // peers wait on this device (one process, several GPUs).
  JAX_UB_RETURN_IF_ERROR(PreloadFlagKernels());
  JAX_UB_CUDA_RETURN(cudaEventCreateWithFlags(&c->start_, cudaEventDisableTiming));
  JAX_UB_CUDA_RETURN(cudaEventCreateWithFlags(&c->begun_, cudaEventDisableTiming));
  for (auto& e : c->join_) JAX_UB_CUDA_RETURN(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  for (auto& e : c->events_) JAX_UB_CUDA_RETURN(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  const size_t n_flags = kNumFlagSlots * o.world;
  if (o.local_only) {
    JAX_UB_RETURN_IF_ERROR(VmmCreate(o.device, (n_flags + 1) * sizeof(uint64_t), &c->flags_vmm_));
    c->flags_ = static_cast<uint64_t*>(c->flags_vmm_.get());
  } else {
    JAX_UB_CUDA_RETURN(
        cudaMalloc(reinterpret_cast<void**>(&c->flags_), (n_flags + 1) * sizeof(uint64_t)));
  }
  JAX_UB_CUDA_RETURN(cudaMemset(c->flags_, 0, (n_flags + 1) * sizeof(uint64_t)));
  c->poison_ = c->flags_ + n_flags;
  JAX_UB_CUDA_RETURN(cudaMallocHost(reinterpret_cast<void**>(&c->host_flags_),
                                    (2 * n_flags + 1) * sizeof(uint64_t)));
  c->host_flags_[2 * n_flags] = 1;
  c->peer_buffer_.assign(o.world, nullptr);
  c->peer_flags_.assign(o.world, nullptr);
  c->local_peer_.assign(o.world, nullptr);
  c->ipc_buffer_.assign(o.world, false);
  c->ipc_flags_.assign(o.world, false);
  JAX_UB_RETURN_IF_ERROR(c->AllocBuffer(o.capacity));
  JAX_UB_CUDA_RETURN(cudaDeviceSynchronize());
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
    return Status::Error(StrCat()
                         << "could not allocate the " << capacity << "-byte registered buffer on "
                         << "device " << o_.device << ": " << why << "; free "
                         << free_b << " of " << total_b
                         << " bytes. XLA preallocates 75% of GPU memory by default: set "
                            "XLA_PYTHON_CLIENT_MEM_FRACTION lower (e.g. 0.6) or "
                            "XLA_PYTHON_CLIENT_PREALLOCATE=false");
  }
  buffer_ = p;
  o_.capacity = capacity;
  peer_buffer_[o_.rank] = buffer_;
  peer_flags_[o_.rank] = flags_;
  return Status::Ok();
}

Status Communicator::Grow(size_t capacity) {
  if (capacity <= o_.capacity) return Status::Ok();
  JAX_UB_CUDA_RETURN(cudaSetDevice(o_.device));
  JAX_UB_CUDA_RETURN(cudaDeviceSynchronize());
  for (int q = 0; q < o_.world; ++q) {
    if (ipc_buffer_[q] && peer_buffer_[q] != nullptr) cudaIpcCloseMemHandle(peer_buffer_[q]);
    ipc_buffer_[q] = false;
    if (q != o_.rank) peer_buffer_[q] = nullptr;
  }
  FreeBuffer();
  return AllocBuffer(capacity);
}

void Communicator::FreeBuffer() {
  if (buffer_vmm_.ptr != 0) {
    VmmFree(&buffer_vmm_);
  } else if (buffer_ != nullptr) {
    cudaFree(buffer_);
  }
  buffer_ = nullptr;
}

Status Communicator::GrantTo(int peer_device) const {
  if (!o_.local_only || peer_device == o_.device) return Status::Ok();
  JAX_UB_RETURN_IF_ERROR(VmmGrant(buffer_vmm_, peer_device));
  return VmmGrant(flags_vmm_, peer_device);
}

Status Communicator::Destroy() {
  if (destroyed_) return Status::Ok();
  destroyed_ = true;
  JAX_UB_CUDA_RETURN(cudaSetDevice(o_.device));
  Drain();
  Status nccl_status;
  if (nccl_ != nullptr) {
    nccl_status = nccl_->Destroy();
    nccl_.reset();
  }
  for (auto& p : nccl_pending_) {
    if (p.done != nullptr) cudaEventDestroy(p.done);
  }
  nccl_pending_.clear();
  for (auto e : nccl_events_) cudaEventDestroy(e);
  nccl_events_.clear();
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
  if (host_flags_ != nullptr) cudaFreeHost(host_flags_);
  for (int i = 0; i < o_.world; ++i) cudaStreamDestroy(comm_[i]);
  for (auto s : compute_) cudaStreamDestroy(s);
  cudaStreamDestroy(watch_);
  cudaStreamDestroy(release_);
  cudaEventDestroy(read_done_);
  cudaEventDestroy(poisoned_);
  cudaEventDestroy(start_);
  cudaEventDestroy(begun_);
  for (auto e : join_) cudaEventDestroy(e);
  for (auto e : events_) cudaEventDestroy(e);
  buffer_ = nullptr;
  flags_ = nullptr;
  host_flags_ = nullptr;
  local_peer_.assign(local_peer_.size(), nullptr);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return Status::Error(StrCat() << "communicator teardown: " << cudaGetErrorString(err));
  }
  return nccl_status;
}

Status Communicator::Drain() {
  if (destroyed_ && buffer_ == nullptr) return Status::Ok();
  JAX_UB_CUDA_RETURN(cudaSetDevice(o_.device));
  const auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    bool busy = false;
    for (int i = 0; i < o_.world; ++i) busy = busy || cudaStreamQuery(comm_[i]) == cudaErrorNotReady;
    for (auto s : compute_) busy = busy || cudaStreamQuery(s) == cudaErrorNotReady;
    cudaGetLastError();
    if (!busy) return Status::Ok();
    Poll();  // fires (and releases) timed-out waits
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
      return Status::Error(StrCat() << "GPU " << o_.device << " cannot access GPU "
                                    << other.device()
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
  std::memcpy(b.magic, "JAXUBIPC", 8);
  b.pid = static_cast<int>(getpid());
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

Status Communicator::ConnectIpc(int peer, const std::string& blob) {
  if (peer < 0 || peer >= o_.world || peer == o_.rank) {
    return Status::Error(StrCat() << "ConnectIpc: bad peer " << peer);
  }
  IpcBlob b{};
  if (blob.size() != sizeof(b) || std::memcmp(blob.data(), "JAXUBIPC", 8) != 0) {
    return Status::Error(StrCat() << "ConnectIpc: peer " << peer
                                  << " sent a malformed handle blob (" << blob.size()
                                  << " bytes; empty means cudaIpcGetMemHandle failed there)");
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
  return Status::Ok();
}

Status Communicator::AttachNccl(std::shared_ptr<NcclComm> n) {
  if (!o_.nccl) {
    return Status::Error(StrCat() << Where(*this, "attach_nccl")
                                  << ": this communicator was created for transport ipc");
  }
  if (n == nullptr || n->rank() != o_.rank || n->world() != o_.world ||
      n->device() != o_.device) {
    return Status::Error(StrCat() << Where(*this, "attach_nccl")
                                  << ": the NCCL communicator does not match (rank "
                                  << (n ? n->rank() : -1) << " of " << (n ? n->world() : -1)
                                  << " on device " << (n ? n->device() : -1) << ")");
  }
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

Status Communicator::Begin(const char* op, cudaStream_t xla, uint64_t* epoch) {
  std::string err = error();
  if (!err.empty()) {
    return Status::Error(StrCat() << "communicator unusable after an earlier failure: " << err);
  }
  if (!Connected()) {
    return Status::Error("communicator is not connected to all peers (jax_ub.initialize() "
                         "did not complete on every rank)");
  }
  if (!o_.nccl) JAX_UB_RETURN_IF_ERROR(HostMeet(epoch_ + 1, op));
  const uint64_t e = ++epoch_;
  *epoch = e;
  op_ = op;
  JAX_UB_CUDA_RETURN(cudaEventRecord(start_, xla));
  for (int i = 0; i < o_.world; ++i) JAX_UB_CUDA_RETURN(cudaStreamWaitEvent(comm_[i], start_, 0));
  for (auto s : compute_) JAX_UB_CUDA_RETURN(cudaStreamWaitEvent(s, start_, 0));
  // NCCL matches sends with receives itself: a rank's buffer is only written once it has posted
  // the receive, i.e. after its previous op (stream order). No handshake. The watchdog follows
  // the op from here: enqueueing can block the host too (NCCL connects peers on first use).
  if (o_.nccl) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!nccl_pending_.empty() && nccl_pending_.back().done == nullptr) {
      nccl_pending_.pop_back();  // an op whose enqueueing failed (its error was returned)
    }
    nccl_pending_.push_back({nullptr, std::chrono::steady_clock::now(), op, e});
    any_pending_.store(true, std::memory_order_release);
  }
  if (o_.nccl) return Status::Ok();
  cudaStream_t s = comm_[0];
  for (int q = 0; q < o_.world; ++q) {
    if (q != o_.rank && e > 1) JAX_UB_RETURN_IF_ERROR(Wait(s, kAck, q, e - 1, op));
  }
  for (int q = 0; q < o_.world; ++q) {
    if (q != o_.rank) JAX_UB_RETURN_IF_ERROR(Signal(s, kReady, q, e));
  }
  JAX_UB_CUDA_RETURN(cudaEventRecord(begun_, s));
  std::lock_guard<std::mutex> lock(mu_);
  begun_epoch_ = e;
  begun_op_ = op;
  return Status::Ok();
}

Status Communicator::HostMeet(uint64_t e, const char* op) {
  entered_.store(e, std::memory_order_release);
  const auto t0 = std::chrono::steady_clock::now();
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
  int j = 0;
  for (int i = 0; i < o_.world; ++i, ++j) {
    JAX_UB_CUDA_RETURN(cudaEventRecord(join_[j], comm_[i]));
    JAX_UB_CUDA_RETURN(cudaStreamWaitEvent(xla, join_[j], 0));
  }
  for (int i = 0; i < kNumComputeStreams; ++i, ++j) {
    JAX_UB_CUDA_RETURN(cudaEventRecord(join_[j], compute_[i]));
    JAX_UB_CUDA_RETURN(cudaStreamWaitEvent(xla, join_[j], 0));
  }
  return Status::Ok();
}

Status Communicator::TrackNccl(cudaStream_t xla) {
  // The watchdog follows this op to completion and aborts NCCL if it takes over timeout_s.
  std::lock_guard<std::mutex> lock(mu_);
  cudaEvent_t done = nullptr;
  if (!nccl_events_.empty()) {
    done = nccl_events_.back();
    nccl_events_.pop_back();
  } else {
    JAX_UB_CUDA_RETURN(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  }
  JAX_UB_CUDA_RETURN(cudaEventRecord(done, xla));
  if (!nccl_pending_.empty() && nccl_pending_.back().done == nullptr) {
    nccl_pending_.back().done = done;
  } else {
    nccl_pending_.push_back({done, std::chrono::steady_clock::now(), op_, epoch_});
  }
  any_pending_.store(!nccl_aborted_, std::memory_order_release);
  return Status::Ok();
}

Status Communicator::End(cudaStream_t xla) {
  JAX_UB_RETURN_IF_ERROR(Join(xla));
  if (o_.nccl) JAX_UB_RETURN_IF_ERROR(TrackNccl(xla));
  // One check per op, after everything: no kernel between a flag wait and its copy (a kernel
  // there would queue behind a running GEMM that holds every SM).
  return LaunchCheckFlag(poison_, xla);
}

void Communicator::Abandon(cudaStream_t xla, const std::string& why) {
  SetError(why);
  Status st = Join(xla);
  if (st.ok() && o_.nccl) st = TrackNccl(xla);
  if (!st.ok()) {
    std::fprintf(stderr, "%s (and joining its streams failed: %s)\n", why.c_str(),
                 st.message().c_str());
  }
  cudaGetLastError();
}

Status Communicator::Wait(cudaStream_t s, int slot, int peer, uint64_t value, const char* op) {
  if (value == 0) return Status::Ok();
  uint64_t* flag = flags_ + slot * o_.world + peer;
  {
    std::lock_guard<std::mutex> lock(mu_);
    PendingWait& p = pending_[slot][peer];
    if (!p.pending) {
      p.pending = true;
      p.since = std::chrono::steady_clock::now();
      p.seen = host_flags_[slot * o_.world + peer];
      p.op = op;
    }
    if (value > p.want) p.want = value;
    any_pending_.store(true, std::memory_order_release);
  }
  return StreamWaitGeq(s, flag, value);
}

Status Communicator::Signal(cudaStream_t s, int slot, int peer, uint64_t value) {
  uint64_t* remote = peer_flags_[peer] + slot * o_.world + o_.rank;
  return StreamWrite(s, remote, value);
}

void Communicator::Poll() {
  // Never blocks: a flag read is an async D2H copy whose completion is checked on the next poll
  // (a stream wait of ours may share a hardware queue with this copy; blocking here could stall
  // the host threads that must enqueue the very signal being waited for).
  if (!any_pending_.load(std::memory_order_acquire) || buffer_ == nullptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  const int n = kNumFlagSlots * o_.world;
  if (cudaSetDevice(o_.device) != cudaSuccess) {
    cudaGetLastError();
    return;
  }
  if (o_.nccl) {
    PollNccl();
    return;
  }
  bool fresh = false;
  if (read_in_flight_) {
    cudaError_t q = cudaEventQuery(read_done_);
    if (q == cudaErrorNotReady) {
      cudaGetLastError();
    } else {
      read_in_flight_ = false;
      fresh = q == cudaSuccess;
      if (fresh) last_fresh_ = std::chrono::steady_clock::now();
    }
  }
  const auto now = std::chrono::steady_clock::now();
  bool still = false;
  for (int slot = 0; slot < kNumFlagSlots; ++slot) {
    for (int q = 0; q < o_.world; ++q) {
      PendingWait& p = pending_[slot][q];
      if (!p.pending) continue;
      const uint64_t have = host_flags_[slot * o_.world + q];
      if (fresh && have >= p.want) {
        p.pending = false;
        continue;
      }
      if (fresh && have > p.seen) {  // the peer is alive and moving: restart the clock
        p.seen = have;
        p.since = now;
      }
      const double waited = std::chrono::duration<double>(now - p.since).count();
      if (waited < o_.timeout_s) {
        still = true;
        continue;
      }
      std::string msg = StrCat()
                        << Where(*this, p.op) << ": timed out after " << waited
                        << " s without progress waiting for rank " << q << " (" << SlotName(slot)
                        << " signal for " << FlagValue(slot, p.want) << "; last seen "
                        << FlagValue(slot, have)
                        << "). The peer never arrived: is its process alive, and does every "
                           "rank run the same sequence of jax_ub ops? (timeout: JAX_UB_TIMEOUT)"
                        << FlagReadAge(now) << GpuState();
      std::fprintf(stderr, "%s\n", msg.c_str());
      std::fflush(stderr);
      if (error_.empty()) error_ = msg;
      // Poison first, then release the waiting stream with a marked value: the op's final check
      // kernel (End) traps, so XLA's call fails instead of hanging or computing on missing data.
      cudaMemcpyAsync(poison_, host_flags_ + 2 * n, sizeof(uint64_t), cudaMemcpyHostToDevice,
                      release_);
      host_flags_[n + slot * o_.world + q] = p.want + kTimeoutMark;
      cudaMemcpyAsync(flags_ + slot * o_.world + q, host_flags_ + n + slot * o_.world + q,
                      sizeof(uint64_t), cudaMemcpyHostToDevice, release_);
      cudaGetLastError();
      p.pending = false;
    }
  }
  // The next read is issued only after the timeouts were judged and reported: an enqueue can
  // block the host (a stalled hardware queue whose command buffer is full), and a timeout must be
  // reported even then.
  if (still && !read_in_flight_ && !fresh) {
    if (cudaMemcpyAsync(host_flags_, flags_, n * sizeof(uint64_t), cudaMemcpyDeviceToHost,
                        watch_) == cudaSuccess &&
        cudaEventRecord(read_done_, watch_) == cudaSuccess) {
      read_in_flight_ = true;
      read_issued_ = std::chrono::steady_clock::now();
    }
    cudaGetLastError();
  }
  any_pending_.store(still, std::memory_order_release);
}

std::string Communicator::FlagReadAge(std::chrono::steady_clock::time_point now) const {
  auto ago = [&](std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(now - t).count();
  };
  StrCat out;
  out << " [watchdog: flags last read from the GPU ";
  if (last_fresh_ == std::chrono::steady_clock::time_point{}) {
    out << "never";
  } else {
    out << ago(last_fresh_) << " s ago";
  }
  if (read_in_flight_) out << "; a read issued " << ago(read_issued_) << " s ago has not completed";
  out << "]";
  return out;
}

std::string Communicator::GpuState() const {
  // Queries only (never blocks): a stuck stream may share a hardware queue with anything we'd
  // enqueue here.
  auto state = [](cudaError_t q) {
    cudaGetLastError();
    return q == cudaSuccess ? "yes" : q == cudaErrorNotReady ? "no" : "unknown";
  };
  StrCat out;
  out << " [this rank's GPU: its latest op (epoch " << begun_epoch_ << ", " << begun_op_
      << "): XLA's stream had reached it: " << state(cudaEventQuery(start_))
      << "; its handshake (done-reading waits, buffer-free signals) had run: "
      << state(cudaEventQuery(begun_)) << "; busy side streams:";
  bool any = false;
  for (int i = 0; i < o_.world; ++i) {
    if (cudaStreamQuery(comm_[i]) == cudaErrorNotReady) {
      out << " comm" << i;
      any = true;
    }
    cudaGetLastError();
  }
  for (int i = 0; i < kNumComputeStreams; ++i) {
    if (cudaStreamQuery(compute_[i]) == cudaErrorNotReady) {
      out << " compute" << i;
      any = true;
    }
    cudaGetLastError();
  }
  if (!any) out << " none";
  out << "; flags as last read:";
  for (int slot = 0; slot < kNumFlagSlots; ++slot) {
    for (int q = 0; q < o_.world; ++q) {
      if (q != o_.rank) {
        out << " " << SlotName(slot) << "[" << q << "]="
            << FlagValue(slot, host_flags_[slot * o_.world + q]);
      }
    }
  }
  out << "]";
  return out;
}

void Communicator::PollNccl() {
  if (nccl_poisoning_) {
    // Abort once the poison word is on the GPU (so the op's check kernel fails the XLA call when
    // NCCL's kernels return), or after 2 s regardless: never block here, the copy may share a
    // hardware queue with the stuck stream.
    const bool landed = cudaEventQuery(poisoned_) != cudaErrorNotReady;
    cudaGetLastError();
    const double since = std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                                       poisoned_at_).count();
    if (!landed && since < 2.0) return;
    nccl_poisoning_ = false;
    nccl_aborted_ = true;
    if (nccl_ != nullptr) nccl_->Abort(error_);
    any_pending_.store(false, std::memory_order_release);
    return;
  }
  while (!nccl_pending_.empty()) {
    PendingOp& p = nccl_pending_.front();
    // No event yet: the op is still being enqueued (maybe blocked in NCCL's connection setup).
    cudaError_t q = p.done == nullptr ? cudaErrorNotReady : cudaEventQuery(p.done);
    if (q == cudaSuccess) {
      nccl_events_.push_back(p.done);
      nccl_pending_.pop_front();
      continue;
    }
    cudaGetLastError();
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - p.since).count();
    // error_ may already hold an op's own failure (Abandon): its NCCL work is still watched.
    if (waited < o_.timeout_s || nccl_aborted_ || nccl_poisoning_) break;
    std::string peers;
    for (int r = 0; r < o_.world; ++r) {
      if (r != o_.rank) peers += (peers.empty() ? "" : ", ") + std::to_string(r);
    }
    std::string msg = StrCat()
                      << Where(*this, p.op) << ": timed out after " << waited
                      << " s in NCCL send/recv with ranks " << peers << " (epoch " << p.epoch
                      << "); NCCL cannot say which peer is missing. Is every process alive, and "
                         "does every rank run the same sequence of jax_ub ops? The NCCL "
                         "communicator was aborted (timeout: JAX_UB_TIMEOUT)";
    std::fprintf(stderr, "%s\n", msg.c_str());
    std::fflush(stderr);
    if (error_.empty()) error_ = msg;
    // Poison first (the op's check kernel then fails the XLA call), then abort on a later poll:
    // NCCL's blocked kernels return and the stream moves on to the check.
    const int n = kNumFlagSlots * o_.world;
    cudaMemcpyAsync(poison_, host_flags_ + 2 * n, sizeof(uint64_t), cudaMemcpyHostToDevice,
                    release_);
    cudaEventRecord(poisoned_, release_);
    cudaGetLastError();
    nccl_poisoning_ = true;
    poisoned_at_ = std::chrono::steady_clock::now();
    break;
  }
  any_pending_.store((!nccl_pending_.empty() && !nccl_aborted_) || nccl_poisoning_,
                     std::memory_order_release);
}

// ----------------------------------------------------------------------------- registry

namespace {

struct Registry {
  std::mutex mu;
  std::map<std::pair<int, int>, std::unique_ptr<Communicator>> comms;
  std::thread watchdog;
  std::atomic<bool> stop{false};
  std::mutex poll_mu;                // held while polling; taken before destroying a member
  std::set<const Communicator*> alive;
};

Registry& Reg() {
  static auto* r = new Registry();  // never destroyed: no work at process exit
  return *r;
}

void WatchdogLoop() {
  Registry& r = Reg();
  while (!r.stop.load()) {
    std::vector<Communicator*> comms;
    {
      std::lock_guard<std::mutex> lock(r.mu);
      for (auto& kv : r.comms) comms.push_back(kv.second.get());
    }
    // Members are only destroyed after the watchdog is joined (RegistryDestroySet), or while it
    // keeps running for other sets: guard with the poll lock.
    {
      std::lock_guard<std::mutex> lock(r.poll_mu);
      for (Communicator* c : comms) {
        if (r.alive.count(c)) c->Poll();
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace

Status RegistryAdd(std::unique_ptr<Communicator> c) {
  Registry& r = Reg();
  std::lock_guard<std::mutex> lock(r.mu);
  const auto key = std::make_pair(c->options().set_id, c->device());
  if (r.comms.count(key)) {
    return Status::Error(StrCat() << "device " << c->device()
                                  << " already has a communicator in set "
                                  << c->options().set_id);
  }
  {
    std::lock_guard<std::mutex> plock(r.poll_mu);
    r.alive.insert(c.get());
  }
  r.comms[key] = std::move(c);
  if (!r.watchdog.joinable()) {
    r.stop = false;
    r.watchdog = std::thread(WatchdogLoop);
  }
  return Status::Ok();
}

Communicator* RegistryGet(int set_id, int device) {
  Registry& r = Reg();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.comms.find(std::make_pair(set_id, device));
  return it == r.comms.end() ? nullptr : it->second.get();
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
  std::vector<std::unique_ptr<Communicator>> doomed;
  std::thread to_join;
  {
    std::lock_guard<std::mutex> lock(r.mu);
    std::lock_guard<std::mutex> plock(r.poll_mu);
    for (auto it = r.comms.begin(); it != r.comms.end();) {
      if (it->first.first == set_id) {
        r.alive.erase(it->second.get());
        doomed.push_back(std::move(it->second));
        it = r.comms.erase(it);
      } else {
        ++it;
      }
    }
    if (r.comms.empty() && r.watchdog.joinable()) {
      r.stop = true;
      to_join = std::move(r.watchdog);
    }
  }
  if (to_join.joinable()) to_join.join();
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
