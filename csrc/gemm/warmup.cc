#include "gemm/warmup.h"

#include <cuda_runtime_api.h>

#include <string>
#include <vector>

#include "kernels/fill.h"

namespace jax_ub {

// Runs one GEMM of this configuration on scratch memory and waits: loads the cuBLASLt kernel and
// builds the plan at trace time, so no lazy module load (which may synchronize the context) happens
// inside an overlapped op while peers wait on this device.
Status GemmWarmup(const GemmWarmupArgs& args, GemmTuneResult* tune) {
  const int device = args.device;
  const int64_t m = args.m, n = args.n, k = args.k;
  const size_t workspace_bytes = args.workspace_bytes;
  JAX_UB_CUDA_RETURN(cudaSetDevice(device));
  const GemmTypes types = GemmTypes::FromCode(static_cast<int>(args.dtype));
  const std::string bad = types.Problem();
  if (!bad.empty()) return Status::Error("gemm_warmup: " + bad);
  const bool fp8 = types.fp8();
  if (fp8 && args.trans_a) return Status::Error("gemm_warmup: an FP8 GEMM has a stored [m, k]");
  const size_t es = DTypeSize(types.a), es_b = DTypeSize(types.b), es_c = DTypeSize(types.out);
  // A private non-blocking stream: never ordered behind XLA's or the communicators' streams.
  cudaStream_t s = nullptr;
  JAX_UB_CUDA_RETURN(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  // Stream-ordered scratch (cudaMallocAsync / cudaFreeAsync on that stream): cudaFree may
  // synchronize the whole device, and this runs at trace time while earlier jax_ub ops can
  // still be in flight, spinning on flags of peers whose launches must not be held up.
  int pools = 0;
  cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, device);
  std::vector<void*> scratch;
  auto alloc = [&](void** p, size_t bytes) -> cudaError_t {
    cudaError_t err = pools ? cudaMallocAsync(p, bytes, s) : cudaMalloc(p, bytes);
    if (err == cudaSuccess) scratch.push_back(*p);
    return err;
  };
  Status st = [&]() -> Status {
    void *a = nullptr, *b = nullptr, *c = nullptr, *c_in = nullptr, *ws = nullptr;
    void* scales = nullptr;
    // ld > n: w, y and the addend are column blocks of wider matrices (the chain GEMM->RS's
    // column pieces): the plan key holds the row stride.
    const int64_t row = args.ld > n ? args.ld : n;
    // 16 bytes more than the operands: room to offset a pointer by one element (unaligned_*).
    JAX_UB_CUDA_RETURN(alloc(&a, m * k * es + 16));
    JAX_UB_CUDA_RETURN(alloc(&b, k * row * es_b));
    JAX_UB_CUDA_RETURN(alloc(&c, m * row * es_c + 16));
    if (args.accumulate) JAX_UB_CUDA_RETURN(alloc(&c_in, m * row * es_c + 16));
    if (workspace_bytes) JAX_UB_CUDA_RETURN(alloc(&ws, workspace_bytes));
    GemmArgs g = RowMajorGemm(m, n, k, types, args.tf32, a, b, c, ws, workspace_bytes);
    g.ldc = row;
    // FP8: B stored [n, k] (RowMajorGemm), column blocks of it are row blocks (ldb stays k).
    if (!fp8) g.ldb = row;
    // jax_ub.matmul's backward GEMMs (dy @ w^T, x^T @ dy): A stored [k, m], B stored [n, k].
    g.trans_a = args.trans_a;
    g.trans_b = fp8 || args.trans_b;
    if (args.trans_a) g.lda = m;
    if (g.trans_b) g.ldb = k;
    if (fp8) {
      // Both dequantization scales (any value: the speed does not depend on it), each at a
      // 256-byte boundary like the separate buffers XLA passes.
      JAX_UB_CUDA_RETURN(alloc(&scales, 512));
      JAX_UB_RETURN_IF_ERROR(LaunchFillUniform(DType::kF32, scales, 128, 4u, s));
      g.a_scale = static_cast<const float*>(scales);
      g.b_scale = static_cast<const float*>(scales) + 64;
    }
    // With an addend (the GEMM->RS chain), cuBLASLt may launch another kernel than for
    // beta = 0: that one must be loaded here too, not lazily inside an op whose peers wait.
    g.accumulate = args.accumulate;
    g.c_in = c_in;
    // The bulk reduce-scatter's GEMM leaves `reserve_sms` SMs to the sum: same plan key as then.
    if (args.reserve_sms > 0) {
      int sms = 0;
      JAX_UB_CUDA_RETURN(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
      g.sm_count = sms > args.reserve_sms ? sms - args.reserve_sms : 0;
    }
    // Random values in [-1, 1): a GEMM's speed depends on its data (zeros or a constant
    // pattern run at higher clocks than real activations and rank the candidates otherwise).
    JAX_UB_RETURN_IF_ERROR(LaunchFillUniform(types.a, a, m * k + 16 / es, 1u, s));
    JAX_UB_RETURN_IF_ERROR(LaunchFillUniform(types.b, b, k * row, 2u, s));
    if (c_in) {
      JAX_UB_RETURN_IF_ERROR(LaunchFillUniform(types.out, c_in, m * row + 16 / es_c, 3u, s));
    }
    // Row offsets into operands whose rows are not a multiple of 16 bytes (the op's chunks,
    // pieces and runs) give pointers of the element-size alignment class (cublaslt.cc): every
    // class pair the op can meet gets its plan and kernel here. The result reported is the
    // aligned pair's (the first).
    for (int ua = 0; ua <= (args.unaligned_a ? 1 : 0); ++ua) {
      for (int uc = 0; uc <= (args.unaligned_c ? 1 : 0); ++uc) {
        GemmArgs v = g;
        v.a = static_cast<char*>(a) + (ua ? es : 0);
        v.c = static_cast<char*>(c) + (uc ? es_c : 0);
        if (c_in) v.c_in = static_cast<char*>(c_in) + (uc ? es_c : 0);
        JAX_UB_RETURN_IF_ERROR(Gemm(device, v, s));
        if (args.tune_candidates > 1) {
          GemmTuneResult r;
          JAX_UB_RETURN_IF_ERROR(GemmTune(device, v, args.tune_candidates,
                                          args.tune_reps > 0 ? args.tune_reps : 5, s, &r));
          if (ua == 0 && uc == 0) *tune = r;
        }
      }
    }
    return Status::Ok();
  }();
  for (void* p : scratch) {
    if (pools) {
      cudaFreeAsync(p, s);
    } else {
      cudaFree(p);
    }
  }
  const cudaError_t synced = cudaStreamSynchronize(s);
  cudaStreamDestroy(s);
  if (st.ok() && synced != cudaSuccess) {
    return Status::Error(StrCat() << "gemm_warmup on device " << device << ": "
                                  << cudaGetErrorString(synced));
  }
  return st;
}

}  // namespace jax_ub
