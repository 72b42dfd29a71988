// Decoding shared by the overlap family's FFI handlers (see overlap_decode.h).
#include "ffi/overlap_decode.h"

namespace jax_ub {

ffi::Error Lookup(const char* op, int64_t set_id, int32_t device,
                  std::shared_ptr<Communicator>* hold, Communicator** out) {
  if (cudaSetDevice(device) != cudaSuccess) {
    cudaGetLastError();
    return InvalidArgument(StrCat() << "jax_ub " << op << ": cannot select device " << device);
  }
  *hold = RegistryGet(static_cast<int>(set_id), device);
  *out = hold->get();
  if (*out == nullptr) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      StrCat() << "jax_ub " << op << ": no communicator for device " << device
                               << " in set " << set_id
                               << " (was jax_ub.shutdown() called, or initialize() given another "
                                  "mesh?)");
  }
  return ffi::Error::Success();
}

ffi::Error Check(const char* op, const Communicator& c, bool ok, const std::string& what) {
  if (ok) return ffi::Error::Success();
  return InvalidArgument(Where(c, op) + ": " + what);
}

ffi::Error DecodeAg(const char* op, const Communicator* c, ffi::AnyBuffer x,
                    const ffi::AnyBuffer* w, ffi::AnyBuffer* y, ffi::AnyBuffer* xg,
                    ffi::AnyBuffer* ws, int32_t algo, bool tf32, AgGemmArgs* out) {
  DType t;
  if (!ToDType(x.element_type(), &t)) {
    return Check(op, *c, false, "x must be float32, float16 or bfloat16; got " + Describe(x));
  }
  const Rows xr = Fold(x.dimensions());
  const Rows gr = Fold(xg->dimensions());
  const int world = c->world();
  // A gathered result with no rows: the caller does not want it (AG->GEMM with push or nccl).
  const bool skip_xg = w != nullptr && gr.rows == 0;
  if (auto e = Check(
          op, *c,
          (skip_xg || (gr.rows == xr.rows * world && xg->element_type() == x.element_type())) &&
              gr.cols == xr.cols,
          StrCat() << "gathered result is " << Describe(*xg) << ", expected " << xr.rows * world
                   << " rows of " << xr.cols << " " << DTypeName(t) << " (x is " << Describe(x)
                   << ")");
      e.failure()) {
    return e;
  }
  if (algo < 0 || algo > static_cast<int>(AgAlgo::kPush)) {
    return Check(op, *c, false, StrCat() << "unknown all-gather algorithm " << algo);
  }
  AgGemmArgs& a = *out;
  a.dtype = t;
  a.tf32 = tf32;
  a.algo = static_cast<AgAlgo>(algo);
  a.x = x.untyped_data();
  a.m = xr.rows;
  a.k = xr.cols;
  a.xg = skip_xg ? nullptr : xg->untyped_data();
  if (w != nullptr) {
    const auto wd = w->dimensions();
    const Rows yr = Fold(y->dimensions());
    if (auto e = Check(op, *c,
                       wd.size() == 2 && wd[0] == xr.cols &&
                           w->element_type() == x.element_type() && yr.rows == xr.rows * world &&
                           yr.cols == wd[1] && y->element_type() == x.element_type(),
                       StrCat() << "w must be [" << xr.cols << ", n] and y [" << xr.rows * world
                                << " rows, n], both " << DTypeName(t) << " like x; got x "
                                << Describe(x) << ", w " << Describe(*w) << ", y " << Describe(*y));
        e.failure()) {
      return e;
    }
    a.w = w->untyped_data();
    a.n = wd[1];
    a.y = y->untyped_data();
    a.workspace = ws->untyped_data();
    a.workspace_bytes = ws->size_bytes();
  }
  return ffi::Error::Success();
}

ffi::Error Run(const char* op, int32_t device, Communicator* c, const Status& s) {
  (void)device;  // Where names it, with the set, group and rank
  if (s.ok()) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kInternal, Where(*c, op) + ": " + s.message());
}

ffi::Error DecodeRs(const char* op, const Communicator* c, ffi::AnyBuffer x,
                    const ffi::AnyBuffer* w, ffi::AnyBuffer* y, ffi::AnyBuffer* staging,
                    ffi::AnyBuffer* ws, int32_t algo, bool tf32, int32_t reduce_blocks,
                    GemmRsArgs* out, int32_t splits, bool split_cols) {
  DType t;
  if (!ToDType(x.element_type(), &t)) {
    return Check(op, *c, false, "x must be float32, float16 or bfloat16; got " + Describe(x));
  }
  const Rows xr = Fold(x.dimensions());
  const Rows yr = Fold(y->dimensions());
  const int world = c->world();
  const int64_t n =
      w != nullptr ? (w->dimensions().size() == 2 ? w->dimensions()[1] : -1) : xr.cols;
  if (auto e = Check(op, *c,
                     xr.rows % world == 0 && yr.rows * world == xr.rows && yr.cols == n &&
                         y->element_type() == x.element_type(),
                     StrCat() << "x has " << xr.rows << " rows (must be divisible by " << world
                              << ") and the result must be " << xr.rows / world << " rows of " << n
                              << " " << DTypeName(t) << "; got x " << Describe(x) << ", result "
                              << Describe(*y));
      e.failure()) {
    return e;
  }
  if (algo < 0 || algo > static_cast<int>(RsAlgo::kColumns)) {
    return Check(op, *c, false, StrCat() << "unknown reduce-scatter algorithm " << algo);
  }
  GemmRsArgs& a = *out;
  a.dtype = t;
  a.tf32 = tf32;
  a.algo = static_cast<RsAlgo>(algo);
  a.x = x.untyped_data();
  a.M = xr.rows;
  a.k = w != nullptr ? xr.cols : 0;
  a.n = n;
  a.y = y->untyped_data();
  a.reduce_blocks = reduce_blocks;
  const int max_splits = w == nullptr                 ? kMaxSumPieces
                         : a.algo == RsAlgo::kChain   ? kMaxChainPieces
                         : a.algo == RsAlgo::kColumns ? kMaxColumnPieces
                                                      : 2;
  if (splits < 1 || splits > max_splits) {
    return Check(op, *c, false,
                 StrCat() << "splits must be in [1, " << max_splits << "] for "
                          << "reduce-scatter algorithm " << algo << "; got " << splits);
  }
  a.splits = splits;
  a.split_cols = split_cols;
  if (w != nullptr) {
    const auto wd = w->dimensions();
    if (auto e = Check(op, *c,
                       wd.size() == 2 && wd[0] == xr.cols && w->element_type() == x.element_type(),
                       StrCat() << "w must be [" << xr.cols << ", n] of x's dtype; got x "
                                << Describe(x) << ", w " << Describe(*w));
        e.failure()) {
      return e;
    }
    // kColumns stages the whole GEMM output, the others the peers' partials.
    const int staged = a.algo == RsAlgo::kColumns ? world : world - 1;
    const size_t need = static_cast<size_t>(staged) * (xr.rows / world) * n * DTypeSize(t);
    if (auto e =
            Check(op, *c, staging->size_bytes() >= need,
                  StrCat() << "staging has " << staging->size_bytes() << " bytes, needs " << need);
        e.failure()) {
      return e;
    }
    a.w = w->untyped_data();
    a.staging = staging->untyped_data();
    a.workspace = ws->untyped_data();
    a.workspace_bytes = ws->size_bytes();
  }
  return ffi::Error::Success();
}

}  // namespace jax_ub
