// The communicator's watchdog: a reader thread that makes every CUDA call and may block in one,
// and a judge thread that makes none (see watchdog.h). Split so that a GPU whose hardware
// queue is stalled (a flag wait that never ends, with the channel's command buffer full behind it)
// cannot silence the timeout: the judge still names the missing peer, and if the release it asks
// for never reaches the GPU it says why and, by default, aborts the process instead of hanging.
#include "comm/watchdog.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <set>
#include <thread>

#include "comm/communicator.h"
#include "comm/nccl.h"
#include "kernels/flags.h"

namespace jax_ub {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

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

// Where the reader is (process-wide: one reader serves every member, so a reader blocked in one
// member's CUDA call starves the others too). The judge reads how long it has been.
std::atomic<int64_t> g_busy_since_ns{0};  // steady-clock ns; 0 while not polling
std::atomic<int> g_busy_device{-1};

class BusyMark {
 public:
  explicit BusyMark(int device) {
    g_busy_device.store(device);
    g_busy_since_ns.store(NowNs());
  }
  ~BusyMark() { g_busy_since_ns.store(0); }
};

// " the watchdog's CUDA calls for device D have been blocked for X s" when the reader has been
// inside one poll for over a second (a poll takes microseconds), else "".
std::string ReaderBlocked() {
  const int64_t since = g_busy_since_ns.load();
  if (since == 0 || NowNs() - since < 1'000'000'000) return "";
  return StrCat() << "the watchdog's CUDA calls for device " << g_busy_device.load()
                  << " have been blocked for " << (NowNs() - since) / 1e9 << " s";
}

// The two threads, process-wide: each serves every started member in turn.
struct Threads {
  std::mutex mu;  // the fields below but the two locks
  std::thread reader, judge;
  // Their stop flag, one per pair: a pair being joined never sees a new pair's flag (a start
  // right after the last member stopped starts a new pair while the old one winds down).
  std::shared_ptr<std::atomic<bool>> stop;
  // Held while polling (reader) or judging (judge); both are taken before a member stops. Two
  // locks: a reader blocked inside a CUDA call must not stop the judge.
  std::mutex poll_mu, judge_mu;
  std::set<Watchdog*> alive;
};

Threads& Th() {
  static auto* t = new Threads();  // never destroyed: no work at process exit
  return *t;
}

void Loop(bool judge, std::shared_ptr<std::atomic<bool>> stop) {
  Threads& t = Th();
  while (!stop->load()) {
    std::vector<Watchdog*> members;
    {
      std::lock_guard<std::mutex> lock(t.mu);
      members.assign(t.alive.begin(), t.alive.end());
    }
    // A member stops (and may then be destroyed) only with this thread's lock held by Stop:
    // guard with it, and skip members stopped since the list was taken.
    {
      std::lock_guard<std::mutex> lock(judge ? t.judge_mu : t.poll_mu);
      for (Watchdog* w : members) {
        if (!t.alive.count(w)) continue;
        if (judge) {
          w->Judge();
        } else {
          w->PollGpu();
        }
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace

// ----------------------------------------------------------------------------- lifecycle

Status Watchdog::Create() {
  const int world = c_.o_.world;
  peer_process_.assign(world, ProcessId{});
  peer_gone_.assign(world, std::string());
  peer_gone_at_.assign(world, Clock::time_point{});
  JAX_UB_CUDA_RETURN(cudaStreamCreateWithFlags(&watch_, cudaStreamNonBlocking));
  JAX_UB_CUDA_RETURN(cudaStreamCreateWithFlags(&release_, cudaStreamNonBlocking));
  JAX_UB_CUDA_RETURN(cudaEventCreateWithFlags(&read_done_, cudaEventDisableTiming));
  JAX_UB_CUDA_RETURN(cudaEventCreateWithFlags(&poisoned_, cudaEventDisableTiming));
  JAX_UB_CUDA_RETURN(cudaEventCreateWithFlags(&released_, cudaEventDisableTiming));
  const size_t n_flags = kNumFlagSlots * world;
  JAX_UB_CUDA_RETURN(
      cudaMallocHost(reinterpret_cast<void**>(&host_flags_), (2 * n_flags + 4) * sizeof(uint64_t)));
  std::memset(host_flags_, 0, (2 * n_flags + 4) * sizeof(uint64_t));
  host_flags_[2 * n_flags] = PoisonValue(c_.o_.rank);
  return Status::Ok();
}

void Watchdog::Release() {
  for (auto& p : nccl_pending_) {
    if (p.done != nullptr) cudaEventDestroy(p.done);
  }
  nccl_pending_.clear();
  for (auto e : nccl_events_) cudaEventDestroy(e);
  nccl_events_.clear();
  if (host_flags_ != nullptr) cudaFreeHost(host_flags_);
  host_flags_ = nullptr;
  if (watch_ != nullptr) cudaStreamDestroy(watch_);
  if (release_ != nullptr) cudaStreamDestroy(release_);
  watch_ = release_ = nullptr;
  for (cudaEvent_t* e : {&read_done_, &poisoned_, &released_}) {
    if (*e != nullptr) cudaEventDestroy(*e);
    *e = nullptr;
  }
}

void Watchdog::Start() {
  Threads& t = Th();
  std::lock_guard<std::mutex> lock(t.mu);
  {
    std::lock_guard<std::mutex> plock(t.poll_mu);
    std::lock_guard<std::mutex> jlock(t.judge_mu);
    t.alive.insert(this);
  }
  if (!t.reader.joinable()) {
    t.stop = std::make_shared<std::atomic<bool>>(false);
    t.reader = std::thread(Loop, false, t.stop);
    t.judge = std::thread(Loop, true, t.stop);
  }
}

void Watchdog::Stop() {
  Threads& t = Th();
  std::thread reader, judge;
  {
    std::lock_guard<std::mutex> lock(t.mu);
    std::lock_guard<std::mutex> plock(t.poll_mu);
    std::lock_guard<std::mutex> jlock(t.judge_mu);
    t.alive.erase(this);
    if (t.alive.empty() && t.reader.joinable()) {
      t.stop->store(true);
      t.stop.reset();
      reader = std::move(t.reader);
      judge = std::move(t.judge);
    }
  }
  if (reader.joinable()) reader.join();
  if (judge.joinable()) judge.join();
}

// ----------------------------------------------------------------------------- waits (op side)

const uint64_t* Watchdog::Watch(int slot, int peer, uint64_t value, const char* op) {
  {
    std::lock_guard<std::mutex> lock(c_.mu_);
    PendingWait& p = pending_[slot][peer];
    if (!p.pending) {
      p.pending = true;
      p.since = Clock::now();
      p.seen = snapshot_[slot * c_.o_.world + peer];
      p.op = op;
    }
    if (value > p.want) p.want = value;
    any_pending_.store(true, std::memory_order_release);
  }
  return c_.flags_ + slot * c_.o_.world + peer;
}

void Watchdog::RecordOp(uint64_t e, const std::string& text) {
  std::lock_guard<std::mutex> lock(c_.mu_);
  op_texts_[e % kOpTexts] = {e, text};
}

void Watchdog::BeginNcclOp(const char* op, uint64_t e) {
  std::lock_guard<std::mutex> lock(c_.mu_);
  if (!nccl_pending_.empty() && nccl_pending_.back().done == nullptr) {
    nccl_pending_.pop_back();  // an op whose enqueueing failed (its error was returned)
  }
  nccl_pending_.push_back({nullptr, Clock::now(), op, e});
  any_pending_.store(true, std::memory_order_release);
}

void Watchdog::SetPeerProcess(int peer, const ProcessId& p) {
  std::lock_guard<std::mutex> lock(c_.mu_);
  peer_process_[peer] = p;
}

Status Watchdog::TrackNccl(cudaStream_t xla, const char* op, uint64_t epoch) {
  // The watchdog follows this op to completion and aborts NCCL if it takes over timeout_s. The
  // CUDA calls run without the mutex: an enqueue may block, and the judge must still take the
  // mutex.
  cudaEvent_t done = nullptr;
  {
    std::lock_guard<std::mutex> lock(c_.mu_);
    if (!nccl_events_.empty()) {
      done = nccl_events_.back();
      nccl_events_.pop_back();
    }
  }
  if (done == nullptr) JAX_UB_CUDA_RETURN(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  cudaError_t err = cudaEventRecord(done, xla);
  std::lock_guard<std::mutex> lock(c_.mu_);
  if (err != cudaSuccess) {
    nccl_events_.push_back(done);
    cudaGetLastError();
    return Status::Error(StrCat() << "cudaEventRecord: " << cudaGetErrorString(err));
  }
  if (!nccl_pending_.empty() && nccl_pending_.back().done == nullptr) {
    nccl_pending_.back().done = done;
  } else {
    nccl_pending_.push_back({done, Clock::now(), op, epoch});
  }
  any_pending_.store(!nccl_aborted_, std::memory_order_release);
  return Status::Ok();
}

// ----------------------------------------------------------------------------- reader

void Watchdog::PollGpu() {
  // Never waits for the GPU: a flag read is an async D2H copy whose completion is checked on the
  // next poll (blocking here could stall the host threads that must enqueue the awaited signal).
  // An enqueue itself can still block (a stalled queue with a full command buffer): the judge
  // reads how long the reader has been inside a poll (BusyMark) and reports that.
  bool idle_read = false;  // no wait pending, but the poison word is due a read (ipc)
  {
    std::lock_guard<std::mutex> lock(c_.mu_);
    if (c_.buffer_ == nullptr) return;
    idle_read =
        !c_.o_.nccl && !gave_up_reported_ && Seconds(Clock::now() - read_issued_) >= kIdleReadS;
    if (!any_pending_.load(std::memory_order_acquire) && release_landed_ == release_requested_ &&
        !reading_ && !idle_read) {
      return;
    }
  }
  std::lock_guard<std::mutex> reader(reader_mu_);  // the reader thread, or Drain
  BusyMark busy(c_.o_.device);
  while (stall_reader_.load()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  if (cudaSetDevice(c_.o_.device) != cudaSuccess) {
    cudaGetLastError();
    return;
  }
  // 1. Releases (the judge timed a wait out).
  uint64_t requested = 0;
  bool abort_nccl = false;
  IssueReleases(&requested, &abort_nccl);
  if (c_.o_.nccl) {
    PollNccl(requested, abort_nccl);
    return;
  }
  CheckReleasesLanded();
  // 2. The flag read: check the one in flight, issue the next.
  ReadProgress(/*with_flags=*/true, idle_read);
  // 3. A snapshot of how far this GPU got, for the timeout message.
  RefreshGpuState();
}

void Watchdog::IssueReleases(uint64_t* requested, bool* abort_nccl) {
  // The poison word first, then the marked flag values, so the op's final check kernel (End)
  // traps and XLA's call fails instead of computing on missing data. Taken in one critical
  // section with the count they add up to.
  const int n = kNumFlagSlots * c_.o_.world;
  std::vector<int> idx;
  bool poison = false;
  bool gone[kMaxWorld] = {};  // peers whose process has exited: no writes into them
  {
    std::lock_guard<std::mutex> lock(c_.mu_);
    for (int q = 0; q < c_.o_.world; ++q) gone[q] = !peer_gone_[q].empty();
    idx.swap(release_idx_);
    poison = release_poison_;
    release_poison_ = false;
    *abort_nccl = nccl_abort_requested_ && !nccl_aborted_;
    *requested = release_requested_;
  }
  if (!poison && idx.empty()) return;
  if (poison && !drop_poison_.load()) {
    cudaMemcpyAsync(c_.poison_, host_flags_ + 2 * n, sizeof(uint64_t), cudaMemcpyHostToDevice,
                    release_);
    // Every peer's word too, before any flag is released (same stream): see communicator.h.
    for (int q = 0; q < c_.o_.world && !c_.o_.nccl; ++q) {
      if (q == c_.o_.rank || c_.peer_flags_[q] == nullptr || gone[q]) continue;
      cudaMemcpyAsync(c_.peer_flags_[q] + (c_.poison_ - c_.flags_), host_flags_ + 2 * n,
                      sizeof(uint64_t), cudaMemcpyHostToDevice, release_);
    }
  }
  for (int i : idx) {
    cudaMemcpyAsync(c_.flags_ + i, host_flags_ + n + i, sizeof(uint64_t), cudaMemcpyHostToDevice,
                    release_);
  }
  if (c_.o_.nccl && poison) {
    cudaEventRecord(poisoned_, release_);
    nccl_poisoning_ = true;
    poisoned_at_ = Clock::now();
  } else {
    cudaEventRecord(released_, release_);
    release_recorded_ = true;
    release_issued_ = *requested;
  }
  cudaGetLastError();
}

void Watchdog::PollNccl(uint64_t requested, bool abort_nccl) {
  PollNcclGpu();
  PollNcclAsync();
  ReadProgress(/*with_flags=*/false, /*idle_read=*/false);
  if (!abort_nccl || !nccl_poisoning_) return;
  // Abort once the poison word is on the GPU (the op's check kernel then fails the XLA call
  // when NCCL's kernels return), or after 2 s regardless.
  const bool landed = cudaEventQuery(poisoned_) != cudaErrorNotReady;
  cudaGetLastError();
  if (!landed && Seconds(Clock::now() - poisoned_at_) < 2.0) return;
  nccl_poisoning_ = false;
  std::string why = c_.error();
  // The abort first sets the host-mapped abort mark (AttachNccl's hook), which End's check
  // reads too: the op fails even where the poison word's copy has not landed.
  if (c_.nccl_ != nullptr) c_.nccl_->Abort(why);
  std::lock_guard<std::mutex> lock(c_.mu_);
  nccl_aborted_ = true;
  release_landed_ = requested;
  any_pending_.store(false, std::memory_order_release);
}

void Watchdog::CheckReleasesLanded() {
  if (!release_recorded_) return;
  const cudaError_t q = cudaEventQuery(released_);
  cudaGetLastError();
  if (q == cudaErrorNotReady) return;
  // Landed (or the context failed: nothing more to wait for).
  release_recorded_ = false;
  std::lock_guard<std::mutex> lock(c_.mu_);
  if (release_issued_ > release_landed_) release_landed_ = release_issued_;
}

void Watchdog::RefreshGpuState() {
  // While a wait is at least half way to its timeout, at most every 200 ms.
  bool want_state = false;
  {
    std::lock_guard<std::mutex> lock(c_.mu_);
    const auto now = Clock::now();
    for (int slot = 0; slot < kNumFlagSlots && !want_state; ++slot) {
      for (int q = 0; q < c_.o_.world; ++q) {
        const PendingWait& p = pending_[slot][q];
        if (p.pending && Seconds(now - p.since) >= 0.5 * c_.o_.timeout_s) want_state = true;
      }
    }
    want_state = want_state && Seconds(now - gpu_state_at_) >= 0.2;
  }
  if (!want_state) return;
  std::string state = GpuState();
  std::lock_guard<std::mutex> lock(c_.mu_);
  gpu_state_ = std::move(state);
  gpu_state_at_ = Clock::now();
}

void Watchdog::ReadProgress(bool with_flags, bool idle_read) {
  // Checks the read in flight; when it has landed, issues the next one (one poll later, so a
  // judge between the two sees the fresh values), while a wait or op is pending, or when an idle
  // read is due. The progress words come with every read; the peers' flags and the poison word
  // where there are any (not with the nccl transport).
  const int n = kNumFlagSlots * c_.o_.world;
  if (reading_) {  // written by this thread only (with the mutex held, for the judge)
    const cudaError_t q = cudaEventQuery(read_done_);
    cudaGetLastError();
    if (q == cudaErrorNotReady) return;
    std::lock_guard<std::mutex> lock(c_.mu_);
    reading_ = false;
    if (q != cudaSuccess) return;
    if (with_flags) {
      std::copy(host_flags_, host_flags_ + n, snapshot_);
      poison_snapshot_ = host_flags_[2 * n + 1];
    }
    std::copy(host_flags_ + 2 * n + 2, host_flags_ + 2 * n + 4, progress_snapshot_);
    last_fresh_ = Clock::now();
    fresh_issued_ = read_issued_;
    return;
  }
  if (!any_pending_.load(std::memory_order_acquire) && !idle_read) return;
  // Stamped before the copy is enqueued: a read that ran before some event never counts as
  // issued after it (CheckPeerProcesses' gate).
  const auto issued = Clock::now();
  // The poison word and the progress words are adjacent: with the flags, the poison word comes
  // in the same copy.
  if ((!with_flags || cudaMemcpyAsync(host_flags_, c_.flags_, n * sizeof(uint64_t),
                                      cudaMemcpyDeviceToHost, watch_) == cudaSuccess) &&
      cudaMemcpyAsync(
          host_flags_ + 2 * n + (with_flags ? 1 : 2), with_flags ? c_.poison_ : c_.progress_,
          (with_flags ? 3 : 2) * sizeof(uint64_t), cudaMemcpyDeviceToHost, watch_) == cudaSuccess &&
      cudaEventRecord(read_done_, watch_) == cudaSuccess) {
    std::lock_guard<std::mutex> lock(c_.mu_);
    reading_ = true;
    read_issued_ = issued;
  }
  cudaGetLastError();
}

void Watchdog::PollNcclGpu() {
  // Pops the ops that completed; the judge times out the oldest one that did not.
  for (;;) {
    cudaEvent_t done = nullptr;
    {
      std::lock_guard<std::mutex> lock(c_.mu_);
      if (nccl_pending_.empty()) break;
      done = nccl_pending_.front().done;
    }
    // No event yet: the op is still being enqueued (maybe blocked in NCCL's connection setup).
    if (done == nullptr) break;
    const cudaError_t q = cudaEventQuery(done);
    cudaGetLastError();
    if (q != cudaSuccess) break;
    std::lock_guard<std::mutex> lock(c_.mu_);
    if (nccl_pending_.empty() || nccl_pending_.front().done != done) break;
    nccl_events_.push_back(done);
    nccl_pending_.pop_front();
  }
}

void Watchdog::PollNcclAsync() {
  // Only while an op is pending and before any abort: a failure between ops shows up at the next
  // op's enqueue (NcclComm::Settle), which names it.
  // (any_pending_ first: nccl_ is attached before the first op, never while one is pending.)
  if (!any_pending_.load(std::memory_order_acquire) || c_.nccl_ == nullptr) return;
  const auto now = Clock::now();
  if (Seconds(now - async_polled_at_) < kAsyncPollS) return;
  async_polled_at_ = now;
  {
    std::lock_guard<std::mutex> lock(c_.mu_);
    if (nccl_pending_.empty() || nccl_aborted_ || nccl_abort_requested_ ||
        !nccl_async_error_.empty()) {
      return;
    }
  }
  std::string error;
  int code = 0;
  if (!c_.nccl_->TryCheckAsync(&error, &code) || error.empty()) return;
  std::lock_guard<std::mutex> lock(c_.mu_);
  nccl_async_error_ = std::move(error);
  nccl_async_code_ = code;
}

std::string Watchdog::GpuState() {
  // Queries only (never blocks on the GPU): a stuck stream may share a hardware queue with
  // anything we'd enqueue here.
  auto state = [](cudaError_t q) {
    cudaGetLastError();
    return q == cudaSuccess ? "yes" : q == cudaErrorNotReady ? "no" : "unknown";
  };
  const char* reached = state(cudaEventQuery(c_.start_));
  const char* begun = state(cudaEventQuery(c_.begun_));
  std::string busy;
  for (int i = 0; i < c_.o_.world; ++i) {
    if (cudaStreamQuery(c_.comm_[i]) == cudaErrorNotReady) busy += StrCat() << " comm" << i;
    cudaGetLastError();
  }
  for (int i = 0; i < kNumComputeStreams; ++i) {
    if (cudaStreamQuery(c_.compute_[i]) == cudaErrorNotReady) busy += StrCat() << " compute" << i;
    cudaGetLastError();
  }
  std::lock_guard<std::mutex> lock(c_.mu_);
  StrCat out;
  out << "its latest op (epoch " << c_.begun_epoch_ << ", " << c_.begun_op_
      << "): XLA's stream had reached it: " << reached
      << "; its handshake (done-reading waits, buffer-free signals) had run: " << begun
      << "; busy side streams:" << (busy.empty() ? std::string(" none") : busy);
  return out;
}

// ----------------------------------------------------------------------------- judge

std::string Watchdog::ProgressRead(Clock::time_point now) const {
  StrCat out;
  out << " [watchdog: this rank's GPU ";
  if (last_fresh_ == Clock::time_point{}) {
    out << "never read";
  } else {
    out << "as read " << Seconds(now - last_fresh_) << " s ago: entered op epoch "
        << progress_snapshot_[0] << ", finished " << progress_snapshot_[1];
  }
  const std::string blocked = ReaderBlocked();
  if (!blocked.empty()) out << "; " << blocked << " (a stalled hardware queue)";
  out << "]";
  return out;
}

std::string Watchdog::FlagReadAge(Clock::time_point now) const {
  StrCat out;
  out << " [watchdog: flags last read from the GPU ";
  if (last_fresh_ == Clock::time_point{}) {
    out << "never";
  } else {
    out << Seconds(now - last_fresh_) << " s ago";
  }
  if (reading_) {
    out << "; a read issued " << Seconds(now - read_issued_) << " s ago has not completed";
  }
  const std::string blocked = ReaderBlocked();
  if (!blocked.empty()) out << "; " << blocked << " (a stalled hardware queue)";
  out << "] [this rank's GPU";
  if (gpu_state_at_ == Clock::time_point{}) {
    out << ": not queried";
  } else {
    out << " " << Seconds(now - gpu_state_at_) << " s ago: " << gpu_state_;
  }
  out << "; as last read: entered op epoch " << progress_snapshot_[0] << ", finished "
      << progress_snapshot_[1] << "; flags:";
  for (int slot = 0; slot < kNumFlagSlots; ++slot) {
    for (int q = 0; q < c_.o_.world; ++q) {
      if (q != c_.o_.rank) {
        out << " " << SlotName(slot) << "[" << q
            << "]=" << FlagValue(slot, snapshot_[slot * c_.o_.world + q]);
      }
    }
  }
  out << "]";
  return out;
}

std::string Watchdog::OpText(uint64_t e) const {
  const auto& [text_epoch, text] = op_texts_[e % kOpTexts];
  return text_epoch == e ? text : std::string("(no longer recorded)");
}

void Watchdog::Announce(const std::string& msg) {
  std::fprintf(stderr, "%s\n", msg.c_str());
  std::fflush(stderr);
  if (c_.error_.empty()) c_.error_ = msg;
}

void Watchdog::JudgeMismatch() {
  if (mismatch_reported_ || c_.report_host_ == nullptr) return;
  const volatile uint64_t* rep = c_.report_host_;
  const uint64_t e = rep[0];
  if (e == 0) return;
  std::atomic_thread_fence(std::memory_order_acquire);
  const uint64_t peer = rep[1], theirs = rep[2], mine = rep[3];
  mismatch_reported_ = true;
  const char* hex = "0123456789abcdef";
  auto id = [&](uint64_t v) {
    std::string out = "0x";
    for (int i = 7; i >= 0; --i) out += hex[(v >> (4 * i)) & 0xf];
    return out;
  };
  std::string msg =
      StrCat() << Where(c_, "op check") << ": rank " << peer << " ran another op at epoch " << e
               << " (its op id " << id(theirs & 0xffffffffu) << ", this rank's "
               << id(mine & 0xffffffffu) << ": " << OpText(e)
               << "). Every rank must run the same sequence of jax_ub ops with the same "
                  "shapes, dtypes and methods (rank-dependent Python control flow, or a "
                  "tuning file that differs between hosts, breaks that); the call was failed "
                  "on the GPU, as its data may be another op's";
  Announce(msg);
}

void Watchdog::JudgePoisoned() {
  if (poison_reported_ || c_.report_host_ == nullptr) return;
  const volatile uint64_t* rep = c_.report_host_;
  const uint64_t word = rep[4];
  if (word == 0) return;
  std::atomic_thread_fence(std::memory_order_acquire);
  const uint64_t e = rep[5];
  poison_reported_ = true;
  // This rank's own timeout, or an earlier failure of its own: reported already.
  if (word == PoisonValue(c_.o_.rank) || !c_.error_.empty()) return;
  Announce(StrCat() << Where(c_, "op check") << ": " << GaveUpMessage(word)
                    << " This rank's op at epoch " << e << " (" << OpText(e)
                    << ") was failed on the GPU at its end check instead of returning data that "
                       "may be wrong.");
}

std::string Watchdog::GaveUpMessage(uint64_t word) const {
  return StrCat() << "rank " << word - 1
                  << " gave up on this TP group: its watchdog timed out waiting for a peer (its "
                     "log names which) and let its op go on, so it may have written into this "
                     "rank's buffer, or its own that this rank's op reads. No op of this group "
                     "can complete now: restart the processes.";
}

void Watchdog::JudgeGaveUp() {
  const uint64_t word = poison_snapshot_;
  if (c_.o_.nccl || gave_up_reported_ || word == 0 || word == PoisonValue(c_.o_.rank)) return;
  // Inside an op, its own waits report first: they time out naming the rank they wait for, or
  // they end and its check fails the op (JudgePoisoned).
  if (any_pending_.load(std::memory_order_acquire)) return;
  gave_up_reported_ = true;
  if (!c_.error_.empty()) return;  // this rank's own failure came first
  Announce(StrCat() << Where(c_, "watchdog") << ": " << GaveUpMessage(word)
                    << " This rank's later ops fail before they begin.");
}

void Watchdog::CheckPeerProcesses() {
  if (c_.o_.nccl || !any_pending_.load(std::memory_order_acquire)) return;
  std::vector<std::pair<int, ProcessId>> awaited;
  {
    std::lock_guard<std::mutex> lock(c_.mu_);  // also Drain's thread may judge
    const auto now = Clock::now();
    if (Seconds(now - peers_checked_at_) < kPeerCheckS) return;
    peers_checked_at_ = now;
    for (int q = 0; q < c_.o_.world; ++q) {
      if (peer_process_[q].pid == 0 || !peer_gone_[q].empty()) continue;
      for (int slot = 0; slot < kNumFlagSlots; ++slot) {
        if (pending_[slot][q].pending) {
          awaited.emplace_back(q, peer_process_[q]);
          break;
        }
      }
    }
  }
  for (const auto& [q, proc] : awaited) {
    std::string gone = ProcessGone(proc);  // /proc reads, outside the mutex
    if (gone.empty()) continue;
    std::lock_guard<std::mutex> lock(c_.mu_);
    peer_gone_[q] = StrCat() << "rank " << q << "'s process (pid " << proc.pid << ") " << gone;
    peer_gone_at_[q] = Clock::now();
  }
}

void Watchdog::Judge() {
  CheckPeerProcesses();
  std::lock_guard<std::mutex> lock(c_.mu_);
  const auto now = Clock::now();
  JudgeMismatch();
  JudgePoisoned();
  JudgeGaveUp();
  JudgeStall(now);
  if (!any_pending_.load(std::memory_order_acquire)) return;
  if (c_.o_.nccl) {
    JudgeNccl(now);
    return;
  }
  const int n = kNumFlagSlots * c_.o_.world;
  // As of a recent read, this GPU had not entered an op, or had finished its latest: whatever
  // waits the host has enqueued, the GPU is not in them yet (XLA's work before the op is still
  // running), so their clocks start later. Without a recent read (a stalled reader) the clocks
  // run from the host's enqueue, so a stall still times out.
  const bool outside_ops = last_fresh_ != Clock::time_point{} &&
                           Seconds(now - last_fresh_) < kProgressFreshS &&
                           progress_snapshot_[0] <= progress_snapshot_[1];
  bool still = false;
  for (int slot = 0; slot < kNumFlagSlots; ++slot) {
    for (int q = 0; q < c_.o_.world; ++q) {
      PendingWait& p = pending_[slot][q];
      if (!p.pending) continue;
      const uint64_t have = snapshot_[slot * c_.o_.world + q];
      if (have >= p.want) {  // flags only grow: any completed read at or past `want` ends it
        p.pending = false;
        continue;
      }
      if (have > p.seen || outside_ops) {  // the peer moved, or this GPU is not waiting yet
        p.seen = have;
        p.since = now;
      }
      const double waited = Seconds(now - p.since);
      // The peer's process has ended, and a flag read issued after that was seen still lacks its
      // signal: it can never come. Fail now instead of at the timeout.
      const bool gone = !peer_gone_[q].empty() && fresh_issued_ > peer_gone_at_[q];
      if (gone) {
        ReportTimeout(StrCat() << Where(c_, p.op) << ": " << peer_gone_[q]
                               << " while this rank waited for its " << SlotName(slot)
                               << " signal for " << FlagValue(slot, p.want) << " (last seen "
                               << FlagValue(slot, have)
                               << "), so the signal can never arrive: the op was failed at once "
                                  "instead of after JAX_UB_TIMEOUT. The peer's own log (or the "
                                  "launcher's) says why it ended. No op of this group can "
                                  "complete now: restart the processes.",
                      p.op, now);
        host_flags_[n + slot * c_.o_.world + q] = p.want + kTimeoutMark;
        release_idx_.push_back(slot * c_.o_.world + q);
        p.pending = false;
        continue;
      }
      if (waited < c_.o_.timeout_s) {
        still = true;
        continue;
      }
      std::string msg =
          StrCat() << Where(c_, p.op) << ": timed out after " << waited
                   << " s without progress waiting for rank " << q << " (" << SlotName(slot)
                   << " signal for " << FlagValue(slot, p.want) << "; last seen "
                   << FlagValue(slot, have)
                   << "). The peer never arrived: is its process alive, and does every "
                      "rank run the same sequence of jax_ub ops? (timeout: JAX_UB_TIMEOUT)"
                   << (peer_gone_[q].empty() ? std::string()
                                             : " [" + peer_gone_[q] + ", as /proc shows]")
                   << FlagReadAge(now);
      ReportTimeout(msg, p.op, now);
      // The reader releases the waiting stream with a marked value, after the poison word.
      host_flags_[n + slot * c_.o_.world + q] = p.want + kTimeoutMark;
      release_idx_.push_back(slot * c_.o_.world + q);
      p.pending = false;
    }
  }
  any_pending_.store(still, std::memory_order_release);
}

void Watchdog::JudgeNccl(Clock::time_point now) {
  if (nccl_pending_.empty() || nccl_aborted_ || nccl_abort_requested_) {
    any_pending_.store(!nccl_pending_.empty() && !nccl_aborted_, std::memory_order_release);
    return;
  }
  PendingOp& p = nccl_pending_.front();
  if (!nccl_async_error_.empty()) {
    // NCCL gave up on its own (a peer's process ended or its connection broke): no need to wait
    // for the timeout. Poison, then abort, as below.
    // ncclRemoteError, ncclSystemError: what NCCL reports when a peer's process or its
    // connection goes away (an internal or CUDA error is more likely this rank's own).
    const bool remote =
        nccl_async_code_ == nccl::kRemoteError || nccl_async_code_ == nccl::kSystemError;
    ReportTimeout(StrCat() << Where(c_, p.op) << ": NCCL failed while this op (epoch " << p.epoch
                           << ") waited in send/recv, after " << Seconds(now - p.since)
                           << " s: " << nccl_async_error_ << ". "
                           << (remote ? "A peer's process has probably exited or lost its "
                                        "connection (its own log says why). "
                                      : "")
                           << "The NCCL communicator is being aborted; no op of this group can "
                              "complete now: restart the processes.",
                  p.op, now);
    nccl_abort_requested_ = true;
    return;
  }
  // As of a recent read, this GPU had not entered the op yet (XLA's work before it is still
  // running): its clock starts later. Without a recent read (a stalled reader) it runs from the
  // host's enqueue, so a stall still times out.
  if (last_fresh_ != Clock::time_point{} && Seconds(now - last_fresh_) < kProgressFreshS &&
      progress_snapshot_[0] < p.epoch) {
    p.since = now;
  }
  const double waited = Seconds(now - p.since);
  if (waited < c_.o_.timeout_s) return;
  std::string peers;
  for (int r = 0; r < c_.o_.world; ++r) {
    if (r != c_.o_.rank) peers += (peers.empty() ? "" : ", ") + std::to_string(r);
  }
  std::string msg =
      StrCat() << Where(c_, p.op) << ": timed out after " << waited
               << " s in NCCL send/recv with ranks " << peers << " (epoch " << p.epoch
               << "); NCCL cannot say which peer is missing. Is every process alive, and "
                  "does every rank run the same sequence of jax_ub ops? The NCCL "
                  "communicator was aborted (timeout: JAX_UB_TIMEOUT)"
               << ProgressRead(now);
  // The sticky error may already hold an op's own failure (Abandon): its NCCL work is still
  // watched.
  ReportTimeout(msg, p.op, now);
  // Poison first (the op's check kernel then fails the XLA call), then abort NCCL: its blocked
  // kernels return and the stream moves on to the check. Both are the reader's.
  nccl_abort_requested_ = true;
}

void Watchdog::ReportTimeout(const std::string& msg, const char* op, Clock::time_point now) {
  Announce(msg);
  // One more release for the reader (the poison word first); the stall clock starts with the
  // oldest request not yet landed.
  if (release_landed_ == release_requested_) release_due_since_ = now;
  ++release_requested_;
  release_op_ = op;
  release_poison_ = true;
}

void Watchdog::JudgeStall(Clock::time_point now) {
  if (release_landed_ >= release_requested_ || stall_reported_) return;
  const double overdue = Seconds(now - release_due_since_);
  if (overdue < kStallGraceS) return;
  stall_reported_ = true;
  const std::string blocked = ReaderBlocked();
  StrCat msg;
  msg << Where(c_, release_op_) << ": the timed-out wait could not be released: the watchdog asked "
      << overdue << " s ago and it has not reached the GPU (";
  if (!blocked.empty()) {
    msg << blocked;
  } else {
    msg << "its copy has not run";
  }
  msg << "). This GPU's command queue is stalled behind a wait that cannot end, so the XLA call "
         "can never return. ";
  if (c_.o_.abort_on_stall) {
    msg << "Aborting the process (JAX_UB_ON_STALL=abort; 'wait' leaves it hanging). First error: "
        << c_.error_;
  } else {
    msg << "Leaving it waiting (JAX_UB_ON_STALL=wait).";
  }
  std::string text = msg;
  std::fprintf(stderr, "%s\n", text.c_str());
  std::fflush(stderr);
  if (c_.o_.abort_on_stall) std::abort();
}

}  // namespace jax_ub
