// GEMM->RS schedules (ring, pipeline, chain, columns) and the bare reduce-scatter: see
// overlap/op.h and the protocol in comm/communicator.h.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/enums.h"
#include "overlap/op.h"

namespace jax_ub {

// kRing: partials pushed one after another on one comm stream; kPipeline: each push on its own
// comm stream (a slow push never delays the next one). Both end with one fp32 sum of the world
// partials after the last GEMM.
// kChain: no final sum. Step s (0..world-1) computes chunk (r-s-1) mod world with the partial sum
//         that rank r-1 computed for it at step s-1 as the GEMM's addend (cuBLASLt beta = 1, fp32
//         epilogue), and pushes the result to rank r+1; the last step is the own chunk, written
//         straight into y. Each step goes in `splits` row pieces, signalled one by one (kPiece),
//         so rank r+1's next step starts on a piece as soon as it lands. The partial sums travel
//         in the op's dtype (one rounding per hop, as in NCCL's ring); GEMM only.
// kColumns: the GEMM runs over all M rows in `splits` column blocks (w is read once in all). As
//         soon as block p is computed, each destination's rows of it go to their owner (one 2-D
//         copy per peer, each peer on its own comm stream, signalled kPiece), and the owner sums
//         block p of the world partials (fp32) while block p+1 is computed: the op ends one
//         block's push and sum after the GEMM, and no partial GEMM re-reads w. GEMM only; staging
//         holds all M rows.
#define JAX_UB_RS_ALGORITHMS(X) \
  X(kRing, "ring", 0) X(kPipeline, "pipeline", 1) X(kChain, "chain", 2) X(kColumns, "columns", 3)
enum class RsAlgo : int { JAX_UB_RS_ALGORITHMS(JAX_UB_ENUMERATOR) };

// y[M/world, n] = reduce_scatter(x[M, k] @ w[k, n]) over rows, fp32 accumulation.
// Each destination's partial is computed (into `staging`, one compute stream, in push order) and
// pushed by copy engine into the owner's registered buffer while the next one is computed; the
// owner's partial is computed last, into its own slot; then one sum over the world partials.
// w == nullptr: reduce-scatter of x[M, n] itself.
// FP8 (dtype kE4M3/kE5M2): w is stored [n, k] (w_dtype FP8) and each partial is out_dtype
// (bfloat16 or float32), dequantized in the GEMM's epilogue by this rank's (*x_scale) *
// (*w_scale); the partials travel and are summed (fp32) in out_dtype. Without w, out_dtype = dtype.
struct GemmRsArgs {
  DType dtype = DType::kBF16;  // x's
  DType w_dtype = DType::kBF16, out_dtype = DType::kBF16;
  const float* x_scale = nullptr;  // FP8 only: device pointers to the dequantization scales
  const float* w_scale = nullptr;
  bool fast_accum = false;  // FP8 only: cuBLASLt's fast accumulation (GemmTypes)
  GemmTypes types() const { return GemmTypes{dtype, w_dtype, out_dtype, fast_accum}; }
  bool tf32 = false;
  RsAlgo algo = RsAlgo::kRing;
  const void* x = nullptr;
  int64_t M = 0, k = 0, n = 0;
  const void* w = nullptr;
  void* y = nullptr;
  void* staging = nullptr;  // [(world-1) * M/world, n] (kColumns: [M, n])
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  int reduce_blocks = 0;    // blocks of the final fp32 sum (0: enough for the whole GPU)
  // Each peer's partial is computed and pushed in this many row pieces (1 or 2): the first push
  // starts after half a partial's GEMM (comm-bound shapes), the rest as before. kChain: pieces
  // per step (1 to kMaxChainPieces). w == nullptr (ring, pipeline; 1 to kMaxSumPieces): the
  // pushes go in row pieces, each summed as soon as every peer's has landed (RsPiecesBody).
  int splits = 1;
  // kChain: the pieces are column blocks (all rows, n / splits columns each: w is read once per
  // step, and a piece is pushed as one 2-D copy) instead of row blocks (each piece's GEMM reads all
  // of w again, which costs where the rows per step are few). Needs n % splits == 0 and 16-byte
  // aligned blocks; otherwise rows.
  bool split_cols = false;
};
Status GemmRs(Communicator* c, const GemmRsArgs& a, cudaStream_t xla);
size_t GemmRsBufferBytes(DType t, int64_t M, int64_t n);
// What the op needs of the communicator, checked before Begin (see CapacityError).
Status RsCheck(const Communicator& c, const GemmRsArgs& a);
// The op's description for RunOp's `what` (every rank must agree on it).
std::string RsText(const GemmRsArgs& a);
// The schedule body (between Begin and End). On a communicator with transport nccl it hands over
// to RsBodyNccl (overlap/nccl_schedules.cc), whatever the algorithm.
Status RsBody(Communicator* c, const GemmRsArgs& a, const char* op, uint64_t e, OpTrace& t);
Status RsBodyNccl(Communicator* c, const GemmRsArgs& a, const char* op, OpTrace& t);
// The final fp32 sum of RS's ring and pipeline (both transports): y = sum of the world partials in
// `inputs` (rank order), traced as "reduce" on `red`, with a.reduce_blocks blocks (0: 4 per SM).
Status SumPartials(Communicator* c, const GemmRsArgs& a, const void* const* inputs, OpTrace& t,
                   cudaStream_t red);

}  // namespace jax_ub
