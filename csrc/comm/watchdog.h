// The communicator's watchdog: it times out stream-ordered waits for peers that never arrive,
// releases them, and says why. One per Communicator (its member), served by two process-wide
// threads. The reader makes every CUDA call (async flag reads, event queries, releases, NCCL
// aborts, snapshots of the GPU's state) and may block in one: with a stalled hardware queue whose
// command buffer is full, an enqueue spins. The judge makes none: it decides timeouts from the
// reader's latest completed read, reports them, sets the sticky error and asks the reader to
// release the timed-out wait. A release that does not land within kStallGraceS means the GPU's
// queue is stalled and the XLA call can never return: the judge then says so and, with
// Communicator::Options::abort_on_stall, aborts the process (a hang becomes an error message and
// an exit code).
//
// Lifecycle: Create (with the communicator: streams, events, pinned memory) -> Start (the threads
// watch it) ... Stop (they no longer do; joins them after the last member) -> Release (frees what
// Create made). The destructor does nothing: nothing in it can wait for the GPU or a thread.
//
// Its state is guarded by the communicator's mutex (Communicator::mu_), which also guards the
// sticky error the judge sets.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "comm/process.h"
#include "comm/protocol.h"
#include "common/status.h"

namespace jax_ub {

class Communicator;

class Watchdog {
 public:
  explicit Watchdog(Communicator& c) : c_(c) {}
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;
  ~Watchdog() = default;  // Release frees everything; no work here

  // --- lifecycle ---
  // Its streams, events and pinned memory (on the communicator's device, already current).
  Status Create();
  // Frees what Create made (null handles skipped); no waiting.
  void Release();
  // The process-wide reader and judge threads watch this member from now on (they start with the
  // first member).
  void Start();
  // They no longer do: returns once neither thread is inside a poll of it; the last member's Stop
  // stops and joins them.
  void Stop();

  // --- op side (the communicator's host calls) ---
  // Registers a stream wait for flags[slot][peer] >= value; returns the flag.
  const uint64_t* Watch(int slot, int peer, uint64_t value, const char* op);
  // Begin: op e's description (the mismatch message names it).
  void RecordOp(uint64_t e, const std::string& text);
  // Begin, transport nccl: the watchdog follows op e from here (enqueueing can block too).
  void BeginNcclOp(const char* op, uint64_t e);
  // End (and Abandon), transport nccl: follows the op to completion (an event on XLA's stream);
  // the judge aborts NCCL if it takes over timeout_s.
  Status TrackNccl(cudaStream_t xla, const char* op, uint64_t epoch);
  // ConnectIpc: peer's process as it described itself, where this process can check it (else
  // pid 0).
  void SetPeerProcess(int peer, const ProcessId& p);

  // --- the two threads (and Communicator::Drain) ---
  void PollGpu();  // reader: CUDA calls, never holds the mutex across one
  void Judge();    // judge: no CUDA calls

  // --- test hooks (comm/test_hooks.cc) ---
  // The reader, on its next poll of this member, sits as if blocked inside a CUDA call until the
  // hook is cleared.
  void StallReader(bool on) { stall_reader_.store(on); }
  // The reader never copies the poison word to the GPU, as if its copy had not landed when the
  // op's check runs (the nccl abort's 2 s fallback).
  void DropPoison(bool on) { drop_poison_.store(on); }

  static constexpr double kStallGraceS = 10.0;
  // A flag read at most this old may stop a wait's clock (this GPU outside every op).
  static constexpr double kProgressFreshS = 1.0;

 private:
  using Clock = std::chrono::steady_clock;

  struct PendingWait {
    bool pending = false;
    uint64_t want = 0;
    uint64_t seen = 0;  // the flag's value when `since` was last reset
    // Since the flag last moved (or the wait was registered, or this GPU was last seen outside
    // every jax_ub op): a timeout means no progress for timeout_s while this GPU is inside an op,
    // so neither a host that stays ops ahead of a live peer nor a GPU still busy with XLA's work
    // before the op trips it.
    Clock::time_point since;
    const char* op = "";
  };
  // Transport nccl: ops enqueued but not yet complete, oldest first (event recorded at End).
  struct PendingOp {
    cudaEvent_t done;
    // The host's Begin, or the latest read showing this GPU not yet inside the op (the judge
    // times the op only once its GPU has reached it).
    Clock::time_point since;
    const char* op;
    uint64_t epoch;
  };

  // Reader steps.
  // Releases the judge asked for (the poison word first, then the marked flag values), issued on
  // release_; `requested` receives the release count they add up to, `abort_nccl` whether the
  // judge asked for an NCCL abort.
  void IssueReleases(uint64_t* requested, bool* abort_nccl);
  // Transport nccl: completed ops, NCCL's asynchronous error, the progress read, the abort.
  void PollNccl(uint64_t requested, bool abort_nccl);
  // Transport ipc: whether the releases issued have landed.
  void CheckReleasesLanded();
  // While a wait is at least half way to its timeout, at most every 200 ms: GpuState().
  void RefreshGpuState();
  void PollNcclGpu();  // pops the nccl ops that completed
  void PollNcclAsync();  // NCCL's asynchronous error, while ops pend
  // The progress words (and the flags and poison word) from the GPU, while a wait or op is
  // pending, or `idle_read`.
  void ReadProgress(bool with_flags, bool idle_read);
  std::string GpuState();  // CUDA queries, then the mutex for the rest

