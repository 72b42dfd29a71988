// A Userbuffers communicator: one per (TP group, member GPU). It owns the member's registered
// buffer and flag array, sees every peer's buffer and flags (peer-mapped: same-process pointers or
// CUDA IPC), and owns the side streams of the overlap schedules. Lifecycle is explicit
// (Create ... Destroy, driven by jax_ub.initialize()/shutdown()); no CUDA work in destructors.
//
// Signalling protocol (epochs are per communicator, +1 per op, identical on every rank because
// every rank runs the same sequence of jax_ub ops):
//   flags[slot * world + q] on rank r holds the last epoch that peer q signalled in `slot`:
//   kDataReady: q's data for r is in place (AG: q's shard in q's buffer; RS: q's partial in r's).
//   kAck:       q has finished touching r's buffer for that epoch.
//   kReady:     q's buffer may be written by peers for that epoch.
//   kPiece:     e * kPieceScale + j + 1: pieces 0..j of q's data for r are in place (GEMM->RS chain
//               only: pieces of one op are signalled in order; the value grows with the epoch
//               like the others, so a wait of epoch e is never satisfied by an older epoch).
// Every op at epoch e starts with: wait kAck >= e-1 from all peers, then signal kReady = e.
//
// A wait the watchdog times out is released (its stream moves on) after the poison word is set,
// so the op's End check fails the XLA call. What the op enqueued after the released wait still
// runs, on the copy engines: a released kReady/kAck wait lets it write into a peer's buffer, or
// into its own that a peer may still be reading. No GPU-side condition can stop a copy-engine
// copy (a check kernel before it would queue behind a GEMM that holds every SM), so the peers are
// told instead: the release first writes the poison word of every peer too, then the flags. A
// peer whose op is still in flight fails it at its End check (naming this rank), and a peer whose
// check already passed had finished with both buffers before this rank's first late write. A peer
// between ops sees the word in its watchdog's next read (JudgeGaveUp) and refuses its next op on
// the host.

#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/driver.h"
#include "comm/process.h"
#include "comm/protocol.h"
#include "comm/watchdog.h"
#include "common/status.h"

namespace jax_ub {

class NcclComm;

class Communicator {
 public:
  struct Options {
    int set_id = 0;  // which jax_ub.initialize() communicator set (FFI attribute)
    int group = 0;  // TP group index within the set
    int rank = 0;  // rank within the group
    int world = 1;  // group size
    int device = 0;  // process-local CUDA ordinal
    size_t capacity = 0;  // bytes of the registered buffer (grows with Grow)
    double timeout_s = 120.0;
    // Every peer lives in this process: buffer and flags are cuMem allocations mapped for the
    // peers (ConnectLocal) instead of cudaMalloc + cudaDeviceEnablePeerAccess; no IPC export.
    bool local_only = false;
    // Transport "nccl": peers are reached by ncclSend/ncclRecv of an attached NcclComm
    // (AttachNccl); no peer mapping, no flags. The buffer is a private landing/staging area.
    bool nccl = false;
    // What the judge does when a timed-out wait's release cannot reach the GPU (see Judge):
    // true: report and abort the process; false: report and leave it waiting.
    bool abort_on_stall = true;
  };

  // Errors name the member (set, group, rank, world, device) being created.
  static Status Create(const Options& o, std::unique_ptr<Communicator>* out);
  // Frees everything; safe to call twice (Drain first, on every rank). If the side streams do not
  // drain (a wait that cannot end with JAX_UB_ON_STALL=wait), the buffer, flags and streams are
  // left allocated on purpose (the GPU may still touch them) and the drain's error is returned.
  Status Destroy();
  // Waits until this member's side streams are idle, firing timeouts like the watchdog does;
  // bounded by timeout_s.
  Status Drain();
  ~Communicator() = default;

