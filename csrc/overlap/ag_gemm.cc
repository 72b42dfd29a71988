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
    return Status::Error(
        "the pull all-gather algorithms land chunks in the gathered output, "
        "which this call did not request");
  }
  const size_t need = a.algo == AgAlgo::kPush ? chunk * c.world() : chunk;
  return need > c.capacity() ? CapacityError(c, need) : Status::Ok();
}

std::string AgText(const AgGemmArgs& a) {
  return StrCat() << "algorithm " << static_cast<int>(a.algo) << " "
                  << (a.w != nullptr ? Describe(a.types()) : DTypeName(a.dtype)) << " x [" << a.m
                  << ", " << a.k << "] n " << a.n << " gathered " << (a.xg != nullptr) << " pieces "
                  << a.pieces << " merge " << a.merge;
}

namespace {

// One AG op's body: its frame, the chunk operations both schedules use, and the schedules' steps.
class AgSchedule {
 public:
  AgSchedule(Communicator* c, const AgGemmArgs& a, const char* op, uint64_t e, OpTrace& t)
      : c_(c),
        a_(a),
        op_(op),
        e_(e),
        t_(t),
        r_(c->rank()),
        world_(c->world()),
        es_(DTypeSize(a.dtype)),
        out_es_(DTypeSize(a.out_dtype)),
        chunk_(static_cast<size_t>(a.m) * a.k * es_),
        xg_(static_cast<char*>(a.xg)),
        buf_(static_cast<char*>(c->buffer())),
        gemm_(RowGemm::Of(a)) {}

  // kPush: my chunk, then pushes into every peer's buffer, then the peers' chunks as they land.
  Status Push() {
    // The last ring step (rank r-1's chunk for me, mine for rank r+1) goes in row pieces.
    const int pieces = a_.w != nullptr && a_.pieces > 1 && a_.m % a_.pieces == 0 ? a_.pieces : 1;
    static_assert(kMaxChainPieces < kPieceScale, "kPiece values overlap epochs");
    JAX_UB_RETURN_IF_ERROR(PushLocalChunk());
    JAX_UB_RETURN_IF_ERROR(PushToPeers(pieces));
    return GemmPushedChunks(pieces);
  }

  // kRing, kAllPeer: publish my shard, then pull every peer's.
  Status Pull() {
    // Pull: publish my shard (my buffer is free: Begin waited for every peer's ack of e-1).
    JAX_UB_RETURN_IF_ERROR(SameDeviceCopy("publish", r_, buf_, a_.x, 0));
    MemOps published;
    for (int q = 0; q < world_; ++q) {
      if (q != r_) c_->Signal(&published, kDataReady, q, e_);
    }
    JAX_UB_RETURN_IF_ERROR(published.Enqueue(c_->comm(0)));
    if (a_.w != nullptr) {
      // The publish is a same-device copy, which runs on SMs: a local GEMM already resident on
      // every SM would hold it (and every peer's pull) back for a whole chunk GEMM.
      JAX_UB_CUDA_RETURN(cudaEventRecord(c_->event(kMaxWorld), c_->comm(0)));
      JAX_UB_CUDA_RETURN(cudaStreamWaitEvent(c_->compute(0), c_->event(kMaxWorld), 0));
    }
    JAX_UB_RETURN_IF_ERROR(ChunkGemm(r_, a_.x));
    JAX_UB_RETURN_IF_ERROR(SameDeviceCopy("local_copy", r_, xg_ + r_ * chunk_, a_.x, kLocalStream));
    if (a_.after_local) JAX_UB_RETURN_IF_ERROR(a_.after_local());
    for (int i = 1; i < world_; ++i) {
      const int p = (r_ + i) % world_;
      const int si = a_.algo == AgAlgo::kRing ? 1 : i;
      cudaStream_t s = c_->comm(si);
      JAX_UB_RETURN_IF_ERROR(c_->Wait(s, kDataReady, p, e_, op_));
      JAX_UB_CUDA_RETURN(Copy("copy", p, xg_ + p * chunk_, c_->peer_buffer(p), si));
      cudaEvent_t landed = c_->event(i);
      JAX_UB_CUDA_RETURN(cudaEventRecord(landed, s));
      JAX_UB_RETURN_IF_ERROR(c_->Signal(s, kAck, p, e_));
      if (a_.w != nullptr) {
        JAX_UB_CUDA_RETURN(cudaStreamWaitEvent(c_->compute(0), landed, 0));
        JAX_UB_RETURN_IF_ERROR(ChunkGemm(p, xg_ + p * chunk_));
      }
    }
    return Status::Ok();
  }

