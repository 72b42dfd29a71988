// NCCL for jax_ub: the library of jax's own nvidia-nccl wheel, dlopen()ed at run time (never
// linked), and a thin communicator wrapper used by bootstrap="nccl" (unique id through the KV
// store, ncclCommInitRank, IPC handle blobs via ncclAllGather) and by the nccl transport
// (ncclSend/ncclRecv on comm streams).
//
// Every failure is a Status naming the NCCL call, this member's rank, world and device, NCCL's
// error string and ncclGetLastError(). No call here waits without a bound: communicator creation
// and the host-blocking all-gather give up after timeout_s with a message saying who is missing.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
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
  // on every rank). Every rank of the group must call it, concurrently: ncclCommInitRank returns
  // only once all `world` ranks have joined. Bounded by timeout_s: the call runs on a helper
  // thread, and when it has not finished after timeout_s this returns an error saying which
  // rank/world/device gave up waiting. NCCL has no way to cancel a blocking init, so the helper
  // thread is then detached and left waiting inside ncclCommInitRank; if the other ranks join
  // later it aborts the communicator it got (nobody owns it), otherwise it stays blocked until the
  // process exits. It holds only its own state, so the caller may exit, retry with a new id, or
  // carry on without NCCL.
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
  // in NCCL, here with this member's identity in the error messages).
  Status GroupStart();
  Status GroupEnd();

  // Host-blocking all-gather of `data` (the same length on every rank): *out receives world *
  // data.size() bytes in rank order. Copies through device memory on a private stream and waits
  // at most timeout_s (<= 0: the timeout_s given to Create), polling ncclCommGetAsyncError. On
  // timeout or an asynchronous error the communicator is aborted (it cannot be used again) and
  // the staging buffers are leaked on purpose (the aborted kernel may still touch them). Meant for
  // bootstrap-time blobs (IPC handles), not for the training step.
  Status AllGatherHost(const std::string& data, std::string* out, double timeout_s = 0);

  // Aborts from a watchdog thread after `why` (ncclCommAbort is NCCL's way to release kernels and
  // host calls blocked on a peer that never comes). The communicator is unusable afterwards;
  // later calls fail with `why`.
  void Abort(const std::string& why) { AbortAfter(why); }

  // ncclCommGetAsyncError: OK while healthy (or while a nonblocking call is still in progress).
  Status CheckAsync();
  // Frees the communicator: ncclCommAbort when an asynchronous error is pending (ncclCommDestroy
  // could wait forever on a broken peer), else ncclCommDestroy. Safe to call twice; a
  // communicator already aborted after a failure is just forgotten. Make sure every operation has
  // completed on every rank first.
  Status Destroy();

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

  // The watchdog thread may abort while the execute thread enqueues (that is how a call blocked
  // on a missing peer is released): comm_ is swapped to null atomically, dead_ is under dead_mu_.
  std::atomic<nccl::Comm> comm_{nullptr};
  int rank_ = 0, world_ = 1, device_ = 0;
  double timeout_s_ = 0;
  mutable std::mutex dead_mu_;
  std::string dead_;
};

}  // namespace jax_ub
