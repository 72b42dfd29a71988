// Optional per-op timeline of the overlap schedules (`python -m jax_ub.bench ag --timeline`):
// CUDA events around every copy, GEMM and reduction of an op, read back after the op finished.
// Off by default; when off, every call here costs one atomic load plus the NVTX range each op and
// each step opens (common/nvtx.h: a no-op call unless an NVTX tool such as Nsight Systems is
// attached, which then shows the same op and chunk structure without the timeline).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

namespace jax_ub {

class Communicator;

void TraceEnable(bool on);
bool TraceOn();

struct TraceRecord {
  int device = 0, rank = 0;
  std::string op, name, stream;
  uint64_t epoch = 0;
  int chunk = -1;
  float start_ms = 0, end_ms = 0;  // relative to the op's start on this device
  // The op's start relative to the first op traced on this device since TraceEnable(true): the
  // gaps between back-to-back ops.
  float op_start_ms = 0;
};

// The spans of one op on one device. Construct after Communicator::Begin (records the op's start
// on XLA's stream); Start/Stop bracket work enqueued on a side stream.
class OpTrace {
 public:
  OpTrace(const Communicator& c, const char* op, uint64_t epoch, cudaStream_t xla);
  ~OpTrace();  // hands the spans to the process-wide list (read by TraceCollect)
  OpTrace(const OpTrace&) = delete;
  OpTrace& operator=(const OpTrace&) = delete;

  int Start(const char* name, int chunk, const char* stream_label, cudaStream_t s);
  void Stop(int span, cudaStream_t s);

  struct Span;

 private:
  bool on_ = false;
  int nvtx_open_ = 0;  // NVTX ranges this op has open (its own and an unfinished step's)
  int device_ = 0, rank_ = 0;
  const char* op_ = "";
  uint64_t epoch_ = 0;
  cudaEvent_t t0_ = nullptr;
  std::vector<Span>* spans_ = nullptr;
};

// Waits for every traced span's end event, converts to milliseconds and clears the list.
std::vector<TraceRecord> TraceCollect();

// Stream labels for the timeline ("comm0".., "compute0"..).
const char* CommLabel(int i);
const char* ComputeLabel(int i);

}  // namespace jax_ub
