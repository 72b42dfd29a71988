// The bulk overlap op: a bare collective beside an independent GEMM, in one op (see
// overlap/op.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/enums.h"
#include "overlap/ag_gemm.h"
#include "overlap/gemm_rs.h"
#include "overlap/op.h"

namespace jax_ub {

// Bulk overlap: a bare collective (all-gather or reduce-scatter of `coll`) under an independent
// GEMM gy[gm, gn] = ga[gm, gk] @ gb[gk, gn], in one op. The GEMM's first `side_rows` rows run as
// `gemm_side` (an SM-count target that leaves SMs to the collective's SM work: the all-gather's
// same-device copies, the reduce-scatter's fp32 sum), the rest as `gemm` (every SM).
// The bulk op's collective (its FFI attribute `kind`).
#define JAX_UB_BULK_KINDS(X) X(kAllGather, "ag", 0) X(kReduceScatter, "rs", 1)
enum class BulkKind : int { JAX_UB_BULK_KINDS(JAX_UB_ENUMERATOR) };

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

}  // namespace jax_ub
