// GEMM->RS schedules (push + fp32 reduce, chain, columns): see gemm_rs.h and
// comm/communicator.h.
#include "overlap/gemm_rs.h"

#include <algorithm>
#include <vector>

#include "comm/copy.h"
#include "kernels/reduce.h"

namespace jax_ub {

size_t GemmRsBufferBytes(DType t, int64_t M, int64_t n) {
  return static_cast<size_t>(M) * static_cast<size_t>(n) * DTypeSize(t);
}

namespace {

// Blocks of an fp32 sum kernel: a.reduce_blocks, or 4 per SM (the whole GPU).
int ReduceBlocks(const Communicator& c, const GemmRsArgs& a) {
  return a.reduce_blocks > 0 ? a.reduce_blocks : 4 * c.sms();
}

// RsAlgo::kChain (see gemm_rs.h). My buffer's slot s (1..world-1) receives rank r-1's partial
// sum for my step s; staging slot s (0..world-2) holds mine before it is pushed to rank r+1.
Status RsChainBody(Communicator* c, const GemmRsArgs& a, const char* op, uint64_t e, OpTrace& t) {
  const int r = c->rank(), world = c->world();
  const int next = (r + 1) % world, prev = (r + world - 1) % world;
  const size_t es = DTypeSize(a.dtype), oes = DTypeSize(a.out_dtype);  // x's, a partial's
  const int64_t mo = a.M / world;
  const size_t part = static_cast<size_t>(mo) * a.n * oes;
  const int pieces =
      (a.splits >= 1 && a.splits <= kMaxChainPieces && mo % a.splits == 0) ? a.splits : 1;
  // Piece p of a step's [mo, n] block: rows [p * prow, +prow) of every column, or (cols) every row
  // of columns [p * pcol, +pcol); `off` is its first element's byte offset in the block.
  const int64_t pcol = a.n / pieces;
  // Column pieces: 16-byte blocks of the output, and for FP8 a multiple of 16 columns (its
  // kernels).
  const bool cols = pieces > 1 && a.split_cols && a.n % pieces == 0 && (pcol * oes) % 16 == 0 &&
                    (!IsFp8(a.dtype) || pcol % 16 == 0);
  const int64_t prow = cols ? mo : mo / pieces;
  auto off = [&](int p) -> size_t {
    return cols ? static_cast<size_t>(p) * pcol * oes : static_cast<size_t>(p) * prow * a.n * oes;
  };
  static_assert((kMaxWorld - 1) * kMaxChainPieces < kPieceScale, "kPiece values overlap epochs");
  char* mine = static_cast<char*>(c->buffer());
  char* theirs = static_cast<char*>(c->peer_buffer(next));
  char* stage = static_cast<char*>(a.staging);
  RowGemm gemm = RowGemm::Of(a);
  if (cols) {
    gemm.n = pcol;
    gemm.ld = a.n;
  }
  cudaStream_t cs = c->compute(0), s = c->comm(1);
  cudaEvent_t ready = c->event(2 * kMaxWorld);  // re-recorded per piece once s waits on it
  const uint64_t base = e * kPieceScale + 1;
  for (int step = 0; step < world; ++step) {
    const int chunk = (r - step - 1 + 2 * world) % world;
    const bool last = step == world - 1;
    for (int p = 0; p < pieces; ++p) {
      const void* addend = nullptr;
      if (step > 0) {
        JAX_UB_RETURN_IF_ERROR(c->Wait(cs, kPiece, prev, base + (step - 1) * pieces + p, op));
        addend = mine + step * part + off(p);
      }
      void* out = last ? static_cast<char*>(a.y) + off(p) : stage + step * part + off(p);
      RowGemm g = gemm;
      if (cols) g.w = gemm.WFrom(p * pcol);
      const int span = t.Start("gemm", chunk, ComputeLabel(0), cs);
      JAX_UB_RETURN_IF_ERROR(
          g.Run(c->device(),
                static_cast<const char*>(a.x) + (chunk * mo + (cols ? 0 : p * prow)) * a.k * es,
                prow, out, cs, addend));
      t.Stop(span, cs);
      if (last) continue;
      JAX_UB_CUDA_RETURN(cudaEventRecord(ready, cs));
      JAX_UB_CUDA_RETURN(cudaStreamWaitEvent(s, ready, 0));
      if (step == 0 && p == 0) JAX_UB_RETURN_IF_ERROR(c->Wait(s, kReady, next, e, op));
      const int copy = t.Start("copy", chunk, CommLabel(1), s);
      JAX_UB_CUDA_RETURN(CopyBlockToPeerAsync(theirs + (step + 1) * part + off(p), out,
                                              gemm.n * oes, prow, a.n * oes, s));
      t.Stop(copy, s);
      JAX_UB_RETURN_IF_ERROR(c->Signal(s, kPiece, next, base + step * pieces + p));
    }
  }
  // Done touching rank r+1's buffer. Every op's Begin waits for every peer's kAck, so all get one.
  MemOps acks;
  for (int q = 0; q < world; ++q) {
    if (q != r) c->Signal(&acks, kAck, q, e);
  }
  JAX_UB_RETURN_IF_ERROR(acks.Enqueue(s));
  return Status::Ok();
}

// RsAlgo::kColumns (see gemm_rs.h). Staging holds the whole [M, n] GEMM output (destination d's
// rows at d * mo); my buffer's slot q receives q's rows for me, block by block.
Status RsColumnsBody(Communicator* c, const GemmRsArgs& a, const char* op, uint64_t e, OpTrace& t) {
  const int r = c->rank(), world = c->world();
  const size_t oes = DTypeSize(a.out_dtype);  // the GEMM output's element
  const int64_t mo = a.M / world;
  const size_t part = static_cast<size_t>(mo) * a.n * oes;
  const bool even = a.splits >= 1 && a.splits <= kMaxColumnPieces && a.n % a.splits == 0 &&
                    (a.n / a.splits * oes) % 16 == 0 &&
                    (!IsFp8(a.dtype) || (a.n / a.splits) % 16 == 0);  // FP8: 16-column blocks
  const int pieces = even ? a.splits : 1;
  const int64_t pcol = a.n / pieces;
  static_assert(kMaxColumnPieces < kPieceScale, "kPiece values overlap epochs");
  char* mine = static_cast<char*>(c->buffer());
  char* stage = static_cast<char*>(a.staging);
  RowGemm gemm = RowGemm::Of(a);
  gemm.n = pcol;
  gemm.ld = a.n;
  cudaStream_t cs = c->compute(0), red = c->comm(0);
  const uint64_t base = e * kPieceScale + 1;
  std::vector<const void*> inputs(world);
  for (int p = 0; p < pieces; ++p) {
    const size_t col = static_cast<size_t>(p) * pcol * oes;  // block p's byte offset in a row
    RowGemm g = gemm;
    g.w = gemm.WFrom(p * pcol);
    const int span = t.Start("gemm", -1, ComputeLabel(0), cs);
    JAX_UB_RETURN_IF_ERROR(g.Run(c->device(), a.x, a.M, stage + col, cs));
    t.Stop(span, cs);
    cudaEvent_t ready = c->event(2 * kMaxWorld + p);
    JAX_UB_CUDA_RETURN(cudaEventRecord(ready, cs));
    for (int i = 1; i < world; ++i) {
      const int d = (r + i) % world;
      cudaStream_t s = c->comm(i);
      JAX_UB_CUDA_RETURN(cudaStreamWaitEvent(s, ready, 0));
      if (p == 0) JAX_UB_RETURN_IF_ERROR(c->Wait(s, kReady, d, e, op));
      const int copy = t.Start("copy", d, CommLabel(i), s);
      JAX_UB_CUDA_RETURN(
          CopyBlockToPeerAsync(static_cast<char*>(c->peer_buffer(d)) + r * part + col,
                               stage + d * part + col, pcol * oes, mo, a.n * oes, s));
      t.Stop(copy, s);
      MemOps landed;
      c->Signal(&landed, kPiece, d, base + p);
      if (p == pieces - 1) c->Signal(&landed, kAck, d, e);
      JAX_UB_RETURN_IF_ERROR(landed.Enqueue(s));
    }
    // Block p of my output: my rows of it, and every peer's once it has landed.
    JAX_UB_CUDA_RETURN(cudaStreamWaitEvent(red, ready, 0));
    for (int q = 0; q < world; ++q) {
      if (q != r) JAX_UB_RETURN_IF_ERROR(c->Wait(red, kPiece, q, base + p, op));
      inputs[q] = (q == r ? stage : mine) + q * part + col;
    }
    const int sum = t.Start("reduce", -1, CommLabel(0), red);
    JAX_UB_RETURN_IF_ERROR(LaunchSumReduceBlock(a.out_dtype, static_cast<char*>(a.y) + col,
                                                inputs.data(), world, mo, pcol, a.n,
                                                ReduceBlocks(*c, a), red));
    t.Stop(sum, red);
  }
  return Status::Ok();
}

// A bare reduce-scatter (w == nullptr) in `a.splits` row pieces (see gemm_rs.h): each piece of
// every destination's rows is pushed (piece-major: every peer gets piece 0 first), and each piece
// is summed as soon as every peer's has landed, so only the last piece's sum follows the last push.
Status RsPiecesBody(Communicator* c, const GemmRsArgs& a, const char* op, uint64_t e, OpTrace& t) {
  const int r = c->rank(), world = c->world();
  const size_t es = DTypeSize(a.dtype);
  const int64_t mo = a.M / world;
  const size_t row = static_cast<size_t>(a.n) * es;
  const size_t part = static_cast<size_t>(mo) * row;
  const int pieces = static_cast<int>(std::min<int64_t>(a.splits, mo));
  auto first = [&](int j) { return static_cast<size_t>(mo * j / pieces); };  // piece j's first row
  static_assert(kMaxSumPieces < kPieceScale, "kPiece values overlap epochs");
  const uint64_t base = e * kPieceScale + 1;
  const char* x = static_cast<const char*>(a.x);
  char* mine = static_cast<char*>(c->buffer());
  for (int j = 0; j < pieces; ++j) {
    const size_t off = first(j) * row, bytes = (first(j + 1) - first(j)) * row;
    for (int i = 1; i < world; ++i) {
      const int d = (r + i) % world;
      const int si = a.algo == RsAlgo::kPipeline ? i : 1;
      cudaStream_t s = c->comm(si);
      if (j == 0) JAX_UB_RETURN_IF_ERROR(c->Wait(s, kReady, d, e, op));
      const int span = t.Start("copy", d, CommLabel(si), s);
      JAX_UB_CUDA_RETURN(CopyAsync(static_cast<char*>(c->peer_buffer(d)) + r * part + off,
                                   x + d * part + off, bytes, s));
      t.Stop(span, s);
      MemOps landed;
      c->Signal(&landed, kPiece, d, base + j);
      if (j == pieces - 1) c->Signal(&landed, kAck, d, e);
      JAX_UB_RETURN_IF_ERROR(landed.Enqueue(s));
    }
  }
  // Enqueued after every push, so a flag wait here never sits ahead of a push in a shared queue.
  cudaStream_t red = c->comm(0);
  std::vector<const void*> inputs(world);
  for (int j = 0; j < pieces; ++j) {
    const size_t off = first(j) * row;
    for (int q = 0; q < world; ++q) {
      if (q != r) JAX_UB_RETURN_IF_ERROR(c->Wait(red, kPiece, q, base + j, op));
      inputs[q] = (q == r ? x : mine) + q * part + off;
    }
    const int span = t.Start("reduce", -1, CommLabel(0), red);
    JAX_UB_RETURN_IF_ERROR(LaunchSumReduce(a.dtype, static_cast<char*>(a.y) + off, inputs.data(),
                                           world, (first(j + 1) - first(j)) * a.n,
                                           ReduceBlocks(*c, a), red));
    t.Stop(span, red);
  }
  return Status::Ok();
}

}  // namespace

Status RsBody(Communicator* c, const GemmRsArgs& a, const char* op, uint64_t e, OpTrace& t) {
  if (c->nccl() != nullptr) return RsBodyNccl(c, a, op, t);
  const int r = c->rank(), world = c->world();
  const size_t es = DTypeSize(a.dtype);
  const int64_t mo = a.M / world;  // output rows per rank
  const size_t part = static_cast<size_t>(mo) * a.n * DTypeSize(a.out_dtype);  // a partial
  if (a.algo == RsAlgo::kChain && a.w != nullptr && world > 1) return RsChainBody(c, a, op, e, t);
  if (a.algo == RsAlgo::kColumns && a.w != nullptr && world > 1) {
    return RsColumnsBody(c, a, op, e, t);
  }
  if (a.w == nullptr && a.splits > 1 && mo > 1 && world > 1) return RsPiecesBody(c, a, op, e, t);
  char* mine = static_cast<char*>(c->buffer());  // slot q holds q's partial for me
  const RowGemm gemm = RowGemm::Of(a);
  // Partials run one after another on compute(0), in push order, so the first is ready after a
  // world-th of the GEMM time and its push overlaps the next partial.
  cudaStream_t cs = c->compute(0);
  auto partial_rows = [&](int dest, int64_t row0, int64_t rows, void* out) -> Status {
    const int span = t.Start("gemm", dest, ComputeLabel(0), cs);
    JAX_UB_RETURN_IF_ERROR(gemm.Run(
        c->device(), static_cast<const char*>(a.x) + (dest * mo + row0) * a.k * es, rows, out, cs));
    t.Stop(span, cs);
    return Status::Ok();
  };
  auto partial = [&](int dest, void* out) { return partial_rows(dest, 0, mo, out); };
  const int splits = (a.w != nullptr && a.splits == 2 && mo % 2 == 0) ? 2 : 1;
  const int64_t piece_rows = mo / splits;
  const size_t piece = part / splits;

  // Peers' partials first, in ring order (r+1, r+2, ...), each pushed as soon as it is computed.
  for (int i = 1; i < world; ++i) {
    const int d = (r + i) % world;
    const int si = a.algo == RsAlgo::kRing ? 1 : i;
    cudaStream_t s = c->comm(si);
    char* dst = static_cast<char*>(c->peer_buffer(d)) + r * part;
    if (a.w != nullptr) {
      // Piece by piece: GEMM rows into the stage, then push them (the next piece's GEMM runs
      // under that push). Piece events live above the per-step ones.
      char* stage = static_cast<char*>(a.staging) + (i - 1) * part;
      for (int j = 0; j < splits; ++j) {
        JAX_UB_RETURN_IF_ERROR(partial_rows(d, j * piece_rows, piece_rows, stage + j * piece));
        cudaEvent_t ready = c->event(2 * kMaxWorld + (i - 1) * splits + j);
        JAX_UB_CUDA_RETURN(cudaEventRecord(ready, cs));
        JAX_UB_CUDA_RETURN(cudaStreamWaitEvent(s, ready, 0));
        if (j == 0) JAX_UB_RETURN_IF_ERROR(c->Wait(s, kReady, d, e, op));
        const int span = t.Start("copy", d, CommLabel(si), s);
        JAX_UB_CUDA_RETURN(CopyAsync(dst + j * piece, stage + j * piece, piece, s));
        t.Stop(span, s);
      }
    } else {
      JAX_UB_RETURN_IF_ERROR(c->Wait(s, kReady, d, e, op));
      const int span = t.Start("copy", d, CommLabel(si), s);
      JAX_UB_CUDA_RETURN(CopyAsync(dst, static_cast<const char*>(a.x) + d * part, part, s));
      t.Stop(span, s);
    }
    MemOps done;
    c->Signal(&done, kDataReady, d, e);
    c->Signal(&done, kAck, d, e);
    JAX_UB_RETURN_IF_ERROR(done.Enqueue(s));
  }
  // Own partial last, into my slot (after Begin's buffer-free wait on comm(0)).
  cudaStream_t red = c->comm(0);
  std::vector<const void*> inputs(world);
  if (a.w != nullptr) {
    JAX_UB_CUDA_RETURN(cudaEventRecord(c->event(0), red));  // Begin's waits done
    JAX_UB_CUDA_RETURN(cudaStreamWaitEvent(cs, c->event(0), 0));
    JAX_UB_RETURN_IF_ERROR(partial(r, mine + r * part));
    JAX_UB_CUDA_RETURN(cudaEventRecord(c->event(world), cs));
    JAX_UB_CUDA_RETURN(cudaStreamWaitEvent(red, c->event(world), 0));
    for (int q = 0; q < world; ++q) inputs[q] = mine + q * part;
  } else {
    for (int q = 0; q < world; ++q) {
      inputs[q] = q == r ? static_cast<const void*>(static_cast<const char*>(a.x) + r * part)
                         : static_cast<const void*>(mine + q * part);
    }
  }
  for (int q = 0; q < world; ++q) {
    if (q != r) JAX_UB_RETURN_IF_ERROR(c->Wait(red, kDataReady, q, e, op));
  }
  // Sum in rank order (the same rounding whatever the arrival order), fp32 accumulation.
  return SumPartials(c, a, inputs.data(), t, red);
}

Status SumPartials(Communicator* c, const GemmRsArgs& a, const void* const* inputs, OpTrace& t,
                   cudaStream_t red) {
  const int world = c->world();
  const int span = t.Start("reduce", -1, CommLabel(0), red);
  JAX_UB_RETURN_IF_ERROR(LaunchSumReduce(a.out_dtype, a.y, inputs, world,
                                         static_cast<size_t>(a.M / world) * a.n,
                                         ReduceBlocks(*c, a), red));
  t.Stop(span, red);
  return Status::Ok();
}

Status RsCheck(const Communicator& c, const GemmRsArgs& a) {
  // Every rank's partial for me lands in my buffer (both transports).
  const size_t need =
      static_cast<size_t>(a.M / c.world()) * a.n * DTypeSize(a.out_dtype) * c.world();
  return need > c.capacity() ? CapacityError(c, need) : Status::Ok();
}

std::string RsText(const GemmRsArgs& a) {
  return StrCat() << "algorithm " << static_cast<int>(a.algo) << " "
                  << (a.w != nullptr ? Describe(a.types()) : DTypeName(a.dtype)) << " x [" << a.M
                  << ", " << a.k << "] n " << a.n << " splits " << a.splits << " split_cols "
                  << a.split_cols;
}

Status GemmRs(Communicator* c, const GemmRsArgs& a, cudaStream_t xla) {
  const char* op = a.w != nullptr ? "matmul_reduce_scatter" : "reduce_scatter";
  return RunOp(
      c, op, xla, [&] { return RsCheck(*c, a); }, RsText(a),
      [&](uint64_t e, OpTrace& t) { return RsBody(c, a, op, e, t); });
}

}  // namespace jax_ub