  // --- wiring (initialize time) ---
  // Same-process peer: enables peer access and uses its pointers directly.
  Status ConnectLocal(int peer, const Communicator& other);
  // Cross-process peer: CUDA IPC handles of the peer's buffer and flags.
  std::string ExportIpc() const;
  // `unchecked` (may be null) receives why the peer's process cannot be watched for an exit
  // ("" where it can).
  Status ConnectIpc(int peer, const std::string& blob, std::string* unchecked = nullptr);
  bool Connected() const;
  // Transport "nccl": takes (shared) ownership of this member's NCCL communicator (rank and world
  // must match); Destroy() destroys it.
  Status AttachNccl(std::shared_ptr<NcclComm> n);
  NcclComm* nccl() const { return nccl_.get(); }
  // Replaces the buffer by a larger one (all ranks must then reconnect). Synchronizes the device.
  // If the new buffer cannot be allocated, the member is left without one and marked unusable
  // (later ops fail naming the allocation failure).
  Status Grow(size_t capacity);

  // --- per op (execute time) ---
  // Starts an op on XLA's stream: returns its epoch (left 0 if it fails before taking one: a
  // failure after that must abandon the communicator); each side stream waits for XLA's work so
  // far at its first use in the op (comm(), compute()); waits kAck(e-1) from every peer and
  // signals kReady(e) to every peer on stream comm(0), in one batch of memory operations.
  // Peers in this process (ConnectLocal) first meet on the host (HostMeet) before anything of
  // the op is enqueued.
  // `what` describes the op (kind, algorithm, dtype, shapes: equal on every rank that runs the same
  // op); ipc transport: its hash goes to every peer with the epoch, and End's check kernel fails
  // the call where a peer ran another op at this epoch (the judge then names both).
  Status Begin(const char* op, cudaStream_t xla, uint64_t* epoch, const std::string& what = "");
  // Joins every side stream the op used back into XLA's stream, then (one tiny kernel on XLA's
  // stream) fails the call if the watchdog force-released a wait of this communicator. Transport
  // nccl: the watchdog also watches the op's completion and aborts the NCCL communicator after
  // timeout_s.
  Status End(cudaStream_t xla);
  // An op whose body failed between Begin and End (its error goes back to XLA): its epoch is half
  // done and peers may wait for signals it never sent, so the communicator is marked unusable with
  // `why` (later ops fail at Begin naming it; peers' waits end in the watchdog's timeout naming
  // this rank). The side streams are still joined into XLA's stream, so nothing enqueued so far
  // outlives the call's buffers; transport nccl: the watchdog still follows (and may abort) it.
  void Abandon(cudaStream_t xla, const std::string& why);
  // Serializes this member's ops (RunOp holds it from Begin to End) with Grow and Destroy, so a
  // shutdown or a buffer growth on another thread cannot free what an op is enqueueing on.
  std::mutex& op_mutex() { return op_mu_; }
  bool destroyed() const { return destroyed_; }  // with op_mutex() held
  // Stream-ordered wait for flags[slot][peer] >= value, watched by the watchdog.
  Status Wait(cudaStream_t s, int slot, int peer, uint64_t value, const char* op);
  // Stream-ordered write of `value` into peer's flags[slot][my rank].
  Status Signal(cudaStream_t s, int slot, int peer, uint64_t value);
  // The same, added to a batch that the caller enqueues (MemOps::Enqueue) on the stream it
  // would have passed: the wait is watched from here on, like Wait's.
  void Wait(MemOps* b, int slot, int peer, uint64_t value, const char* op);
  void Signal(MemOps* b, int slot, int peer, uint64_t value);

  const Options& options() const { return o_; }
  int rank() const { return o_.rank; }
  int world() const { return o_.world; }
  int device() const { return o_.device; }
  size_t capacity() const { return o_.capacity; }
  int sms() const { return sms_; }  // multiprocessors of this member's GPU
  void* buffer() const { return buffer_; }
  void* peer_buffer(int q) const { return peer_buffer_[q]; }
  // The side streams. Inside an op (Begin .. End) a stream's first use makes it wait for XLA's
  // work before the op, and End joins exactly the streams the op used back into XLA's stream:
  // an op pays host calls only for the streams its schedule touches (push at tp=4 uses 3 of 6).
  cudaStream_t comm(int i) { return Use(comm_[i], i); }
  cudaStream_t compute(int i) {
    const int j = i % kNumComputeStreams;
    return Use(compute_[j], kMaxWorld + j);
  }
  cudaEvent_t event(int i) const { return events_[i]; }  // scratch events, i < kNumEvents
  static constexpr int kNumEvents = 4 * kMaxWorld;

