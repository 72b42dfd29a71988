// AG->GEMM schedules (pull ring, pull all-peer, push ring) and the bare all-gather: see
// overlap/op.h and the protocol in comm/communicator.h.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "common/enums.h"
#include "overlap/op.h"

namespace jax_ub {

// kRing: pull peers' chunks one after another in ring order (r+1, r+2, ...), each at full link
//        speed, so the first chunk GEMM starts early.
// kAllPeer: pull every peer's chunk at once (one comm stream each).
// kPush: each rank pushes its shard straight from x into every peer's buffer (ring order r-1,
//        r-2, ...); no publish copy; the receiver GEMMs from its buffer and copies into xg.
#define JAX_UB_AG_ALGORITHMS(X) X(kRing, "ring", 0) X(kAllPeer, "all_peer", 1) X(kPush, "push", 2)
enum class AgAlgo : int { JAX_UB_AG_ALGORITHMS(JAX_UB_ENUMERATOR) };

// y[world*m, n] = all_gather(x[m, k]) @ w[k, n], xg[world*m, k] = all_gather(x).
// Chunks land in xg at their global row offsets; chunk GEMMs start as chunks land (local chunk
// first). w == nullptr: all-gather only.
// FP8 (dtype kE4M3/kE5M2): the all-gather moves the FP8 bytes, w is stored [n, k] (w_dtype FP8),
// y is out_dtype (bfloat16 or float32) = (*x_scale) * (*w_scale) * (x @ w) per chunk.
struct AgGemmArgs {
  DType dtype = DType::kBF16;  // x's (and xg's)
  DType w_dtype = DType::kBF16, out_dtype = DType::kBF16;
  const float* x_scale = nullptr;  // FP8 only: device pointers to the dequantization scales
  const float* w_scale = nullptr;
  bool fast_accum = false;  // FP8 only: cuBLASLt's fast accumulation (GemmTypes)
  GemmTypes types() const { return GemmTypes{dtype, w_dtype, out_dtype, fast_accum}; }
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
  // chunk where the copies are done before the local chunk's GEMM is.
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
// What the op needs of the communicator, checked before Begin (see CapacityError).
Status AgCheck(const Communicator& c, const AgGemmArgs& a);
// The op's description for RunOp's `what` (every rank must agree on it).
std::string AgText(const AgGemmArgs& a);
// The schedule body (between Begin and End). On a communicator with transport nccl it hands over
// to AgBodyNccl (overlap/nccl_schedules.cc), whatever the algorithm.
Status AgBody(Communicator* c, const AgGemmArgs& a, const char* op, uint64_t e, OpTrace& t);
Status AgBodyNccl(Communicator* c, const AgGemmArgs& a, const char* op, OpTrace& t);

}  // namespace jax_ub
