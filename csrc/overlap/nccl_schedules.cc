// The overlap schedules over transport "nccl" (ncclSend/ncclRecv on a comm stream; NCCL's kernels
// use a few SMs). Same structure as the copy-engine schedules: chunks in ring order, each chunk's
// GEMM waiting only for its own chunk, fp32 reduction at the end of a reduce-scatter. NCCL matches
// every send with the peer's receive, so there are no flags: a rank's landing buffer is written
// only after it posted the receive, i.e. after its previous op.
#include <vector>

#include "comm/nccl.h"
#include "kernels/reduce.h"
#include "overlap/ag_gemm.h"
#include "overlap/gemm_rs.h"

namespace jax_ub {
namespace {

// One ring step: send `send_bytes` at `send` to `to`, receive as many into `recv` from `from`,
// as one NCCL group (both directions progress together: no deadlock whatever the peers' order).
Status Exchange(Communicator* c, const void* send, int to, void* recv, int from, size_t bytes,
                cudaStream_t s) {
  NcclComm* n = c->nccl();
  JAX_UB_RETURN_IF_ERROR(n->GroupStart());
  Status st = n->Send(send, bytes, to, s);
  if (st.ok()) st = n->Recv(recv, bytes, from, s);
  Status end = n->GroupEnd();  // always close the group
  JAX_UB_RETURN_IF_ERROR(st);
  return end;
}

}  // namespace

Status AgBodyNccl(Communicator* c, const AgGemmArgs& a, const char* op, OpTrace& t) {
  (void)op;
  const int r = c->rank(), world = c->world();
  const size_t es = DTypeSize(a.dtype);
  const size_t chunk = static_cast<size_t>(a.m) * a.k * es;
  char* land = static_cast<char*>(a.xg != nullptr ? a.xg : c->buffer());  // AgCheck: fits
  const RowGemm gemm = RowGemm::Of(a);
  cudaStream_t cs = c->compute(0);
  auto chunk_gemm = [&](int q, const void* src) -> Status {
    if (a.w == nullptr) return Status::Ok();
    const int span = t.Start("gemm", q, ComputeLabel(0), cs);
    JAX_UB_RETURN_IF_ERROR(gemm.Run(c->device(), src, a.m,
                                    static_cast<char*>(a.y) + q * a.m * a.n * gemm.y_size(), cs));
    t.Stop(span, cs);
    return Status::Ok();
  };
  JAX_UB_RETURN_IF_ERROR(chunk_gemm(r, a.x));
  if (a.xg != nullptr) {
    JAX_UB_CUDA_RETURN(
        cudaMemcpyAsync(land + r * chunk, a.x, chunk, cudaMemcpyDeviceToDevice, c->comm(0)));
  }
  cudaStream_t s = c->comm(1);
  for (int i = 1; i < world; ++i) {
    const int to = (r + i) % world, from = (r - i + world) % world;
    const int span = t.Start("copy", from, CommLabel(1), s);
    JAX_UB_RETURN_IF_ERROR(Exchange(c, a.x, to, land + from * chunk, from, chunk, s));
    t.Stop(span, s);
    if (a.w != nullptr) {
      JAX_UB_CUDA_RETURN(cudaEventRecord(c->event(i), s));
      JAX_UB_CUDA_RETURN(cudaStreamWaitEvent(cs, c->event(i), 0));
      JAX_UB_RETURN_IF_ERROR(chunk_gemm(from, land + from * chunk));
    }
  }
  return Status::Ok();
}

Status RsBodyNccl(Communicator* c, const GemmRsArgs& a, const char* op, OpTrace& t) {
  (void)op;
  const int r = c->rank(), world = c->world();
  const size_t es = DTypeSize(a.dtype);
  const int64_t mo = a.M / world;
  const size_t part = static_cast<size_t>(mo) * a.n * DTypeSize(a.out_dtype);  // a partial
  char* mine = static_cast<char*>(c->buffer());  // slot q: q's partial for me (RsCheck: fits)
  const RowGemm gemm = RowGemm::Of(a);
  cudaStream_t cs = c->compute(0);
  cudaStream_t s = c->comm(1);
  auto partial = [&](int dest, void* out) -> Status {
    const int span = t.Start("gemm", dest, ComputeLabel(0), cs);
    JAX_UB_RETURN_IF_ERROR(
        gemm.Run(c->device(), static_cast<const char*>(a.x) + dest * mo * a.k * es, mo, out, cs));
    t.Stop(span, cs);
    return Status::Ok();
  };
  for (int i = 1; i < world; ++i) {
    const int to = (r + i) % world, from = (r - i + world) % world;
    const void* src;
    if (a.w != nullptr) {
      void* stage = static_cast<char*>(a.staging) + (i - 1) * part;
      JAX_UB_RETURN_IF_ERROR(partial(to, stage));
      JAX_UB_CUDA_RETURN(cudaEventRecord(c->event(i), cs));
      JAX_UB_CUDA_RETURN(cudaStreamWaitEvent(s, c->event(i), 0));
      src = stage;
    } else {
      src = static_cast<const char*>(a.x) + to * part;
    }
    const int span = t.Start("copy", to, CommLabel(1), s);
    JAX_UB_RETURN_IF_ERROR(Exchange(c, src, to, mine + from * part, from, part, s));
    t.Stop(span, s);
  }
  cudaStream_t red = c->comm(0);
  std::vector<const void*> inputs(world);
  for (int q = 0; q < world; ++q) inputs[q] = mine + q * part;
  if (a.w != nullptr) {
    JAX_UB_RETURN_IF_ERROR(partial(r, mine + r * part));
    JAX_UB_CUDA_RETURN(cudaEventRecord(c->event(0), cs));
    JAX_UB_CUDA_RETURN(cudaStreamWaitEvent(red, c->event(0), 0));
  } else {
    inputs[r] = static_cast<const char*>(a.x) + r * part;
  }
  JAX_UB_CUDA_RETURN(cudaEventRecord(c->event(world), s));
  JAX_UB_CUDA_RETURN(cudaStreamWaitEvent(red, c->event(world), 0));
  return SumPartials(c, a, inputs.data(), t, red);
}

}  // namespace jax_ub
