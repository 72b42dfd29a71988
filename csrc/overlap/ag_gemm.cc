// AG->GEMM schedules (pull ring, pull all-peer, push ring): see ag_gemm.h and the protocol in
// comm/communicator.h.
#include "overlap/ag_gemm.h"

#include "comm/copy.h"
#include "kernels/copy.h"

namespace jax_ub {

size_t AgGemmBufferBytes(DType t, int64_t m, int64_t k, int world) {
  return static_cast<size_t>(world) * static_cast<size_t>(m) * static_cast<size_t>(k) *
         DTypeSize(t);
}

Status AgCheck(const Communicator& c, const AgGemmArgs& a) {
  const size_t chunk = static_cast<size_t>(a.m) * a.k * DTypeSize(a.dtype);
  if (c.nccl() != nullptr) {
    // Chunks land in xg, or in the buffer when the gathered input is not wanted.
    const size_t need = a.xg == nullptr ? chunk * c.world() : 0;
    return need > c.capacity() ? CapacityError(c, need) : Status::Ok();
  }
  if (a.xg == nullptr && a.algo != AgAlgo::kPush) {
    return Status::Error("the pull all-gather algorithms land chunks in the gathered output, "
                         "which this call did not request");
  }
  const size_t need = a.algo == AgAlgo::kPush ? chunk * c.world() : chunk;
  return need > c.capacity() ? CapacityError(c, need) : Status::Ok();
}

std::string AgText(const AgGemmArgs& a) {
  return StrCat() << "algorithm " << static_cast<int>(a.algo) << " " << DTypeName(a.dtype) << " x ["
                  << a.m << ", " << a.k << "] n " << a.n << " gathered " << (a.xg != nullptr)
                  << " pieces " << a.pieces << " merge " << a.merge;
}

Status AgBody(Communicator* c, const AgGemmArgs& a, const char* op, uint64_t e, OpTrace& t) {
  if (c->nccl() != nullptr) return AgBodyNccl(c, a, op, t);
  const int r = c->rank(), world = c->world();
  const size_t es = DTypeSize(a.dtype);
  const size_t chunk = static_cast<size_t>(a.m) * a.k * es;
  char* xg = static_cast<char*>(a.xg);
  char* buf = static_cast<char*>(c->buffer());
  const RowGemm gemm = RowGemm::Of(a);
  // Chunk GEMMs run one after another on compute(0), in arrival order: concurrent chunk GEMMs
  // (persistent kernels) only slow each other down.
  // Rows [row0, row0 + rows) of src_rank's chunk (src: the chunk's first row).
  auto chunk_gemm = [&](int src_rank, const void* src, int64_t row0 = 0,
                        int64_t rows = -1) -> Status {
    if (a.w == nullptr) return Status::Ok();
    if (rows < 0) rows = a.m;
    const int si = 0;
    const int span = t.Start("gemm", src_rank, ComputeLabel(si), c->compute(si));
    JAX_UB_RETURN_IF_ERROR(gemm.Run(c->device(), static_cast<const char*>(src) + row0 * a.k * es,
                                    rows,
                                    static_cast<char*>(a.y) + (src_rank * a.m + row0) * a.n * es,
                                    c->compute(si)));
    t.Stop(span, c->compute(si));
    return Status::Ok();
  };
  auto copy = [&](const char* name, int chunk_rank, void* dst, const void* src, int stream,
                  size_t bytes = 0) {
    const int span = t.Start(name, chunk_rank, CommLabel(stream), c->comm(stream));
    cudaError_t err = CopyAsync(dst, src, bytes ? bytes : chunk, c->comm(stream));
    t.Stop(span, c->comm(stream));
    return err;
  };
  // The local shard within this GPU (publish, its rows of xg): SM work, see copy_blocks.
  auto same_device_copy = [&](const char* name, int chunk_rank, void* dst, const void* src,
                              int stream) -> Status {
    if (a.copy_blocks <= 0) {
      JAX_UB_CUDA_RETURN(copy(name, chunk_rank, dst, src, stream));
      return Status::Ok();
    }
    const int span = t.Start(name, chunk_rank, CommLabel(stream), c->comm(stream));
    JAX_UB_RETURN_IF_ERROR(LaunchCopy(dst, src, chunk, a.copy_blocks, c->comm(stream)));
    t.Stop(span, c->comm(stream));
    return Status::Ok();
  };
  // Local copies into xg go on comm(0), after the publish (pull) or Begin's handshake (push).
  const int local_stream = 0;

  if (a.algo == AgAlgo::kPush) {
    // The last ring step (rank r-1's chunk for me, mine for rank r+1) goes in row pieces.
    const int pieces = a.w != nullptr && a.pieces > 1 && a.m % a.pieces == 0 ? a.pieces : 1;
    const int64_t prow = a.m / pieces;
    const size_t pbytes = chunk / pieces;
    static_assert(kMaxChainPieces < kPieceScale, "kPiece values overlap epochs");
    const uint64_t base = e * kPieceScale + 1;
    // 1. My chunk: GEMM straight from x; copy into xg beside it.
    JAX_UB_RETURN_IF_ERROR(chunk_gemm(r, a.x));
    if (xg != nullptr) {
      JAX_UB_RETURN_IF_ERROR(same_device_copy("local_copy", r, xg + r * chunk, a.x, local_stream));
    }
    if (a.after_local) JAX_UB_RETURN_IF_ERROR(a.after_local());
    // 2. Push x into every peer's slot r (ring order r-1, r-2, ...: at each step every GPU
    //    sends to one peer and receives from another). Begin signalled our own buffer free.
    for (int i = 1; i < world; ++i) {
      const int d = (r - i + world) % world;
      char* dst = static_cast<char*>(c->peer_buffer(d)) + r * chunk;
      JAX_UB_RETURN_IF_ERROR(c->Wait(c->comm(1), kReady, d, e, op));
      const bool pieced = i == world - 1 && pieces > 1;
      for (int j = 0; j < (pieced ? pieces : 1); ++j) {
        const size_t off = pieced ? j * pbytes : 0;
        JAX_UB_CUDA_RETURN(copy("copy", d, dst + off, static_cast<const char*>(a.x) + off, 1,
                                pieced ? pbytes : chunk));
        if (pieced) JAX_UB_RETURN_IF_ERROR(c->Signal(c->comm(1), kPiece, d, base + j));
      }
      MemOps done;
      c->Signal(&done, kDataReady, d, e);
      c->Signal(&done, kAck, d, e);
      JAX_UB_RETURN_IF_ERROR(done.Enqueue(c->comm(1)));
    }
    // 3. Peers' chunks as they land in my buffer (r+1 first: it pushes to me at step 1).
    const bool merged = a.merge && a.w != nullptr;
    if (merged) {
      // Two runs of contiguous slots, one GEMM each: r+1..world-1 (they land at steps
      // 1..world-1-r), then 0..r-1.
      const int first[2] = {r + 1, 0}, count[2] = {world - 1 - r, r};
      for (int g = 0; g < 2; ++g) {
        if (count[g] == 0) continue;
        for (int q = first[g]; q < first[g] + count[g]; ++q) {
          JAX_UB_RETURN_IF_ERROR(c->Wait(c->compute(0), kDataReady, q, e, op));
        }
        JAX_UB_RETURN_IF_ERROR(chunk_gemm(first[g], buf + first[g] * chunk, 0, count[g] * a.m));
      }
    }
    for (int i = 1; i < world; ++i) {
      const int q = (r + i) % world;
      if (merged) {
        // its GEMM ran above, with its run of slots
      } else if (i == world - 1 && pieces > 1) {
        for (int j = 0; j < pieces; ++j) {
          JAX_UB_RETURN_IF_ERROR(c->Wait(c->compute(0), kPiece, q, base + j, op));
          JAX_UB_RETURN_IF_ERROR(chunk_gemm(q, buf + q * chunk, j * prow, prow));
        }
      } else {
        if (a.w != nullptr) JAX_UB_RETURN_IF_ERROR(c->Wait(c->compute(0), kDataReady, q, e, op));
        JAX_UB_RETURN_IF_ERROR(chunk_gemm(q, buf + q * chunk));
      }
      if (xg == nullptr) continue;
      JAX_UB_RETURN_IF_ERROR(c->Wait(c->comm(local_stream), kDataReady, q, e, op));
      // Peers' chunks land while the GEMM holds every SM (past its first rows): a copy of a few
      // blocks would then trail the GEMM at a few blocks' speed, so these take the whole GPU.
      JAX_UB_CUDA_RETURN(copy("local_copy", q, xg + q * chunk, buf + q * chunk, local_stream));
    }
    return Status::Ok();
  }

  // Pull: publish my shard (my buffer is free: Begin waited for every peer's ack of e-1).
  JAX_UB_RETURN_IF_ERROR(same_device_copy("publish", r, buf, a.x, 0));
  MemOps published;
  for (int q = 0; q < world; ++q) {
    if (q != r) c->Signal(&published, kDataReady, q, e);
  }
  JAX_UB_RETURN_IF_ERROR(published.Enqueue(c->comm(0)));
  if (a.w != nullptr) {
    // The publish is a same-device copy, which runs on SMs: a local GEMM already resident on
    // every SM would hold it (and every peer's pull) back for a whole chunk GEMM.
    JAX_UB_CUDA_RETURN(cudaEventRecord(c->event(kMaxWorld), c->comm(0)));
    JAX_UB_CUDA_RETURN(cudaStreamWaitEvent(c->compute(0), c->event(kMaxWorld), 0));
  }
  JAX_UB_RETURN_IF_ERROR(chunk_gemm(r, a.x));
  JAX_UB_RETURN_IF_ERROR(same_device_copy("local_copy", r, xg + r * chunk, a.x, local_stream));
  if (a.after_local) JAX_UB_RETURN_IF_ERROR(a.after_local());
  for (int i = 1; i < world; ++i) {
    const int p = (r + i) % world;
    const int si = a.algo == AgAlgo::kRing ? 1 : i;
    cudaStream_t s = c->comm(si);
    JAX_UB_RETURN_IF_ERROR(c->Wait(s, kDataReady, p, e, op));
    JAX_UB_CUDA_RETURN(copy("copy", p, xg + p * chunk, c->peer_buffer(p), si));
    cudaEvent_t landed = c->event(i);
    JAX_UB_CUDA_RETURN(cudaEventRecord(landed, s));
    JAX_UB_RETURN_IF_ERROR(c->Signal(s, kAck, p, e));
    if (a.w != nullptr) {
      JAX_UB_CUDA_RETURN(cudaStreamWaitEvent(c->compute(0), landed, 0));
      JAX_UB_RETURN_IF_ERROR(chunk_gemm(p, xg + p * chunk));
    }
  }
  return Status::Ok();
}

Status AgGemm(Communicator* c, const AgGemmArgs& a, cudaStream_t xla) {
  const char* op = a.w != nullptr ? "all_gather_matmul" : "all_gather";
  return RunOp(c, op, xla, [&] { return AgCheck(*c, a); }, AgText(a),
               [&](uint64_t e, OpTrace& t) { return AgBody(c, a, op, e, t); });
}

}  // namespace jax_ub
