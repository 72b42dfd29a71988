// cuBLASLt GEMM on row-major operands, with plans (descriptors + chosen algorithm) cached per
// (device, shape, dtype, layout, alignment). Used by the matmul custom call and by every chunk GEMM
// of the overlap schedules.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/enums.h"
#include "common/status.h"

namespace jax_ub {

// Element types (Python passes them as integers, e.g. gemm_warmup's dtype).
#define JAX_UB_DTYPES(X) X(kF32, "float32", 0) X(kF16, "float16", 1) X(kBF16, "bfloat16", 2)
enum class DType : int { JAX_UB_DTYPES(JAX_UB_ENUMERATOR) };
const char* DTypeName(DType t);
size_t DTypeSize(DType t);

// Row-major C[m, n] (+)= op(A) @ op(B); op(A) is [m, k], op(B) is [k, n]. Leading dimensions are
// row strides in elements (lda >= k, or >= m when trans_a; ldc >= n). tf32 only matters for kF32.
struct GemmArgs {
  int64_t m = 0, n = 0, k = 0;
  bool trans_a = false, trans_b = false;
  int64_t lda = 0, ldb = 0, ldc = 0;
  DType dtype = DType::kBF16;
  bool tf32 = false;
  bool accumulate = false;  // beta = 1 (C += ...) instead of beta = 0
  // With accumulate: the addend, if it is not C itself (C = op(A) @ op(B) + c_in, same layout
  // as C; the GEMM->RS chain adds the partial sum received from the previous rank).
  const void* c_in = nullptr;
  int sm_count = 0;  // SMs the GEMM may plan for (0: all); leaves room for a concurrent kernel
  const void* a = nullptr;
  const void* b = nullptr;
  void* c = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// Dense row-major y[m, n] = x[m, k] @ w[k, n]: the chunk GEMMs of the overlap schedules, and the
// configuration GemmWarmup prepares (and tunes) for them at trace time; one builder, so both
// always name the same cached plan.
inline GemmArgs RowMajorGemm(int64_t m, int64_t n, int64_t k, DType dtype, bool tf32, const void* x,
                             const void* w, void* y, void* workspace, size_t workspace_bytes,
                             int sm_count = 0) {
  GemmArgs g;
  g.m = m;
  g.n = n;
  g.k = k;
  g.lda = k;
  g.ldb = n;
  g.ldc = n;
  g.dtype = dtype;
  g.tf32 = tf32;
  g.sm_count = sm_count;
  g.a = x;
  g.b = w;
  g.c = y;
  g.workspace = workspace;
  g.workspace_bytes = workspace_bytes;
  return g;
}

// Enqueues the GEMM on `stream` (device `device` must be current). Thread-safe.
Status Gemm(int device, const GemmArgs& args, cudaStream_t stream);

// Times the heuristic's top `candidates` algorithms for this GEMM configuration (`reps` runs each
// on `stream`, which it synchronizes: call outside execution, e.g. at trace time) and makes the
// fastest the cached plan's algorithm for every later Gemm() of the same configuration. Once per
// configuration; later calls return at once (cached = true).
struct GemmTuneResult {
  bool cached = false;
  int candidates = 0, chosen = 0;  // chosen: rank in the heuristic's order (0 = its first choice)
  float heuristic_ms = 0, best_ms = 0;
};
Status GemmTune(int device, const GemmArgs& args, int candidates, int reps, cudaStream_t stream,
                GemmTuneResult* out);

// Loads cuBLASLt if needed; returns "" when loaded, else the reason it cannot be.
std::string CublasLtLoadError();
// "cuBLASLt <version> from <path>" or the load error.
std::string CublasLtDescription();
// Number of cached plans (for tests and diagnostics).
size_t GemmPlanCacheSize();
// Whether this build's cuBLASLt declarations (gemm/cublaslt_api.h) were checked against the real
// cublasLt.h at compile time (gemm/api_check.cc).
bool CublasLtApiChecked();

}  // namespace jax_ub
