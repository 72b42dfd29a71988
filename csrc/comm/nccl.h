// NCCL for jax_ub: the library of jax's own nvidia-nccl wheel, dlopen()ed at run time (never
// linked), and a thin communicator wrapper used by bootstrap="nccl" (unique id through the KV
// store, ncclCommInitRankConfig, IPC handle blobs via ncclAllGather) and by the nccl transport
// (ncclSend/ncclRecv on comm streams).
//
// Communicators are nonblocking (ncclConfig_t.blocking = 0): NCCL's connection setup runs on its
// own threads and every call returns at once, with ncclInProgress until it is done. This wrapper
// then polls ncclCommGetAsyncError with a deadline, on the calling thread, so no call here waits
// without a bound, and an abort (ncclCommAbort) never runs while another thread is inside an NCCL
// call on the same communicator (NCCL forbids that; with blocking communicators it was the only
// way to release a call stuck on a missing peer).
//
// Every failure is a Status naming the NCCL call, this member's rank, world and device, NCCL's
// error string and ncclGetLastError().
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "comm/nccl_api.h"
#include "common/status.h"

namespace jax_ub {

// Loads NCCL once per process (thread-safe): the paths given by SetLibraryCandidates("nccl", ...)
// (jax_ub/_ext.py finds the wheel's nvidia/nccl/lib/libnccl.so.2), then "libnccl.so.2" on the
// loader's path, and resolves every entry point. Once loaded it stays loaded; a failed load is
// retried by the next call (the candidates may have been set since).
Status NcclLoad();
// ncclGetVersion() of the loaded library (e.g. 23203 for 2.32.3); -1 when NCCL cannot be loaded.
int NcclVersion();
// Path of the loaded library; "" when NCCL cannot be loaded.
std::string NcclLibraryPath();
// NCCL_VERSION_CODE of the nccl.h that nccl_api.h was static_asserted against at build time; 0
// when no nccl.h was found (comm/nccl_api_check.cc).
int NcclApiCheckedVersion();
// A fresh ncclUniqueId (kUniqueIdBytes bytes) into *out. Called by one rank of a group (rank 0),
// which then publishes it to the others; it opens NCCL's bootstrap listening socket in this
// process, so that process must stay alive until every rank has created its communicator.
Status NcclUniqueId(std::string* out);

// One member (rank) of an NCCL communicator, bound to one CUDA device.
//
// Threading: like NCCL itself, a communicator must not be used from two threads at once, and
// Destroy() must not race with any other call on it. Different communicators may be driven from
// different threads concurrently (one thread per local rank is how several ranks of one group
// living in one process are created and used).
class NcclComm {
 public:
  // Creates rank `rank` of `world` on CUDA device `device` from the group's unique id (identical
  // on every rank). Every rank of the group must call it, concurrently: the communicator is ready
  // only once all `world` ranks have joined. Bounded by timeout_s: when it is not ready by then,
  // the half-made communicator is aborted and this returns an error saying which rank/world/device
  // gave up waiting.
  static Status Create(const std::string& unique_id, int rank, int world, int device,
                       double timeout_s, std::unique_ptr<NcclComm>* out);

  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;
  // Makes no NCCL call (a destructor must not be able to hang): a communicator that was not
  // Destroy()ed is leaked.
  ~NcclComm() = default;

  // Stream-ordered operations, in bytes (ncclUint8). They only enqueue; the device stays blocked
  // until the peers take part, so a missing peer shows up later, through CheckAsync() or a
  // bounded wait on `stream`. Every rank must make the same calls in the same order.
  // recv receives world * bytes: rank r's send lands at recv + r * bytes (send may be that slot).
  Status AllGatherBytes(const void* send, void* recv, size_t bytes, cudaStream_t stream);
  Status Send(const void* buf, size_t bytes, int peer, cudaStream_t stream);
  Status Recv(void* buf, size_t bytes, int peer, cudaStream_t stream);
  // ncclGroupStart/ncclGroupEnd around Send/Recv pairs that must progress together (process-wide
  // in NCCL, here with this member's identity in the error messages). From a successful
  // GroupStart to GroupEnd this thread holds the communicator (no abort can land inside the group);
  // GroupEnd always closes NCCL's group, then waits (at most timeout_s) until NCCL has enqueued it.
  Status GroupStart();
  Status GroupEnd();

