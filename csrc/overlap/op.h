// What every overlap schedule shares (no XLA headers): the chunk GEMM (RowGemm), the op frame
// RunOp (check -> Begin -> body -> End, comm/communicator.h) and the limits on pieces. The
// schedules enqueue copies, flag waits/signals and chunk GEMMs on the communicator's side streams,
// all joined back into XLA's stream.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "comm/communicator.h"
#include "comm/trace.h"
#include "common/status.h"
#include "gemm/cublaslt.h"

namespace jax_ub {

// Row-major y[m, n] = x[m, k] @ w[k, n] on `s` (one chunk of a schedule). FP8 types: w is stored
// [n, k] (GemmTypes), and the product is dequantized by *x_scale * *w_scale.
struct RowGemm {
  GemmTypes types;
  bool tf32 = false;
  int64_t k = 0, n = 0;
  const void* w = nullptr;
  const float* x_scale = nullptr;  // FP8 only: device pointers
  const float* w_scale = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;  // one GEMM of an op runs at a time: each gets all of it
  int sm_count = 0;
  // Row stride (elements) of y and the addend, and of w unless FP8 (stored [n, k]: its row
  // stride stays k); 0: n (a column block when > n).
  int64_t ld = 0;
  // addend != nullptr: y = x @ w + addend (same layout as y).
  Status Run(int device, const void* x, int64_t m, void* y, cudaStream_t s,
             const void* addend = nullptr) const;
  // w's columns from `col` on (a column block's w, with ld = the full width).
  const void* WFrom(int64_t col) const {
    const size_t es = DTypeSize(types.b);
    return static_cast<const char*>(w) + (types.fp8() ? col * k : col) * es;
  }
  size_t x_size() const { return DTypeSize(types.a); }  // element sizes
  size_t y_size() const { return DTypeSize(types.out); }

  // The chunk GEMM of an op: x rows of any chunk @ w, with the op's workspace (256-byte
  // multiple). `sm_count` > 0 leaves the rest of the GPU to concurrent kernels.
  static RowGemm Make(GemmTypes types, bool tf32, int64_t k, int64_t n, const void* w,
                      void* workspace, size_t workspace_bytes, int sm_count = 0) {
    RowGemm g;
    g.types = types;
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
    RowGemm g = Make(a.types(), a.tf32, a.k, a.n, a.w, a.workspace, a.workspace_bytes);
    g.x_scale = a.x_scale;
    g.w_scale = a.w_scale;
    return g;
  }
};

constexpr int kMaxChainPieces = 4;  // AG push's last chunk; RS chain's pieces per step
constexpr int kMaxColumnPieces = 8;  // RS columns' column blocks
constexpr int kMaxSumPieces = 8;  // bare RS's row pieces

// What an op needs of the communicator (registered-buffer capacity, a gathered output for the
// pull algorithms) is checked before Begin: a refused op leaves the epoch protocol untouched, so
// the communicator stays usable. This is the capacity failure's message.
Status CapacityError(const Communicator& c, size_t need);

// `check` (AgCheck/RsCheck's verdict) -> Begin -> body(epoch, trace) -> End. A refused op never
// begins. A body that fails after Begin abandons the communicator (Communicator::Abandon): its
// streams are joined, later ops fail naming this failure, peers' waits time out naming this rank.
// `what`: the op's algorithm, dtype and shapes as text (Communicator::Begin: equal on every rank
// that runs the same op; its hash is compared with the peers').
// `check` runs under the communicator's op lock (it reads the capacity, which Grow changes).
Status RunOp(Communicator* c, const char* op, cudaStream_t xla,
             const std::function<Status()>& check, const std::string& what,
             const std::function<Status(uint64_t, OpTrace&)>& body);

}  // namespace jax_ub
