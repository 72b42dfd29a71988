// GEMM->RS schedule (push + fp32 reduce): see schedules.h and comm/communicator.h.
#include <vector>

#include "kernels/reduce.h"
#include "overlap/schedules.h"

namespace jax_ub {

size_t GemmRsBufferBytes(DType t, int64_t M, int64_t n) {
  return static_cast<size_t>(M) * static_cast<size_t>(n) * DTypeSize(t);
}

Status GemmRs(Communicator* c, const GemmRsArgs& a, cudaStream_t xla) {
  static constexpr const char* kOp = "matmul_reduce_scatter";
  const int r = c->rank(), world = c->world();
  const size_t es = DTypeSize(a.dtype);
  const int64_t mo = a.M / world;  // output rows per rank
  const size_t part = static_cast<size_t>(mo) * a.n * es;
  if (part * world > c->capacity()) {
    return Status::Error(StrCat() << "registered buffer holds " << c->capacity()
                                  << " bytes, op needs " << part * world
                                  << " (the op was traced before jax_ub.initialize()?)");
  }
  char* mine = static_cast<char*>(c->buffer());  // slot q holds q's partial for me
  const size_t ws_each = a.workspace_bytes / kNumComputeStreams / 256 * 256;
  auto partial = [&](int i, int dest, void* out) -> Status {
    if (a.w == nullptr) return Status::Ok();
    GemmArgs g;
    g.m = mo;
    g.n = a.n;
    g.k = a.k;
    g.lda = a.k;
    g.ldb = a.n;
    g.ldc = a.n;
    g.dtype = a.dtype;
    g.tf32 = a.tf32;
    g.a = static_cast<const char*>(a.x) + static_cast<size_t>(dest) * mo * a.k * es;
    g.b = a.w;
    g.c = out;
    g.workspace = static_cast<char*>(a.workspace) + ws_each * (i % kNumComputeStreams);
    g.workspace_bytes = ws_each;
    return Gemm(c->device(), g, c->compute(i));
  };

  uint64_t e = 0;
  JAX_UB_RETURN_IF_ERROR(c->Begin(kOp, xla, &e));
  // Peers' partials first, in ring order (r+1, r+2, ...), each pushed as soon as it is computed;
  // my own partial last, straight into my slot.
  for (int i = 1; i < world; ++i) {
    const int d = (r + i) % world;
    const void* src;
    if (a.w != nullptr) {
      void* stage = static_cast<char*>(a.staging) + (i - 1) * part;
      JAX_UB_RETURN_IF_ERROR(partial(i, d, stage));
      JAX_UB_CUDA_RETURN(cudaEventRecord(c->event(i), c->compute(i)));
      src = stage;
    } else {
      src = static_cast<const char*>(a.x) + d * part;
    }
    cudaStream_t s = a.algo == RsAlgo::kRing ? c->comm(1) : c->comm(i);
    if (a.w != nullptr) JAX_UB_CUDA_RETURN(cudaStreamWaitEvent(s, c->event(i), 0));
    JAX_UB_RETURN_IF_ERROR(c->Wait(s, kReady, d, e, kOp));
    JAX_UB_CUDA_RETURN(cudaMemcpyAsync(static_cast<char*>(c->peer_buffer(d)) + r * part, src,
                                       part, cudaMemcpyDeviceToDevice, s));
    JAX_UB_RETURN_IF_ERROR(c->Signal(s, kDataReady, d, e));
    JAX_UB_RETURN_IF_ERROR(c->Signal(s, kAck, d, e));
  }
  // Own partial into my slot (after Begin's buffer-free wait on comm(0)).
  cudaStream_t red = c->comm(0);
  std::vector<const void*> inputs(world);
  if (a.w != nullptr) {
    JAX_UB_CUDA_RETURN(cudaEventRecord(c->event(0), red));  // Begin's waits done
    JAX_UB_CUDA_RETURN(cudaStreamWaitEvent(c->compute(0), c->event(0), 0));
    JAX_UB_RETURN_IF_ERROR(partial(0, r, mine + r * part));
    JAX_UB_CUDA_RETURN(cudaEventRecord(c->event(world), c->compute(0)));
    JAX_UB_CUDA_RETURN(cudaStreamWaitEvent(red, c->event(world), 0));
    for (int q = 0; q < world; ++q) inputs[q] = mine + q * part;
  } else {
    for (int q = 0; q < world; ++q) {
      inputs[q] = q == r ? static_cast<const void*>(static_cast<const char*>(a.x) + r * part)
                         : static_cast<const void*>(mine + q * part);
    }
  }
  for (int q = 0; q < world; ++q) {
    if (q != r) JAX_UB_RETURN_IF_ERROR(c->Wait(red, kDataReady, q, e, kOp));
  }
  // Sum in rank order (identical rounding on every rank), fp32 accumulation.
  JAX_UB_RETURN_IF_ERROR(LaunchSumReduce(a.dtype, a.y, inputs.data(), world,
                                         static_cast<size_t>(mo) * a.n, a.reduce_blocks, red));
  return c->End(xla);
}

}  // namespace jax_ub
