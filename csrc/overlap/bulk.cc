// The bulk overlap op: a bare collective under an independent GEMM (see bulk.h).
#include "overlap/bulk.h"

namespace jax_ub {
namespace {

Status BulkBody(Communicator* c, const BulkArgs& a, const char* op, uint64_t e, OpTrace& t) {
  // The GEMM runs on compute(1) (the bodies only use compute(0), and only for GEMMs of their
  // own, which they do not have here). Where it is enqueued matters: a resident cuBLASLt kernel
  // holds its SMs until it ends, so SM work of the collective that others wait for must be on the
  // GPU first. Peer copies and stream waits/writes need no SM; same-device copies (the
  // all-gather's publish of x and x into its own rows) and NCCL's kernels do.
  cudaStream_t gs = c->compute(1);
  auto gemm = [&]() -> Status {
    if (a.gm <= 0) return Status::Ok();
    const int64_t side = a.side_rows < 0 ? 0 : a.side_rows < a.gm ? a.side_rows : a.gm;
    const size_t es = a.gemm.x_size();  // one type: the bulk GEMM is not FP8
    const int span = t.Start("gemm", -1, ComputeLabel(1), gs);
    if (side > 0) JAX_UB_RETURN_IF_ERROR(a.gemm_side.Run(c->device(), a.ga, side, a.gy, gs));
    if (side < a.gm) {
      JAX_UB_RETURN_IF_ERROR(
          a.gemm.Run(c->device(), static_cast<const char*>(a.ga) + side * a.gemm.k * es,
                     a.gm - side, static_cast<char*>(a.gy) + side * a.gemm.n * es, gs));
    }
    t.Stop(span, gs);
    return Status::Ok();
  };
  if (c->nccl() != nullptr) {
    // NCCL's send/recv kernels first, then the GEMM on the SMs they leave.
    JAX_UB_RETURN_IF_ERROR(a.reduce_scatter ? RsBody(c, a.rs, op, e, t)
                                            : AgBody(c, a.ag, op, e, t));
    JAX_UB_RETURN_IF_ERROR(gemm());
  } else if (a.reduce_scatter) {
    // GEMM first: the pushes are copy-engine work and the fp32 sum waits for every partial.
    JAX_UB_RETURN_IF_ERROR(gemm());
    JAX_UB_RETURN_IF_ERROR(RsBody(c, a.rs, op, e, t));
  } else if (a.ag.copy_blocks > 0) {
    // The same-device copies are kernels of copy_blocks blocks and the GEMM's first rows leave
    // SMs for them: both start at once, and the peers pull as soon as the publish is done.
    JAX_UB_RETURN_IF_ERROR(gemm());
    JAX_UB_RETURN_IF_ERROR(AgBody(c, a.ag, op, e, t));
  } else {
    // The GEMM waits for the local copies (tens of microseconds), and is enqueued right after
    // them, before the host enqueues the peers' chunks.
    AgGemmArgs ag = a.ag;
    ag.after_local = [&]() -> Status {
      cudaEvent_t local_done = c->event(kMaxWorld + 1);
      JAX_UB_CUDA_RETURN(cudaEventRecord(local_done, c->comm(0)));
      JAX_UB_CUDA_RETURN(cudaStreamWaitEvent(gs, local_done, 0));
      return gemm();
    };
    JAX_UB_RETURN_IF_ERROR(AgBody(c, ag, op, e, t));
  }
  return Status::Ok();
}

}  // namespace

Status Bulk(Communicator* c, const BulkArgs& a, cudaStream_t xla) {
  const char* op = a.reduce_scatter ? "bulk_reduce_scatter" : "bulk_all_gather";
  // The collective's part only: the independent GEMM may differ between ranks.
  return RunOp(
      c, op, xla, [&] { return a.reduce_scatter ? RsCheck(*c, a.rs) : AgCheck(*c, a.ag); },
      a.reduce_scatter ? RsText(a.rs) : AgText(a.ag),
      [&](uint64_t e, OpTrace& t) { return BulkBody(c, a, op, e, t); });
}

}  // namespace jax_ub