 private:
  // Local copies into xg go on comm(0), after the publish (pull) or Begin's handshake (push).
  static constexpr int kLocalStream = 0;

  // Push, step 1. My chunk: GEMM straight from x; copy into xg beside it.
  Status PushLocalChunk() {
    JAX_UB_RETURN_IF_ERROR(ChunkGemm(r_, a_.x));
    if (xg_ != nullptr) {
      JAX_UB_RETURN_IF_ERROR(
          SameDeviceCopy("local_copy", r_, xg_ + r_ * chunk_, a_.x, kLocalStream));
    }
    if (a_.after_local) JAX_UB_RETURN_IF_ERROR(a_.after_local());
    return Status::Ok();
  }

  // Push, step 2. Push x into every peer's slot r (ring order r-1, r-2, ...: at each step every
  // GPU sends to one peer and receives from another). Begin signalled our own buffer free.
  Status PushToPeers(int pieces) {
    const size_t pbytes = chunk_ / pieces;
    const uint64_t base = e_ * kPieceScale + 1;
    for (int i = 1; i < world_; ++i) {
      const int d = (r_ - i + world_) % world_;
      char* dst = static_cast<char*>(c_->peer_buffer(d)) + r_ * chunk_;
      JAX_UB_RETURN_IF_ERROR(c_->Wait(c_->comm(1), kReady, d, e_, op_));
      const bool pieced = i == world_ - 1 && pieces > 1;
      for (int j = 0; j < (pieced ? pieces : 1); ++j) {
        const size_t off = pieced ? j * pbytes : 0;
        JAX_UB_CUDA_RETURN(Copy("copy", d, dst + off, static_cast<const char*>(a_.x) + off, 1,
                                pieced ? pbytes : chunk_));
        if (pieced) JAX_UB_RETURN_IF_ERROR(c_->Signal(c_->comm(1), kPiece, d, base + j));
      }
      MemOps done;
      c_->Signal(&done, kDataReady, d, e_);
      c_->Signal(&done, kAck, d, e_);
      JAX_UB_RETURN_IF_ERROR(done.Enqueue(c_->comm(1)));
    }
    return Status::Ok();
  }

  // Push, step 3. Peers' chunks as they land in my buffer (r+1 first: it pushes to me at step 1).
  Status GemmPushedChunks(int pieces) {
    const int64_t prow = a_.m / pieces;
    const uint64_t base = e_ * kPieceScale + 1;
    const bool merged = a_.merge && a_.w != nullptr;
    if (merged) {
      // Two runs of contiguous slots, one GEMM each: r+1..world-1 (they land at steps
      // 1..world-1-r), then 0..r-1.
      const int first[2] = {r_ + 1, 0}, count[2] = {world_ - 1 - r_, r_};
      for (int g = 0; g < 2; ++g) {
        if (count[g] == 0) continue;
        for (int q = first[g]; q < first[g] + count[g]; ++q) {
          JAX_UB_RETURN_IF_ERROR(c_->Wait(c_->compute(0), kDataReady, q, e_, op_));
        }
        JAX_UB_RETURN_IF_ERROR(ChunkGemm(first[g], buf_ + first[g] * chunk_, 0, count[g] * a_.m));
      }
    }
    for (int i = 1; i < world_; ++i) {
      const int q = (r_ + i) % world_;
      if (merged) {
        // its GEMM ran above, with its run of slots
      } else if (i == world_ - 1 && pieces > 1) {
        for (int j = 0; j < pieces; ++j) {
          JAX_UB_RETURN_IF_ERROR(c_->Wait(c_->compute(0), kPiece, q, base + j, op_));
          JAX_UB_RETURN_IF_ERROR(ChunkGemm(q, buf_ + q * chunk_, j * prow, prow));
        }
      } else {
        if (a_.w != nullptr) {
          JAX_UB_RETURN_IF_ERROR(c_->Wait(c_->compute(0), kDataReady, q, e_, op_));
        }
        JAX_UB_RETURN_IF_ERROR(ChunkGemm(q, buf_ + q * chunk_));
      }
      if (xg_ == nullptr) continue;
      JAX_UB_RETURN_IF_ERROR(c_->Wait(c_->comm(kLocalStream), kDataReady, q, e_, op_));
      // Peers' chunks land while the GEMM holds every SM (past its first rows): a copy of a few
      // blocks would then trail the GEMM at a few blocks' speed, so these take the whole GPU.
      JAX_UB_CUDA_RETURN(Copy("local_copy", q, xg_ + q * chunk_, buf_ + q * chunk_, kLocalStream));
    }
    return Status::Ok();
  }