  // Host time of this member's ops (RunOp: the FFI handler's enqueueing, from entry to return),
  // of which waiting in HostMeet for same-process peers: tells a host-bound program (enqueueing
  // as slow as the GPU runs the ops) from a GPU-bound one. Totals since Create.
  struct HostStats {
    uint64_t ops = 0, total_ns = 0, meet_ns = 0;
  };
  HostStats host_stats() const {
    return {host_ops_.load(), host_total_ns_.load(), host_meet_ns_.load()};
  }
  void AddHostOp(uint64_t total_ns) {
    host_ops_.fetch_add(1, std::memory_order_relaxed);
    host_total_ns_.fetch_add(total_ns, std::memory_order_relaxed);
  }

  // Sticky error set by the watchdog after a timeout; every later op fails with it.
  std::string error() const;
  // Ok, or the sticky error as an op's failure ("communicator unusable after ...").
  Status Usable() const;
  void SetError(const std::string& msg);

  // Test hook (jax_ub.comm's inject_failure): the next op on this member fails before Begin
  // (kFailCheck, like a refused op) or right after it (kFailBody, like a body whose enqueue fails).
  enum Injected : int { kFailNone = 0, kFailCheck = 1, kFailBody = 2 };
  void Inject(Injected what) { inject_.store(what); }
  bool TakeInjected(Injected what) {
    int want = what;
    return inject_.compare_exchange_strong(want, kFailNone);
  }

  // The watchdog (comm/watchdog.h): started by RegistryAdd, stopped by RegistryDestroySet.
  Watchdog& watchdog() { return watchdog_; }

 private:
  friend class Watchdog;  // reads the flags, streams and options; sets the sticky error
  Communicator() = default;
  static Status CreateMember(const Options& o, std::unique_ptr<Communicator>* out);
  // Frees whatever Create got so far (null handles skipped); no drain. Create's failures and
  // Destroy after a successful drain.
  void Release();
  Status AllocBuffer(size_t capacity);
  void FreeBuffer();
  // local_only: lets `peer_device` map this member's buffer and flags.
  Status GrantTo(int peer_device) const;
  // One process driving several GPUs: waits (on the host, bounded by timeout_s) until every
  // same-process peer's host has entered op `e` too. Only then may this rank enqueue waits for
  // them. Why: a peer's op can depend on work that XLA enqueues on *this* GPU after this rank's
  // op (a jit call's input resharding copies device 0's data to the other GPUs from a worker
  // thread; the peer's launch waits for that copy). A stream wait for a peer flag stalls its
  // whole hardware queue, and if XLA's copy shares that queue it never runs: a deadlock. Once
  // every peer's host is inside op e, every copy its op e depends on is already enqueued, so it
  // precedes this rank's waits in every queue.
  Status HostMeet(uint64_t e, const char* op);

