// FFI handlers of the overlap family: decode, validate, look up this device's communicator,
// launch the schedule (overlap/). Python: jax_ub/overlap.py.
//
// None is kCmdBufferCompatible: each call advances a host-side epoch counter and registers its
// waits with the watchdog, which a CUDA graph would freeze.
#include "ffi/overlap.h"

#include <cstdint>
#include <memory>

#include "comm/communicator.h"
#include "ffi/common.h"
#include "overlap/schedules.h"

namespace jax_ub {
namespace {

struct Rows {
  int64_t rows = 1;  // product of all but the last dim
  int64_t cols = 0;  // last dim
};

Rows Fold(const ffi::AnyBuffer::Dimensions& d) {
  Rows r;
  for (size_t i = 0; i + 1 < d.size(); ++i) r.rows *= d[i];
  r.cols = d.size() == 0 ? 0 : d[d.size() - 1];
  return r;
}

// `hold` keeps the communicator alive for the handler's call (a concurrent shutdown may destroy
// it; RunOp then refuses the op); `out` is its plain pointer.
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

// Decodes and validates an AG op's buffers into `a` (w, y, ws null: all-gather only).
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
  if (auto e = Check(op, *c,
                     (skip_xg || (gr.rows == xr.rows * world &&
                                  xg->element_type() == x.element_type())) &&
                         gr.cols == xr.cols,
                     StrCat() << "gathered result is " << Describe(*xg) << ", expected "
                              << xr.rows * world << " rows of " << xr.cols << " "
                              << DTypeName(t) << " (x is " << Describe(x) << ")");
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
                       wd.size() == 2 && wd[0] == xr.cols && w->element_type() == x.element_type() &&
                           yr.rows == xr.rows * world && yr.cols == wd[1] &&
                           y->element_type() == x.element_type(),
                       StrCat() << "w must be [" << xr.cols << ", n] and y [" << xr.rows * world
                                << " rows, n], both " << DTypeName(t) << " like x; got x "
                                << Describe(x) << ", w " << Describe(*w) << ", y "
                                << Describe(*y));
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

ffi::Error AgImpl(const char* op, cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                  const ffi::AnyBuffer* w, ffi::AnyBuffer* y, ffi::AnyBuffer* xg,
                  ffi::AnyBuffer* ws, int64_t set_id, int32_t algo, bool tf32,
                  int32_t pieces = 1, bool merge = false) {
  std::shared_ptr<Communicator> hold;
  Communicator* c = nullptr;
  if (auto e = Lookup(op, set_id, device, &hold, &c); e.failure()) return e;
  AgGemmArgs a;
  if (auto e = DecodeAg(op, c, x, w, y, xg, ws, algo, tf32, &a); e.failure()) return e;
  if (pieces < 1 || pieces > kMaxChainPieces || a.m % pieces != 0) {
    return Check(op, *c, false, StrCat() << "pieces must be in [1, " << kMaxChainPieces
                                          << "] and divide the local rows " << a.m << "; got "
                                          << pieces);
  }
  if (merge && (a.algo != AgAlgo::kPush || pieces != 1)) {
    return Check(op, *c, false, StrCat() << "merge applies to the push algorithm without pieces; "
                                            "got algorithm " << algo << ", pieces " << pieces);
  }
  a.pieces = pieces;
  a.merge = merge;
  if (a.w != nullptr && a.k == 0 && y->size_bytes() > 0) {
    // x @ w over an empty inner dimension: zeros (nothing to gather, no op, no epoch).
    if (cudaMemsetAsync(a.y, 0, y->size_bytes(), stream) != cudaSuccess) {
      cudaGetLastError();
      return Check(op, *c, false, "cudaMemsetAsync of the result failed");
    }
  }
  if (a.m == 0 || a.k == 0) return ffi::Error::Success();
  if (a.w != nullptr && a.n == 0) {
    // x @ w with no output columns: only the gathered input is left to compute, if it is wanted.
    if (a.xg == nullptr) return ffi::Error::Success();
    a.w = nullptr;
  }
  return Run(op, device, c, AgGemm(c, a, stream));
}

ffi::Error AgGemmExecute(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer w,
                         ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> xg,
                         ffi::Result<ffi::AnyBuffer> ws, int64_t set_id, int32_t algo,
                         bool tf32, int32_t pieces, bool merge) {
  return AgImpl("all_gather_matmul", stream, device, x, &w, &*y, &*xg, &*ws, set_id, algo, tf32,
                pieces, merge);
}

ffi::Error AllGatherExecute(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                            ffi::Result<ffi::AnyBuffer> xg, int64_t set_id, int32_t algo) {
  return AgImpl("all_gather", stream, device, x, nullptr, nullptr, &*xg, nullptr, set_id, algo,
                false);
}

ffi::Error DecodeRs(const char* op, const Communicator* c, ffi::AnyBuffer x,
                    const ffi::AnyBuffer* w, ffi::AnyBuffer* y, ffi::AnyBuffer* staging,
                    ffi::AnyBuffer* ws, int32_t algo, bool tf32, int32_t reduce_blocks,
                    GemmRsArgs* out, int32_t splits = 1, bool split_cols = false) {
  DType t;
  if (!ToDType(x.element_type(), &t)) {
    return Check(op, *c, false, "x must be float32, float16 or bfloat16; got " + Describe(x));
  }
  const Rows xr = Fold(x.dimensions());
  const Rows yr = Fold(y->dimensions());
  const int world = c->world();
  const int64_t n = w != nullptr ? (w->dimensions().size() == 2 ? w->dimensions()[1] : -1)
                                 : xr.cols;
  if (auto e = Check(op, *c,
                     xr.rows % world == 0 && yr.rows * world == xr.rows && yr.cols == n &&
                         y->element_type() == x.element_type(),
                     StrCat() << "x has " << xr.rows << " rows (must be divisible by " << world
                              << ") and the result must be " << xr.rows / world << " rows of "
                              << n << " " << DTypeName(t) << "; got x " << Describe(x)
                              << ", result " << Describe(*y));
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
  const int max_splits = w == nullptr                  ? kMaxSumPieces
                         : a.algo == RsAlgo::kChain     ? kMaxChainPieces
                         : a.algo == RsAlgo::kColumns ? kMaxColumnPieces
                                                      : 2;
  if (splits < 1 || splits > max_splits) {
    return Check(op, *c, false, StrCat() << "splits must be in [1, " << max_splits << "] for "
                                          << "reduce-scatter algorithm " << algo << "; got "
                                          << splits);
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
    if (auto e = Check(op, *c, staging->size_bytes() >= need,
                       StrCat() << "staging has " << staging->size_bytes() << " bytes, needs "
                                << need);
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

ffi::Error RsImpl(const char* op, cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                  const ffi::AnyBuffer* w, ffi::AnyBuffer* y, ffi::AnyBuffer* staging,
                  ffi::AnyBuffer* ws, int64_t set_id, int32_t algo, bool tf32,
                  int32_t reduce_blocks, int32_t splits = 1, bool split_cols = false) {
  std::shared_ptr<Communicator> hold;
  Communicator* c = nullptr;
  if (auto e = Lookup(op, set_id, device, &hold, &c); e.failure()) return e;
  GemmRsArgs a;
  if (auto e = DecodeRs(op, c, x, w, y, staging, ws, algo, tf32, reduce_blocks, &a, splits,
                        split_cols);
      e.failure()) {
    return e;
  }
  if (a.M == 0 || a.n == 0) return ffi::Error::Success();
  if (a.w != nullptr && a.k == 0) {
    // x @ w over an empty inner dimension: its reduce-scatter is zeros (no op, no epoch).
    if (cudaMemsetAsync(a.y, 0, y->size_bytes(), stream) != cudaSuccess) {
      cudaGetLastError();
      return Check(op, *c, false, "cudaMemsetAsync of the result failed");
    }
    return ffi::Error::Success();
  }
  return Run(op, device, c, GemmRs(c, a, stream));
}

ffi::Error GemmRsExecute(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer w,
                         ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> staging,
                         ffi::Result<ffi::AnyBuffer> ws, int64_t set_id, int32_t algo, bool tf32,
                         int32_t reduce_blocks, int32_t splits, bool split_cols) {
  return RsImpl("matmul_reduce_scatter", stream, device, x, &w, &*y, &*staging, &*ws, set_id,
                algo, tf32, reduce_blocks, splits, split_cols);
}

ffi::Error ReduceScatterExecute(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                                ffi::Result<ffi::AnyBuffer> y, int64_t set_id, int32_t algo,
                                int32_t reduce_blocks, int32_t splits) {
  return RsImpl("reduce_scatter", stream, device, x, nullptr, &*y, nullptr, nullptr, set_id, algo,
                false, reduce_blocks, splits);
}

// Bulk overlap: collective of x (all-gather: out [world*m, k]; reduce-scatter: out [M/world, n])
// under the independent GEMM gy = ga @ gb.
ffi::Error BulkExecute(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer ga,
                       ffi::AnyBuffer gb, ffi::Result<ffi::AnyBuffer> out,
                       ffi::Result<ffi::AnyBuffer> gy, ffi::Result<ffi::AnyBuffer> ws,
                       int64_t set_id, int32_t kind, int32_t algo, bool tf32,
                       int32_t side_sms, int64_t side_rows) {
  const char* op = kind == 1 ? "bulk_reduce_scatter" : "bulk_all_gather";
  std::shared_ptr<Communicator> hold;
  Communicator* c = nullptr;
  if (auto e = Lookup(op, set_id, device, &hold, &c); e.failure()) return e;
  BulkArgs a;
  a.reduce_scatter = kind == 1;
  const int sms = side_sms > 0 && side_sms < c->sms() ? side_sms : 0;
  if (a.reduce_scatter) {
    if (auto e = DecodeRs(op, c, x, nullptr, &*out, nullptr, nullptr, algo, false, 4 * sms,
                          &a.rs);
        e.failure()) {
      return e;
    }
  } else if (auto e = DecodeAg(op, c, x, nullptr, nullptr, &*out, nullptr, algo, false, &a.ag);
             e.failure()) {
    return e;
  }
  if (!a.reduce_scatter) a.ag.copy_blocks = sms;
  const auto ad = ga.dimensions(), bd = gb.dimensions(), yd = gy->dimensions();
  DType gt;
  if (auto e = Check(op, *c,
                     ad.size() == 2 && bd.size() == 2 && yd.size() == 2 && ad[1] == bd[0] &&
                         yd[0] == ad[0] && yd[1] == bd[1] &&
                         ga.element_type() == gb.element_type() &&
                         gy->element_type() == ga.element_type() &&
                         ToDType(ga.element_type(), &gt),
                     StrCat() << "the GEMM operands must be a[m, k] @ b[k, n] -> [m, n] of one "
                                 "float dtype; got a "
                              << Describe(ga) << ", b " << Describe(gb) << ", result "
                              << Describe(*gy));
      e.failure()) {
    return e;
  }
  if (ad[1] == 0 && gy->size_bytes() > 0) {
    // a @ b over an empty inner dimension: zeros (the collective still runs).
    if (cudaMemsetAsync(gy->untyped_data(), 0, gy->size_bytes(), stream) != cudaSuccess) {
      cudaGetLastError();
      return Check(op, *c, false, "cudaMemsetAsync of the GEMM result failed");
    }
  }
  a.gemm = RowGemm::Make(gt, tf32, ad[1], bd[1], gb.untyped_data(), ws->untyped_data(),
                         ws->size_bytes());
  a.gemm_side = RowGemm::Make(gt, tf32, ad[1], bd[1], gb.untyped_data(), ws->untyped_data(),
                              ws->size_bytes(), sms > 0 ? c->sms() - sms : 0);
  a.ga = ga.untyped_data();
  a.gm = ad[0] > 0 && ad[1] > 0 && bd[1] > 0 ? ad[0] : 0;
  a.side_rows = sms > 0 ? side_rows : 0;
  a.gy = gy->untyped_data();
  return Run(op, device, c, Bulk(c, a, stream));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxUbBulk, BulkExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
                                  .Ctx<ffi::DeviceOrdinal>()     // selects the communicator
                                  .Arg<ffi::AnyBuffer>()         // x: collective input
                                  .Arg<ffi::AnyBuffer>()         // a: [m, k] GEMM operand
                                  .Arg<ffi::AnyBuffer>()         // b: [k, n] GEMM operand
                                  .Ret<ffi::AnyBuffer>()         // collective result
                                  .Ret<ffi::AnyBuffer>()         // a @ b
                                  .Ret<ffi::AnyBuffer>()         // cuBLASLt workspace (u8)
                                  .Attr<int64_t>("set_id")       // jax_ub.initialize() set
                                  .Attr<int32_t>("kind")         // 0 all-gather, 1 reduce-scatter
                                  .Attr<int32_t>("algo")         // AgAlgo / RsAlgo
                                  .Attr<bool>("tf32")            // float32 GEMM may use TF32
                                  .Attr<int32_t>("side_sms")     // SMs left to the collective
                                  .Attr<int64_t>("side_rows"));  // by the GEMM's first rows

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxUbAgGemm, AgGemmExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
                                  .Ctx<ffi::DeviceOrdinal>()     // selects the communicator
                                  .Arg<ffi::AnyBuffer>()         // x: [m, k] local shard
                                  .Arg<ffi::AnyBuffer>()         // w: [k, n]
                                  .Ret<ffi::AnyBuffer>()         // y: [world*m, n]
                                  .Ret<ffi::AnyBuffer>()         // xg: [world*m, k] gathered x
                                  .Ret<ffi::AnyBuffer>()         // cuBLASLt workspace (u8)
                                  .Attr<int64_t>("set_id")       // jax_ub.initialize() set
                                  .Attr<int32_t>("algo")         // AgAlgo: 0 ring, 1 all_peer, 2 push
                                  .Attr<bool>("tf32")            // float32 may use TF32
                                  .Attr<int32_t>("pieces")       // push: row pieces of the last chunk
                                  .Attr<bool>("merge"));         // push: peers' chunks in <= 2 GEMMs

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxUbAllGather, AllGatherExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
                                  .Ctx<ffi::DeviceOrdinal>()     // selects the communicator
                                  .Arg<ffi::AnyBuffer>()         // x: [m, k] local shard
                                  .Ret<ffi::AnyBuffer>()         // xg: [world*m, k]
                                  .Attr<int64_t>("set_id")       // jax_ub.initialize() set
                                  .Attr<int32_t>("algo"));       // AgAlgo

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxUbGemmRs, GemmRsExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
                                  .Ctx<ffi::DeviceOrdinal>()     // selects the communicator
                                  .Arg<ffi::AnyBuffer>()         // x: [M, k] local
                                  .Arg<ffi::AnyBuffer>()         // w: [k, n]
                                  .Ret<ffi::AnyBuffer>()         // y: [M/world, n]
                                  .Ret<ffi::AnyBuffer>()         // staging for peers' partials
                                  .Ret<ffi::AnyBuffer>()         // cuBLASLt workspace (u8)
                                  .Attr<int64_t>("set_id")       // jax_ub.initialize() set
                                  .Attr<int32_t>("algo")         // RsAlgo: 0 ring, 1 pipeline, 2 chain, 3 columns
                                  .Attr<bool>("tf32")            // float32 may use TF32
                                  .Attr<int32_t>("reduce_blocks")  // blocks of the fp32 sum
                                  .Attr<int32_t>("splits")       // pieces per peer partial (1, 2; chain 1-4; columns 1-8)
                                  .Attr<bool>("split_cols"));    // chain: column pieces

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxUbReduceScatter, ReduceScatterExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
                                  .Ctx<ffi::DeviceOrdinal>()     // selects the communicator
                                  .Arg<ffi::AnyBuffer>()         // x: [M, n]
                                  .Ret<ffi::AnyBuffer>()         // y: [M/world, n]
                                  .Attr<int64_t>("set_id")       // jax_ub.initialize() set
                                  .Attr<int32_t>("algo")         // RsAlgo
                                  .Attr<int32_t>("reduce_blocks")  // blocks of the fp32 sum
                                  .Attr<int32_t>("splits"));     // row pieces, each summed on arrival (1-8)

}  // namespace jax_ub