  // Rows [row0, row0 + rows) of src_rank's chunk (src: the chunk's first row) @ w. Chunk GEMMs run
  // one after another on compute(0), in arrival order: concurrent chunk GEMMs (persistent
  // kernels) only slow each other down.
  Status ChunkGemm(int src_rank, const void* src, int64_t row0 = 0, int64_t rows = -1) {
    if (a_.w == nullptr) return Status::Ok();
    if (rows < 0) rows = a_.m;
    const int si = 0;
    const int span = t_.Start("gemm", src_rank, ComputeLabel(si), c_->compute(si));
    JAX_UB_RETURN_IF_ERROR(gemm_.Run(
        c_->device(), static_cast<const char*>(src) + row0 * a_.k * es_, rows,
        static_cast<char*>(a_.y) + (src_rank * a_.m + row0) * a_.n * out_es_, c_->compute(si)));
    t_.Stop(span, c_->compute(si));
    return Status::Ok();
  }

  // A copy of `bytes` (0: a chunk) on comm(stream), traced as `name`.
  cudaError_t Copy(const char* name, int chunk_rank, void* dst, const void* src, int stream,
                   size_t bytes = 0) {
    const int span = t_.Start(name, chunk_rank, CommLabel(stream), c_->comm(stream));
    cudaError_t err = CopyAsync(dst, src, bytes ? bytes : chunk_, c_->comm(stream));
    t_.Stop(span, c_->comm(stream));
    return err;
  }

  // The local shard within this GPU (publish, its rows of xg): SM work, see copy_blocks.
  Status SameDeviceCopy(const char* name, int chunk_rank, void* dst, const void* src, int stream) {
    if (a_.copy_blocks <= 0) {
      JAX_UB_CUDA_RETURN(Copy(name, chunk_rank, dst, src, stream));
      return Status::Ok();
    }
    const int span = t_.Start(name, chunk_rank, CommLabel(stream), c_->comm(stream));
    JAX_UB_RETURN_IF_ERROR(LaunchCopy(dst, src, chunk_, a_.copy_blocks, c_->comm(stream)));
    t_.Stop(span, c_->comm(stream));
    return Status::Ok();
  }

  Communicator* const c_;
  const AgGemmArgs& a_;
  const char* const op_;
  const uint64_t e_;
  OpTrace& t_;
  const int r_, world_;
  const size_t es_, out_es_, chunk_;
  char* const xg_;
  char* const buf_;
  const RowGemm gemm_;
};

}  // namespace

Status AgBody(Communicator* c, const AgGemmArgs& a, const char* op, uint64_t e, OpTrace& t) {
  if (c->nccl() != nullptr) return AgBodyNccl(c, a, op, t);
  AgSchedule s(c, a, op, e, t);
  return a.algo == AgAlgo::kPush ? s.Push() : s.Pull();
}

Status AgGemm(Communicator* c, const AgGemmArgs& a, cudaStream_t xla) {
  const char* op = a.w != nullptr ? "all_gather_matmul" : "all_gather";
  return RunOp(
      c, op, xla, [&] { return AgCheck(*c, a); }, AgText(a),
      [&](uint64_t e, OpTrace& t) { return AgBody(c, a, op, e, t); });
}

}  // namespace jax_ub