  // Judge steps (with the mutex held unless said otherwise).
  // Without the mutex, before Judge takes it: checks, in /proc, the processes of the peers that a
  // pending wait waits for (no CUDA call; at most every kPeerCheckS).
  void CheckPeerProcesses();
  void JudgeMismatch();
  void JudgePoisoned();  // a peer's timeout failed this rank's op
  // A read of the poison word shows that a peer gave up (ipc) while this rank has no wait
  // pending: the sticky error, so its next ops fail before they begin, on the host, with the CUDA
  // context still usable.
  void JudgeGaveUp();
  void JudgeNccl(Clock::time_point now);
  void JudgeStall(Clock::time_point now);
  // Prints and records a timeout and asks the reader for a release (poison word).
  void ReportTimeout(const std::string& msg, const char* op, Clock::time_point now);
  std::string GaveUpMessage(uint64_t word) const;
  std::string FlagReadAge(Clock::time_point now) const;
  std::string ProgressRead(Clock::time_point now) const;  // nccl
  std::string OpText(uint64_t e) const;  // op_texts_'s entry for epoch e
  void Announce(const std::string& msg);  // to stderr, and the sticky error if still empty

  Communicator& c_;

  cudaStream_t watch_ = nullptr;  // flag reads
  cudaStream_t release_ = nullptr;  // releases after a timeout
  cudaEvent_t read_done_ = nullptr;
  cudaEvent_t released_ = nullptr;  // recorded on release_ after a batch of releases
  cudaEvent_t poisoned_ = nullptr;  // recorded after the poison copy on release_ (nccl)
  // pinned: mirror of the flags, release values, PoisonValue(rank), then the mirror of the
  // poison word and the progress words (adjacent on the GPU: one read).
  uint64_t* host_flags_ = nullptr;

  // Reader-only state.
  bool release_recorded_ = false;  // released_ covers requests up to release_issued_
  uint64_t release_issued_ = 0;
  bool nccl_poisoning_ = false;  // poison copy issued, abort on a later poll
  Clock::time_point poisoned_at_{};
  Clock::time_point async_polled_at_{};
  std::mutex reader_mu_;  // PollGpu: the reader thread, or Drain's

  // Shared reader/judge state, with the mutex held. snapshot_ is the latest completed read of the
  // flags (host_flags_ is being written by the copy in flight). When the reader last completed a
  // read and when the read in flight was issued: a timeout names both, so a stalled read (stale
  // flags) is told apart from a peer that never signalled.
  uint64_t snapshot_[kNumFlagSlots * kMaxWorld] = {};
  uint64_t progress_snapshot_[2] = {};  // the progress words as of the same read
  uint64_t poison_snapshot_ = 0;  // the poison word as of the same read
  bool gave_up_reported_ = false;  // JudgeGaveUp has reported a peer's poison
  bool reading_ = false;  // a read is in flight (written by the reader only)
  Clock::time_point last_fresh_{}, read_issued_{};
  // When the read behind the latest snapshot was issued (the judge trusts a "not arrived" only
  // from a read issued after it learnt that the peer's process was gone).
  Clock::time_point fresh_issued_{};
  // The reader reads the flags, poison word included, while a wait is pending, and at least this
  // often otherwise (ipc), so that a rank between ops learns that a peer gave up.
  static constexpr double kIdleReadS = 1.0;
  bool mismatch_reported_ = false;
  bool poison_reported_ = false;
  // The latest ops' descriptions by epoch (for the mismatch message).
  static constexpr int kOpTexts = 8;
  std::pair<uint64_t, std::string> op_texts_[kOpTexts];
  // Transport ipc: each peer process as it described itself in its handle blob, where this process
  // can check it (same pid namespace, visible in /proc); else pid 0.
  std::vector<ProcessId> peer_process_;
  // What became of peer q's process ("" while it runs), and when that was seen.
  std::vector<std::string> peer_gone_;
  std::vector<Clock::time_point> peer_gone_at_;
  Clock::time_point peers_checked_at_{};
  static constexpr double kPeerCheckS = 0.25;
  std::string gpu_state_;  // GpuState() as of gpu_state_at_ (the reader refreshes it)
  Clock::time_point gpu_state_at_{};
  // Releases the judge asked for: host_flags_[n + i] holds each value; release_idx_ the flag
  // indices still to copy; the poison word goes first. Counted, so the judge can tell a release
  // that never landed (release_landed_ < release_requested_ for kStallGraceS) from one that did.
  std::vector<int> release_idx_;
  bool release_poison_ = false;
  uint64_t release_requested_ = 0, release_landed_ = 0;
  Clock::time_point release_due_since_{};  // oldest request not landed
  const char* release_op_ = "";  // the op of the latest timed-out wait
  bool stall_reported_ = false;
  PendingWait pending_[kNumFlagSlots][kMaxWorld];
  std::deque<PendingOp> nccl_pending_;
  std::vector<cudaEvent_t> nccl_events_;  // free completion events
  bool nccl_aborted_ = false;  // the reader aborted NCCL
  bool nccl_abort_requested_ = false;  // the judge timed an op out
  // NCCL's asynchronous error (a peer's process died, its connection broke), polled by the reader
  // while an op is pending, at most every kAsyncPollS; reported by the judge.
  std::string nccl_async_error_;
  int nccl_async_code_ = 0;  // its ncclResult_t
  static constexpr double kAsyncPollS = 0.05;

  std::atomic<bool> any_pending_{false};
  std::atomic<bool> stall_reader_{false};
  std::atomic<bool> drop_poison_{false};
};

}  // namespace jax_ub