  // Host-blocking all-gather of `data` (the same length on every rank): *out receives world *
  // data.size() bytes in rank order. Copies through device memory on a private stream and waits
  // at most timeout_s (<= 0: the timeout_s given to Create), polling ncclCommGetAsyncError. On
  // timeout or an asynchronous error the communicator is aborted (it cannot be used again) and
  // the staging buffers are leaked on purpose (the aborted kernel may still touch them). Meant for
  // bootstrap-time blobs (IPC handles), not for the training step.
  Status AllGatherHost(const std::string& data, std::string* out, double timeout_s = 0);

  // Aborts from a watchdog thread after `why` (ncclCommAbort is NCCL's way to release kernels
  // blocked on a peer that never comes). Waits for any NCCL call of another thread on this
  // communicator to return first (they are all nonblocking). The communicator is unusable
  // afterwards; later calls fail with `why`.
  void Abort(const std::string& why) { AbortAfter(why); }

  // ncclCommGetAsyncError: OK while healthy (or while a nonblocking call is still in progress).
  Status CheckAsync();
  // The watchdog's check (ncclCommGetAsyncError is meant to be polled from such a thread): never
  // waits for another thread's NCCL call. false when it could not check now (a call or group is
  // in progress on another thread, or the communicator is gone); else true, with *error the
  // failure NCCL reports (plus NCCL's last warning, which is process-wide: it may come from
  // another communicator) and *code its ncclResult_t, or "" and 0 while healthy.
  bool TryCheckAsync(std::string* error, int* code);
  // Runs inside every abort of this communicator, right before ncclCommAbort, on whichever thread
  // aborts (the watchdog's, or an op's own when NCCL failed under it), with call_mu_ held: must
  // not block or call into this communicator. The owner marks its op failed there, so that an
  // op whose kernels the abort releases cannot pass its final check. Null: none.
  void SetBeforeAbort(std::function<void()> hook);
  // Frees the communicator: ncclCommAbort when an asynchronous error is pending (ncclCommDestroy
  // could wait forever on a broken peer), else ncclCommDestroy. Safe to call twice; a
  // communicator already aborted after a failure is just forgotten. Make sure every operation has
  // completed on every rank first.
  Status Destroy();
  // Forgets the communicator without any NCCL call (its kernels may still be queued: freeing it
  // could hang or fault). Later calls fail with `why`.
  void Leak(const std::string& why);

  int rank() const { return rank_; }
  int world() const { return world_; }
  int device() const { return device_; }
  double timeout_s() const { return timeout_s_; }
  // The raw ncclComm_t for callers of other NCCL entry points; null once destroyed or aborted.
  nccl::Comm raw() const { return comm_.load(); }
  // "" while usable, else why not (destroyed, or aborted after which failure).
  std::string dead_reason() const {
    std::lock_guard<std::mutex> lock(dead_mu_);
    return dead_;
  }

 private:
  NcclComm(nccl::Comm comm, int rank, int world, int device, double timeout_s)
      : comm_(comm), rank_(rank), world_(world), device_(device), timeout_s_(timeout_s) {}
  Status Usable(const char* call) const;
  Status Fail(const char* call, nccl::Result r, const std::string& hint = "") const;
  // Aborts after `why` (a failure already being reported): the communicator becomes unusable.
  void AbortAfter(const std::string& why);
  void AbortLocked(const std::string& why);  // call_mu_ held
  // After a call that returned ncclSuccess or ncclInProgress: polls ncclCommGetAsyncError until
  // NCCL is done with it, at most timeout_s (then, or on an error, aborts). call_mu_ not held.
  Status Settle(const char* call, const std::string& what);
  // AllGatherHost's exchange of `data` (not empty; the same length on every rank).
  Status GatherStaged(const std::string& data, std::string* out, double timeout_s);

  // Held around every NCCL call on comm_ (and from GroupStart to GroupEnd), and by an abort: the
  // watchdog thread's abort never overlaps the execute thread's calls. comm_ is swapped to null
  // under it (atomic: Usable reads it without); dead_ is under dead_mu_ (taken after call_mu_).
  mutable std::mutex call_mu_;
  std::unique_lock<std::mutex> group_;  // call_mu_, from GroupStart to GroupEnd
  std::function<void()> before_abort_;  // under call_mu_
  std::atomic<nccl::Comm> comm_{nullptr};
  int rank_ = 0, world_ = 1, device_ = 0;
  double timeout_s_ = 0;
  mutable std::mutex dead_mu_;
  std::string dead_;
};

}  // namespace jax_ub
