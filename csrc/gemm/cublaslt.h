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

// Element types (Python passes them as integers, e.g. gemm_warmup's dtype). The two FP8 types are
// GEMM inputs only (A and B of an FP8 GEMM, and the bytes an all-gather moves); an FP8 GEMM writes
// bfloat16 or float32.
#define JAX_UB_DTYPES(X) \
  X(kF32, "float32", 0)  \
  X(kF16, "float16", 1)  \
  X(kBF16, "bfloat16", 2) X(kE4M3, "float8_e4m3fn", 3) X(kE5M2, "float8_e5m2", 4)
enum class DType : int { JAX_UB_DTYPES(JAX_UB_ENUMERATOR) };
const char* DTypeName(DType t);
size_t DTypeSize(DType t);
inline bool IsFp8(DType t) { return t == DType::kE4M3 || t == DType::kE5M2; }

// The element types of one GEMM: A, B and the result C (= D). Every GEMM but an FP8 one has one
// type for all three. An FP8 GEMM (a and b FP8, not both kE5M2: cuBLASLt has no e5m2 x e5m2 kernel)
// writes kBF16 or kF32, accumulates in fp32 and needs B stored [n, k] (trans_b: both operands
// K-contiguous, the only FP8 layout Hopper's kernels take).
// fast_accum (FP8 only): cuBLASLt's fast accumulation (CUBLASLT_MATMUL_DESC_FAST_ACCUM): the
// tensor cores' reduced-precision accumulator is never promoted to fp32 along k; faster, with an
// error that grows with k. Off: partial sums promoted to fp32 at intervals (full accumulation).
// Part of the types because it names another kernel: its own plan, warm-up and tuning.
struct GemmTypes {
  DType a = DType::kBF16, b = DType::kBF16, out = DType::kBF16;
  bool fast_accum = false;
  static GemmTypes Same(DType t) { return GemmTypes{t, t, t}; }
  bool fp8() const { return IsFp8(a); }
  // "" if cuBLASLt can run this combination, else what is wrong (expected and received).
  std::string Problem() const;
  // The integer gemm_warmup's `dtype` takes for these types: a's DType where all three are one
  // type, else a | (b + 1) << 8 | (out + 1) << 16 | fast_accum << 24 (Python:
  // jax_ub._ffi.gemm_types_code).
  int Code() const;
  static GemmTypes FromCode(int code);
};
// "bfloat16", "float8_e4m3fn x float8_e5m2 -> bfloat16" (", fast accumulation" when set)
std::string Describe(const GemmTypes& t);

// Row-major C[m, n] (+)= op(A) @ op(B); op(A) is [m, k], op(B) is [k, n]. Leading dimensions are
// row strides in elements (lda >= k, or >= m when trans_a; ldc >= n). tf32 only matters for kF32.
struct GemmArgs {
  int64_t m = 0, n = 0, k = 0;
  bool trans_a = false, trans_b = false;
  int64_t lda = 0, ldb = 0, ldc = 0;
  GemmTypes types;
  bool tf32 = false;
  // FP8 only: device pointers to the float32 dequantization scales of A and B (C = a_scale *
  // b_scale * op(A) @ op(B) (+ C)); set on the plan's descriptor at every run.
  const float* a_scale = nullptr;
  const float* b_scale = nullptr;
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
// always name the same cached plan. FP8 types: w is stored [n, k] (see GemmTypes).
inline GemmArgs RowMajorGemm(int64_t m, int64_t n, int64_t k, GemmTypes types, bool tf32,
                             const void* x, const void* w, void* y, void* workspace,
                             size_t workspace_bytes, int sm_count = 0) {
  GemmArgs g;
  g.m = m;
  g.n = n;
  g.k = k;
  g.lda = k;
  g.trans_b = types.fp8();
  g.ldb = types.fp8() ? k : n;
  g.ldc = n;
  g.types = types;
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
