// AG->GEMM schedule (pull): see schedules.h and the protocol in comm/communicator.h.
#include "overlap/schedules.h"

namespace jax_ub {

size_t AgGemmBufferBytes(DType t, int64_t m, int64_t k) {
  return static_cast<size_t>(m) * static_cast<size_t>(k) * DTypeSize(t);
}

Status AgGemm(Communicator* c, const AgGemmArgs& a, cudaStream_t xla) {
  static constexpr const char* kOp = "all_gather_matmul";
  const int r = c->rank(), world = c->world();
  const size_t es = DTypeSize(a.dtype);
  const size_t chunk = static_cast<size_t>(a.m) * a.k * es;
  if (chunk > c->capacity()) {
    return Status::Error(StrCat() << "registered buffer holds " << c->capacity()
                                  << " bytes, op needs " << chunk
                                  << " (the op was traced before jax_ub.initialize()?)");
  }
  char* xg = static_cast<char*>(a.xg);
  const size_t ws_each = a.workspace_bytes / kNumComputeStreams / 256 * 256;
  auto chunk_gemm = [&](int i, int src_rank, const void* src) -> Status {
    if (a.w == nullptr) return Status::Ok();
    GemmArgs g;
    g.m = a.m;
    g.n = a.n;
    g.k = a.k;
    g.lda = a.k;
    g.ldb = a.n;
    g.ldc = a.n;
    g.dtype = a.dtype;
    g.tf32 = a.tf32;
    g.a = src;
    g.b = a.w;
    g.c = static_cast<char*>(a.y) + static_cast<size_t>(src_rank) * a.m * a.n * es;
    g.workspace = static_cast<char*>(a.workspace) + ws_each * (i % kNumComputeStreams);
    g.workspace_bytes = ws_each;
    return Gemm(c->device(), g, c->compute(i));
  };

  uint64_t e = 0;
  JAX_UB_RETURN_IF_ERROR(c->Begin(kOp, xla, &e));
  // 1. Publish my shard: my buffer is free once every peer acked epoch e-1 (Begin waited).
  cudaStream_t pub = c->comm(0);
  JAX_UB_CUDA_RETURN(cudaMemcpyAsync(c->buffer(), a.x, chunk, cudaMemcpyDeviceToDevice, pub));
  for (int q = 0; q < world; ++q) {
    if (q != r) JAX_UB_RETURN_IF_ERROR(c->Signal(pub, kDataReady, q, e));
  }
  // 2. My own chunk: GEMM straight from x; copy it into xg beside the GEMM.
  JAX_UB_RETURN_IF_ERROR(chunk_gemm(0, r, a.x));
  cudaStream_t local = c->comm(world > 1 ? world - 1 : 0);
  if (world == 1) local = c->compute(1);
  JAX_UB_CUDA_RETURN(
      cudaMemcpyAsync(xg + r * chunk, a.x, chunk, cudaMemcpyDeviceToDevice, local));
  // 3. Pull peers' chunks in ring order (r+1, r+2, ...): one stream (ring: each chunk lands at
  //    full link speed, so the first GEMM starts early) or one stream per peer (all_peer).
  for (int i = 1; i < world; ++i) {
    const int p = (r + i) % world;
    cudaStream_t s = a.algo == AgAlgo::kRing ? c->comm(1) : c->comm(i);
    if (a.algo == AgAlgo::kRing && world == 2) s = c->comm(1);
    JAX_UB_RETURN_IF_ERROR(c->Wait(s, kDataReady, p, e, kOp));
    JAX_UB_CUDA_RETURN(cudaMemcpyAsync(xg + p * chunk, c->peer_buffer(p), chunk,
                                       cudaMemcpyDeviceToDevice, s));
    cudaEvent_t landed = c->event(i);
    JAX_UB_CUDA_RETURN(cudaEventRecord(landed, s));
    JAX_UB_RETURN_IF_ERROR(c->Signal(s, kAck, p, e));
    if (a.w != nullptr) {
      JAX_UB_CUDA_RETURN(cudaStreamWaitEvent(c->compute(i), landed, 0));
      JAX_UB_RETURN_IF_ERROR(chunk_gemm(i, p, xg + p * chunk));
    }
  }
  return c->End(xla);
}

}  // namespace jax_ub
