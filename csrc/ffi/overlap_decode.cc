// Decoding shared by the overlap family's FFI handlers (see overlap_decode.h).
#include "ffi/overlap_decode.h"

#include <string>

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

namespace {

// w's and y's types for x of type `t` (an FP8 GEMM, or one type for all), and the scales.
ffi::Error DecodeGemmTypes(const char* op, const Communicator& c, DType t, const ffi::AnyBuffer& w,
                           const ffi::AnyBuffer& y, const Scales& scales, GemmTypes* types,
                           const float** x_scale, const float** w_scale) {
  types->a = t;
  if (!ToDType(w.element_type(), &types->b) || !ToDType(y.element_type(), &types->out)) {
    return Check(op, c, false,
                 StrCat() << "w and the result must be float32, float16, bfloat16 or (w) float8; "
                             "got w "
                          << Describe(w) << ", result " << Describe(y));
  }
  types->fast_accum = scales.fast_accum;
  if (const std::string bad = types->Problem(); !bad.empty()) return Check(op, c, false, bad);
  if (auto e =
          DecodeScales(Where(c, op).c_str(), types->fp8(), scales.x, scales.w, x_scale, w_scale);
      e.failure()) {
    return e;
  }
  return ffi::Error::Success();
}

}  // namespace

ffi::Error DecodeAg(const char* op, const Communicator* c, ffi::AnyBuffer x,
                    const ffi::AnyBuffer* w, ffi::AnyBuffer* y, ffi::AnyBuffer* xg,
                    ffi::AnyBuffer* ws, int32_t algo, bool tf32, AgGemmArgs* out,
                    const Scales& scales) {
  DType t;
  if (!ToDType(x.element_type(), &t)) {
    return Check(
        op, *c, false,
        "x must be float32, float16, bfloat16 or float8 (e4m3fn, e5m2); got " + Describe(x));
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
  if (w == nullptr && (scales.x.has_value() || scales.w.has_value() || scales.fast_accum)) {
    return Check(op, *c, false, "a bare all-gather takes no scales and no fast_accum");
  }
  if (algo < 0 || algo > static_cast<int>(AgAlgo::kPush)) {
    return Check(op, *c, false, StrCat() << "unknown all-gather algorithm " << algo);
  }
  AgGemmArgs& a = *out;
  a.dtype = a.w_dtype = a.out_dtype = t;
  a.tf32 = tf32;
  a.algo = static_cast<AgAlgo>(algo);
  a.x = x.untyped_data();
  a.m = xr.rows;
  a.k = xr.cols;
  a.xg = skip_xg ? nullptr : xg->untyped_data();
  if (w != nullptr) {
    GemmTypes types;
    if (auto e = DecodeGemmTypes(op, *c, t, *w, *y, scales, &types, &a.x_scale, &a.w_scale);
        e.failure()) {
      return e;
    }
    a.w_dtype = types.b;
    a.out_dtype = types.out;
    a.fast_accum = types.fast_accum;
    const auto wd = w->dimensions();
    const Rows yr = Fold(y->dimensions());
    // FP8: w stored [n, k] (GemmTypes).
    const bool fp8 = types.fp8();
    const int64_t wk = wd.size() == 2 ? wd[fp8 ? 1 : 0] : -1;
    const int64_t wn = wd.size() == 2 ? wd[fp8 ? 0 : 1] : -1;
    if (auto e = Check(op, *c, wk == xr.cols && yr.rows == xr.rows * world && yr.cols == wn,
                       StrCat() << "w must be " << (fp8 ? "[n, " : "[") << xr.cols
                                << (fp8 ? "] (float8: stored transposed)" : ", n]") << " and y ["
                                << xr.rows * world << " rows, n]; got x " << Describe(x) << ", w "
                                << Describe(*w) << ", y " << Describe(*y));
        e.failure()) {
      return e;
    }
    a.w = w->untyped_data();
    a.n = wn;
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
                    GemmRsArgs* out, int32_t splits, bool split_cols, const Scales& scales) {
  DType t;
  if (!ToDType(x.element_type(), &t) || (w == nullptr && IsFp8(t))) {
    return Check(op, *c, false,
                 StrCat() << "x must be float32, float16, bfloat16"
                          << (w != nullptr ? " or float8 (e4m3fn, e5m2)" : " (a sum)") << "; got "
                          << Describe(x));
  }
  GemmTypes types = GemmTypes::Same(t);
  const float *x_scale = nullptr, *w_scale = nullptr;
  if (w != nullptr) {
    if (auto e = DecodeGemmTypes(op, *c, t, *w, *y, scales, &types, &x_scale, &w_scale);
        e.failure()) {
      return e;
    }
  } else if (scales.x.has_value() || scales.w.has_value() || scales.fast_accum) {
    return Check(op, *c, false, "a bare reduce-scatter takes no scales and no fast_accum");
  }
  const bool fp8 = types.fp8();  // w stored [n, k]
  const Rows xr = Fold(x.dimensions());
  const Rows yr = Fold(y->dimensions());
  const int world = c->world();
  const int64_t n =
      w != nullptr ? (w->dimensions().size() == 2 ? w->dimensions()[fp8 ? 0 : 1] : -1) : xr.cols;
  if (auto e = Check(op, *c,
                     xr.rows % world == 0 && yr.rows * world == xr.rows && yr.cols == n &&
                         (w != nullptr || y->element_type() == x.element_type()),
                     StrCat() << "x has " << xr.rows << " rows (must be divisible by " << world
                              << ") and the result must be " << xr.rows / world << " rows of " << n
                              << " " << DTypeName(types.out) << "; got x " << Describe(x)
                              << ", result " << Describe(*y));
      e.failure()) {
    return e;
  }
  if (algo < 0 || algo > static_cast<int>(RsAlgo::kColumns)) {
    return Check(op, *c, false, StrCat() << "unknown reduce-scatter algorithm " << algo);
  }
  GemmRsArgs& a = *out;
  a.dtype = t;
  a.w_dtype = types.b;
  a.out_dtype = types.out;
  a.x_scale = x_scale;
  a.w_scale = w_scale;
  a.fast_accum = types.fast_accum;
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
    if (auto e = Check(op, *c, wd.size() == 2 && wd[fp8 ? 1 : 0] == xr.cols,
                       StrCat() << "w must be " << (fp8 ? "[n, " : "[") << xr.cols
                                << (fp8 ? "] (float8: stored transposed)" : ", n]") << "; got x "
                                << Describe(x) << ", w " << Describe(*w));
        e.failure()) {
      return e;
    }
    // kColumns stages the whole GEMM output, the others the peers' partials (result type).
    const int staged = a.algo == RsAlgo::kColumns ? world : world - 1;
    const size_t need = static_cast<size_t>(staged) * (xr.rows / world) * n * DTypeSize(types.out);
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
