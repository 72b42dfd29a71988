// Host-side overlap schedules: enqueue copies, flag waits/signals and chunk GEMMs on the
// communicator's side streams, all joined back into XLA's stream. No XLA headers.
//
// Every schedule is Begin -> body -> End (comm/communicator.h). The bodies are separate so that
// the bulk form can run an independent GEMM beside a bare collective inside one op.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>

#include "comm/communicator.h"
#include "comm/trace.h"
#include "common/status.h"
#include "gemm/cublaslt.h"

namespace jax_ub {

// kRing: pull peers' chunks one after another in ring order (r+1, r+2, ...), each at full link
//        speed, so the first chunk GEMM starts early.
// kAllPeer: pull every peer's chunk at once (one comm stream each).
// kPush: each rank pushes its shard straight from x into every peer's buffer (ring order r-1,
//        r-2, ...); no publish copy; the receiver GEMMs from its buffer and copies into xg.
enum class AgAlgo : int { kRing = 0, kAllPeer = 1, kPush = 2 };
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
enum class RsAlgo : int { kRing = 0, kPipeline = 1, kChain = 2, kColumns = 3 };

// Row-major y[m, n] = x[m, k] @ w[k, n] on `s` (one chunk of a schedule).
struct RowGemm {
  DType dtype = DType::kBF16;
  bool tf32 = false;
  int64_t k = 0, n = 0;
  const void* w = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;  // one GEMM of an op runs at a time: each gets all of it
  int sm_count = 0;
  int64_t ld = 0;  // row stride (elements) of w, y and the addend; 0: n (a column block when > n)
  // addend != nullptr: y = x @ w + addend (same layout as y).
  Status Run(int device, const void* x, int64_t m, void* y, cudaStream_t s,
             const void* addend = nullptr) const;

