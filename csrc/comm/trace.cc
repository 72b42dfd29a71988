#include "comm/trace.h"

#include <atomic>
#include <map>
#include <mutex>

#include "comm/communicator.h"
#include "common/nvtx.h"

namespace jax_ub {

struct OpTrace::Span {
  const char* name;
  int chunk;
  const char* stream;
  cudaEvent_t start = nullptr, end = nullptr;
};

namespace {

struct PendingOp {
  int device, rank;
  std::string op;
  uint64_t epoch;
  cudaEvent_t t0;
  std::vector<OpTrace::Span>* spans;
};

std::atomic<bool> g_on{false};
std::mutex g_mu;
// Per device: the start event of the first op traced since TraceEnable(true) (op_start_ms's
// origin). Guarded by g_mu; destroyed when tracing is switched on again.
std::map<int, cudaEvent_t>& Origins() {
  static auto* m = new std::map<int, cudaEvent_t>();
  return *m;
}
std::vector<PendingOp>& Pending() {
  static auto* v = new std::vector<PendingOp>();
  return *v;
}

cudaEvent_t NewEvent() {
  cudaEvent_t e = nullptr;
  if (cudaEventCreate(&e) != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return e;
}

}  // namespace

void TraceEnable(bool on) {
  if (on) {
    std::lock_guard<std::mutex> lock(g_mu);
    for (auto& [device, e] : Origins()) {
      cudaSetDevice(device);
      cudaEventSynchronize(e);
      cudaEventDestroy(e);
    }
    Origins().clear();
    cudaGetLastError();
  }
  g_on.store(on);
}
bool TraceOn() { return g_on.load(std::memory_order_relaxed); }

OpTrace::OpTrace(const Communicator& c, const char* op, uint64_t epoch, cudaStream_t xla) {
  nvtx::Push(op, static_cast<int64_t>(epoch));  // popped by the destructor
  nvtx_open_ = 1;
  if (!TraceOn()) return;
  t0_ = NewEvent();
  if (t0_ == nullptr) return;
  on_ = true;
  device_ = c.device();
  rank_ = c.rank();
  op_ = op;
  epoch_ = epoch;
  spans_ = new std::vector<Span>();
  {
    // The origin goes first on the stream, so the first op starts at 0 (not a hair before).
    std::lock_guard<std::mutex> lock(g_mu);
    auto [it, fresh] = Origins().emplace(device_, nullptr);
    if (fresh) {
      it->second = NewEvent();
      if (it->second != nullptr) cudaEventRecord(it->second, xla);
    }
  }
  cudaEventRecord(t0_, xla);
}

OpTrace::~OpTrace() {
  // A step whose Stop was skipped by an error return is closed here, then the op's own range.
  for (; nvtx_open_ > 0; --nvtx_open_) nvtx::Pop();
  if (!on_) return;
  std::lock_guard<std::mutex> lock(g_mu);
  Pending().push_back(PendingOp{device_, rank_, op_, epoch_, t0_, spans_});
}

int OpTrace::Start(const char* name, int chunk, const char* stream_label, cudaStream_t s) {
  nvtx::Push(name, chunk);
  ++nvtx_open_;
  if (!on_) return -1;
  Span sp{name, chunk, stream_label};
  sp.start = NewEvent();
  sp.end = NewEvent();
  if (sp.start == nullptr || sp.end == nullptr) return -1;
  cudaEventRecord(sp.start, s);
  spans_->push_back(sp);
  return static_cast<int>(spans_->size()) - 1;
}

void OpTrace::Stop(int span, cudaStream_t s) {
  if (nvtx_open_ > 1) {  // the op's range stays open until the destructor
    nvtx::Pop();
    --nvtx_open_;
  }
  if (!on_ || span < 0) return;
  cudaEventRecord((*spans_)[span].end, s);
}

std::vector<TraceRecord> TraceCollect() {
  std::vector<PendingOp> ops;
  std::map<int, cudaEvent_t> origins;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    ops.swap(Pending());
    origins = Origins();
  }
  std::vector<TraceRecord> out;
  for (PendingOp& p : ops) {
    cudaSetDevice(p.device);
    float op_start = 0;
    auto origin = origins.find(p.device);
    if (origin == origins.end() || origin->second == nullptr ||
        cudaEventSynchronize(p.t0) != cudaSuccess ||
        cudaEventElapsedTime(&op_start, origin->second, p.t0) != cudaSuccess) {
      op_start = 0;
      cudaGetLastError();
    }
    for (const OpTrace::Span& s : *p.spans) {
      TraceRecord r;
      r.device = p.device;
      r.rank = p.rank;
      r.op = p.op;
      r.epoch = p.epoch;
      r.name = s.name;
      r.chunk = s.chunk;
      r.stream = s.stream;
      r.op_start_ms = op_start;
      if (cudaEventSynchronize(s.end) == cudaSuccess &&
          cudaEventElapsedTime(&r.start_ms, p.t0, s.start) == cudaSuccess &&
          cudaEventElapsedTime(&r.end_ms, p.t0, s.end) == cudaSuccess) {
        out.push_back(r);
      }
      cudaGetLastError();
      cudaEventDestroy(s.start);
      cudaEventDestroy(s.end);
    }
    cudaEventDestroy(p.t0);
    delete p.spans;
  }
  return out;
}

const char* CommLabel(int i) {
  static const char* kNames[kMaxWorld] = {"comm0",  "comm1",  "comm2",  "comm3", "comm4",  "comm5",
                                          "comm6",  "comm7",  "comm8",  "comm9", "comm10", "comm11",
                                          "comm12", "comm13", "comm14", "comm15"};
  return i >= 0 && i < kMaxWorld ? kNames[i] : "comm?";
}

const char* ComputeLabel(int i) {
  static const char* kNames[] = {"compute0", "compute1", "compute2", "compute3"};
  return i >= 0 && i < 4 ? kNames[i] : "compute?";
}

}  // namespace jax_ub