  Options o_;
  void* buffer_ = nullptr;
  VmmAlloc buffer_vmm_, flags_vmm_;  // local_only allocations
  // device: kNumFlagSlots * world, then the poison word, this GPU's two progress words and the
  // peers' op ids (world words).
  uint64_t* flags_ = nullptr;
  // != 0 once a watchdog released a timed-out wait: PoisonValue(the rank whose watchdog did it).
  uint64_t* poison_ = nullptr;
  // op_ids_[q]: (epoch << 32) | hash of the op peer q began at that epoch (peers write it, Begin).
  uint64_t* op_ids_ = nullptr;
  uint64_t op_hash_ = 0;  // this member's current op (Begin .. End)
  // Host-mapped: End's check kernel reports an op mismatch here (epoch, peer, its id, ours), or
  // the poison word that failed the op (its value, the epoch); the judge reads it without a CUDA
  // call (LaunchCheckOp). Word kAbortMark (nccl): PoisonValue(rank), stored by the reader before
  // it aborts NCCL, so End's check fails the op even if the poison word's copy has not landed.
  static constexpr int kReportWords = 7;
  static constexpr int kAbortMark = 6;
  uint64_t* report_host_ = nullptr;
  uint64_t* report_dev_ = nullptr;
  // progress_[0]: the epoch of the latest op XLA's stream reached (written in Begin, before the
  // op's first wait); progress_[1]: the latest op whose side streams all finished (End, after the
  // join). progress_[0] > progress_[1]: this GPU is inside an op, where waits may time out.
  uint64_t* progress_ = nullptr;
  std::vector<void*> peer_buffer_;
  std::vector<uint64_t*> peer_flags_;
  std::vector<bool> ipc_buffer_, ipc_flags_;  // which peer pointers came from IPC (to close)
  cudaStream_t comm_[kMaxWorld] = {};
  cudaStream_t compute_[kNumComputeStreams] = {};
  cudaEvent_t start_ = nullptr;
  // Recorded on comm(0) after Begin's handshake (done-reading waits, buffer-free signals). With
  // start_ it lets a timeout say how far this rank's GPU got, not only what its host enqueued.
  cudaEvent_t begun_ = nullptr;
  uint64_t begun_epoch_ = 0;  // with mu_ held
  const char* begun_op_ = "";  // with mu_ held
  cudaEvent_t join_[kMaxWorld + kNumComputeStreams] = {};  // indexed like Use's bits
  cudaEvent_t events_[kNumEvents] = {};
  uint64_t epoch_ = 0;
  std::atomic<uint64_t> entered_{0};  // the latest epoch whose Begin this member's host entered
  std::vector<const Communicator*> local_peer_;  // same-process peers (ConnectLocal), else null
  int sms_ = 0;
  bool destroyed_ = false;

  std::mutex op_mu_;  // op_mutex()
  // error_; buffer_ and capacity as they change; the watchdog's state (comm/watchdog.h)
  mutable std::mutex mu_;
  std::string error_;
  std::shared_ptr<NcclComm> nccl_;
  const char* op_ = "";  // op of the current Begin..End
  Status Join(cudaStream_t xla);  // XLA's stream waits for every side stream the op used
  // Inside an op: the stream waits for start_ on its first use (bit: comm i -> i, compute j ->
  // kMaxWorld + j); a failed wait is reported by End.
  cudaStream_t Use(cudaStream_t s, int bit) {
    if (in_op_ && (used_ & (1u << bit)) == 0) {
      used_ |= 1u << bit;
      const cudaError_t err = cudaStreamWaitEvent(s, start_, 0);
      if (err != cudaSuccess && use_error_ == cudaSuccess) use_error_ = err;
    }
    return s;
  }
  bool in_op_ = false;  // between Begin's start_ and the op's Join
  uint32_t used_ = 0;  // streams used by the current op (Use's bits)
  uint32_t joined_ = 0;  // streams whose join_ events the latest Join recorded
  cudaError_t use_error_ = cudaSuccess;
  std::atomic<uint64_t> host_ops_{0}, host_total_ns_{0}, host_meet_ns_{0};
  std::atomic<int> inject_{kFailNone};
  Watchdog watchdog_{*this};  // last: its destructor runs first, and does nothing
};

// Process-wide table: (set id, device ordinal) -> communicator. FFI handlers look themselves up
// with their attribute `set_id` and Ctx<DeviceOrdinal>.
// RegistryGet shares ownership: an FFI handler that looked its communicator up keeps the object
// alive while a concurrent shutdown destroys it (RunOp then refuses the op: destroyed()).
Status RegistryAdd(std::unique_ptr<Communicator> c);
std::shared_ptr<Communicator> RegistryGet(int set_id, int device);
std::vector<Communicator*> RegistrySet(int set_id);
Status RegistryDestroySet(int set_id);
size_t RegistrySize();

// Describes an op's failure on this communicator: "jax_ub <op> (set S group G rank R/W, device D):
// ..."
std::string Where(const Communicator& c, const char* op);

}  // namespace jax_ub