  // The chunk GEMM of an op: x rows of any chunk @ w, with the op's workspace (256-byte
  // multiple). `sm_count` > 0 leaves the rest of the GPU to concurrent kernels.
  static RowGemm Make(DType dtype, bool tf32, int64_t k, int64_t n, const void* w,
                      void* workspace, size_t workspace_bytes, int sm_count = 0) {
    RowGemm g;
    g.dtype = dtype;
    g.tf32 = tf32;
    g.k = k;
    g.n = n;
    g.w = w;
    g.workspace = workspace;
    g.workspace_bytes = workspace_bytes / 256 * 256;
    g.sm_count = sm_count;
    return g;
  }
  // Of an AgGemmArgs or GemmRsArgs (same field names).
  template <class OpArgs>
  static RowGemm Of(const OpArgs& a) {
    return Make(a.dtype, a.tf32, a.k, a.n, a.w, a.workspace, a.workspace_bytes);
  }
};

// y[world*m, n] = all_gather(x[m, k]) @ w[k, n], xg[world*m, k] = all_gather(x).
// Chunks land in xg at their global row offsets; chunk GEMMs start as chunks land (local chunk
// first). w == nullptr: all-gather only.
struct AgGemmArgs {
  DType dtype = DType::kBF16;
  bool tf32 = false;
  AgAlgo algo = AgAlgo::kRing;
  const void* x = nullptr;
  int64_t m = 0, k = 0, n = 0;
  const void* w = nullptr;
  void* y = nullptr;
  void* xg = nullptr;  // nullptr: the gathered input is not wanted (push and nccl only)
  void* workspace = nullptr;  // split across compute streams
  size_t workspace_bytes = 0;
  // kPush with w: the last peer chunk to land (rank r-1's, pushed at the last ring step) is pushed
  // and multiplied in this many row pieces (1 to kMaxChainPieces, dividing m), signalled one by
  // one (kPiece): the op's tail is then one piece's GEMM instead of a whole chunk's.
  int pieces = 1;
  // kPush with w, pieces == 1: the peers' chunks are multiplied as (at most) two GEMMs over their
  // contiguous rows of the buffer instead of one per chunk: ranks r+1..world-1 (they land first),
  // then 0..r-1, each once all its chunks have landed. Fewer, larger GEMMs cost less than one per
  // chunk where the copies are done before the local chunk's GEMM is (scripts/split_gemm_probe.py).
  bool merge = false;
  // Called (ipc only) once the local shard's same-device copies are enqueued, before the peers'
  // chunks: the bulk form enqueues its GEMM there (see Bulk).
  std::function<Status()> after_local;
  // > 0: the local shard's same-device copies (pull's publish, its rows of xg) are a kernel of at
  // most this many blocks (kernels/copy.h) instead of CopyAsync, so that they run beside a GEMM
  // that leaves SMs free instead of waiting for it to end (the bulk form).
  int copy_blocks = 0;
};
Status AgGemm(Communicator* c, const AgGemmArgs& a, cudaStream_t xla);
// Registered-buffer bytes AgGemm needs (every rank's shard: kPush lands peers' shards there).
size_t AgGemmBufferBytes(DType t, int64_t m, int64_t k, int world);

// y[M/world, n] = reduce_scatter(x[M, k] @ w[k, n]) over rows, fp32 accumulation.
// Each destination's partial is computed (into `staging`, one compute stream, in push order) and
// pushed by copy engine into the owner's registered buffer while the next one is computed; the
// owner's partial is computed last, into its own slot; then one sum over the world partials.
// w == nullptr: reduce-scatter of x[M, n] itself.
struct GemmRsArgs {
  DType dtype = DType::kBF16;
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
constexpr int kMaxChainPieces = 4;
constexpr int kMaxColumnPieces = 8;
constexpr int kMaxSumPieces = 8;
size_t GemmRsBufferBytes(DType t, int64_t M, int64_t n);

// Bulk overlap: a bare collective (all-gather or reduce-scatter of `coll`) under an independent
// GEMM gy[gm, gn] = ga[gm, gk] @ gb[gk, gn], in one op. The GEMM's first `side_rows` rows run as
// `gemm_side` (an SM-count target that leaves SMs to the collective's SM work: the all-gather's
// same-device copies, the reduce-scatter's fp32 sum), the rest as `gemm` (every SM).
struct BulkArgs {
  bool reduce_scatter = false;
  AgGemmArgs ag;  // w == nullptr
  GemmRsArgs rs;  // w == nullptr
  RowGemm gemm, gemm_side;
  const void* ga = nullptr;
  int64_t gm = 0;
  int64_t side_rows = 0;  // 0..gm
  void* gy = nullptr;
};
Status Bulk(Communicator* c, const BulkArgs& a, cudaStream_t xla);

// What an op needs of the communicator (registered-buffer capacity, a gathered output for the
// pull algorithms), checked before Begin: a refused op leaves the epoch protocol untouched, so the
// communicator stays usable.
Status AgCheck(const Communicator& c, const AgGemmArgs& a);
Status RsCheck(const Communicator& c, const GemmRsArgs& a);
Status CapacityError(const Communicator& c, size_t need);

// `check` (AgCheck/RsCheck's verdict) -> Begin -> body(epoch, trace) -> End. A refused op never
// begins. A body that fails after Begin abandons the communicator (Communicator::Abandon): its
// streams are joined, later ops fail naming this failure, peers' waits time out naming this rank.
// An op's description for RunOp's `what` (every rank must agree on it).
std::string AgText(const AgGemmArgs& a);
std::string RsText(const GemmRsArgs& a);

// `what`: the op's algorithm, dtype and shapes as text (Communicator::Begin: equal on every rank
// that runs the same op; its hash is compared with the peers').
// `check` runs under the communicator's op lock (it reads the capacity, which Grow changes).
Status RunOp(Communicator* c, const char* op, cudaStream_t xla,
             const std::function<Status()>& check, const std::string& what,
             const std::function<Status(uint64_t, OpTrace&)>& body);

// Schedule bodies (between Begin and End). On a communicator with transport nccl they hand over
// to the NCCL bodies (overlap/nccl_schedules.cc), whatever the algorithm.
Status AgBody(Communicator* c, const AgGemmArgs& a, const char* op, uint64_t e, OpTrace& t);
Status RsBody(Communicator* c, const GemmRsArgs& a, const char* op, uint64_t e, OpTrace& t);
Status AgBodyNccl(Communicator* c, const AgGemmArgs& a, const char* op, OpTrace& t);
Status RsBodyNccl(Communicator* c, const GemmRsArgs& a, const char* op, OpTrace& t);
// The final fp32 sum of RS's ring and pipeline (both transports): y = sum of the world partials in
// `inputs` (rank order), traced as "reduce" on `red`, with a.reduce_blocks blocks (0: 4 per SM).
Status SumPartials(Communicator* c, const GemmRsArgs& a, const void* const* inputs, OpTrace& t,
                   cudaStream_t red);

}  // namespace jax_ub
