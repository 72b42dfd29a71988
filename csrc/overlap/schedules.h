// Host-side overlap schedules: enqueue copies, flag waits/signals and chunk GEMMs on the
// communicator's side streams, all joined back into XLA's stream. No XLA headers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "comm/communicator.h"
#include "common/status.h"
#include "gemm/cublaslt.h"

namespace jax_ub {

enum class AgAlgo : int { kRing = 0, kAllPeer = 1 };
enum class RsAlgo : int { kRing = 0, kPipeline = 1 };

// y[world*m, n] = all_gather(x[m, k]) @ w[k, n], xg[world*m, k] = all_gather(x).
// Copy-engine pulls from peers' registered buffers into xg at each chunk's global row offset;
// chunk GEMMs start as chunks land (local chunk first). w == nullptr: all-gather only.
struct AgGemmArgs {
  DType dtype = DType::kBF16;
  bool tf32 = false;
  AgAlgo algo = AgAlgo::kRing;
  const void* x = nullptr;
  int64_t m = 0, k = 0, n = 0;
  const void* w = nullptr;
  void* y = nullptr;
  void* xg = nullptr;
  void* workspace = nullptr;  // split across compute streams
  size_t workspace_bytes = 0;
};
Status AgGemm(Communicator* c, const AgGemmArgs& a, cudaStream_t xla);
size_t AgGemmBufferBytes(DType t, int64_t m, int64_t k);

// y[M/world, n] = reduce_scatter(x[M, k] @ w[k, n]) over rows, fp32 accumulation.
// Each destination's partial is computed (into `staging`) and pushed by copy engine into the
// owner's registered buffer while the next partial is computed; the owner sums all partials.
// w == nullptr: reduce-scatter of x[M, n] itself.
struct GemmRsArgs {
  DType dtype = DType::kBF16;
  bool tf32 = false;
  RsAlgo algo = RsAlgo::kRing;
  const void* x = nullptr;
  int64_t M = 0, k = 0, n = 0;
  const void* w = nullptr;
  void* y = nullptr;
  void* staging = nullptr;  // [(world-1) * M/world, n]
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  int reduce_blocks = 32;   // SMs' worth of blocks for the final reduction
};
Status GemmRs(Communicator* c, const GemmRsArgs& a, cudaStream_t xla);
size_t GemmRsBufferBytes(DType t, int64_t M, int64_t n);

}  // namespace jax_ub
