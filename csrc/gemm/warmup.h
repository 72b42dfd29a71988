// GEMM warm-up at trace time: runs one GEMM configuration on scratch memory (optionally timing
// cuBLASLt's candidates), so that its plan is built and its kernel loaded before any overlapped op
// that uses it runs.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/status.h"
#include "gemm/cublaslt.h"

namespace jax_ub {

// One GEMM configuration as jax_ub/gemm.py describes it (see the binding gemm_warmup).
struct GemmWarmupArgs {
  int device = 0;
  int64_t m = 0, n = 0, k = 0;
  // The GEMM's types: a DType (one for A, B and the result), or a GemmTypes::Code() stored as one
  // (the FP8 GEMMs: A and B FP8, B stored [n, k], bfloat16 or float32 results).
  DType dtype = DType::kBF16;
  bool tf32 = false;
  size_t workspace_bytes = 0;
  int tune_candidates = 0;  // > 1: time that many candidates and keep the fastest
  bool accumulate = false;  // with an addend: C = A @ B + C_in
  int reserve_sms = 0;      // > 0: the plan of a GEMM that leaves this many SMs free
  int64_t ld = 0;           // > n: B and C are column blocks with this row stride
  int tune_reps = 5;        // back-to-back runs per timed candidate (<= 0: 5)
  bool unaligned_a = false, unaligned_c = false;  // also the plans at pointers short of 16 bytes
  bool trans_a = false, trans_b = false;          // A stored [k, m], B stored [n, k]
};

// Runs the configuration and waits for it, on a private non-blocking stream with stream-ordered
// scratch. `tune` receives the aligned pair's tuning result (left default without tuning).
Status GemmWarmup(const GemmWarmupArgs& args, GemmTuneResult* tune);

}  // namespace jax_ub
