// FFI handlers of the overlap family: decode, validate, look up this device's communicator,
// launch the schedule (overlap/). Python: jax_ub/overlap.py.
//
// None is kCmdBufferCompatible: each call advances a host-side epoch counter and registers its
// waits with the watchdog, which a CUDA graph would freeze.
#include "ffi/overlap.h"

#include <cstdint>

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

ffi::Error Lookup(const char* op, int64_t set_id, int32_t device, Communicator** out) {
  if (cudaSetDevice(device) != cudaSuccess) {
    cudaGetLastError();
    return InvalidArgument(StrCat() << "jax_ub " << op << ": cannot select device " << device);
  }
  *out = RegistryGet(static_cast<int>(set_id), device);
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

ffi::Error AgImpl(const char* op, cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                  const ffi::AnyBuffer* w, ffi::AnyBuffer* y, ffi::AnyBuffer* xg,
                  ffi::AnyBuffer* ws, int64_t set_id, int32_t algo, bool tf32) {
  Communicator* c = nullptr;
  if (auto e = Lookup(op, set_id, device, &c); e.failure()) return e;
  DType t;
  if (!ToDType(x.element_type(), &t)) {
    return Check(op, *c, false, "x must be float32, float16 or bfloat16");
  }
  const Rows xr = Fold(x.dimensions());
  const Rows gr = Fold(xg->dimensions());
  const int world = c->world();
  if (auto e = Check(op, *c, gr.rows == xr.rows * world && gr.cols == xr.cols,
                     StrCat() << "gathered result has " << gr.rows << "x" << gr.cols
                              << ", expected " << xr.rows * world << "x" << xr.cols);
      e.failure()) {
    return e;
  }
  AgGemmArgs a;
  a.dtype = t;
  a.tf32 = tf32;
  a.algo = static_cast<AgAlgo>(algo);
  a.x = x.untyped_data();
  a.m = xr.rows;
  a.k = xr.cols;
  a.xg = xg->untyped_data();
  if (w != nullptr) {
    const auto wd = w->dimensions();
    const Rows yr = Fold(y->dimensions());
    if (auto e = Check(op, *c,
                       wd.size() == 2 && wd[0] == xr.cols && w->element_type() == x.element_type() &&
                           yr.rows == xr.rows * world && yr.cols == wd[1],
                       StrCat() << "w must be [" << xr.cols << ", n] of x's dtype and y ["
                                << xr.rows * world << ", n]");
        e.failure()) {
      return e;
    }
    a.w = w->untyped_data();
    a.n = wd[1];
    a.y = y->untyped_data();
    a.workspace = ws->untyped_data();
    a.workspace_bytes = ws->size_bytes();
  }
  if (a.m == 0 || a.k == 0) return ffi::Error::Success();
  return ToFfi(op, device, [&] {
    Status s = AgGemm(c, a, stream);
    return s.ok() ? s : Status::Error(Where(*c, op) + ": " + s.message());
  }());
}

ffi::Error AgGemmExecute(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer w,
                         ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> xg,
                         ffi::Result<ffi::AnyBuffer> ws, int64_t set_id, int32_t algo,
                         bool tf32) {
  return AgImpl("all_gather_matmul", stream, device, x, &w, &*y, &*xg, &*ws, set_id, algo, tf32);
}

ffi::Error AllGatherExecute(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                            ffi::Result<ffi::AnyBuffer> xg, int64_t set_id, int32_t algo) {
  return AgImpl("all_gather", stream, device, x, nullptr, nullptr, &*xg, nullptr, set_id, algo,
                false);
}

ffi::Error RsImpl(const char* op, cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                  const ffi::AnyBuffer* w, ffi::AnyBuffer* y, ffi::AnyBuffer* staging,
                  ffi::AnyBuffer* ws, int64_t set_id, int32_t algo, bool tf32,
                  int32_t reduce_blocks) {
  Communicator* c = nullptr;
  if (auto e = Lookup(op, set_id, device, &c); e.failure()) return e;
  DType t;
  if (!ToDType(x.element_type(), &t)) {
    return Check(op, *c, false, "x must be float32, float16 or bfloat16");
  }
  const Rows xr = Fold(x.dimensions());
  const Rows yr = Fold(y->dimensions());
  const int world = c->world();
  const int64_t n = w != nullptr ? (w->dimensions().size() == 2 ? w->dimensions()[1] : -1)
                                 : xr.cols;
  if (auto e = Check(op, *c, xr.rows % world == 0 && yr.rows * world == xr.rows && yr.cols == n,
                     StrCat() << "x has " << xr.rows << " rows (must be divisible by " << world
                              << ") and the result " << yr.rows << "x" << yr.cols
                              << ", expected " << xr.rows / world << "x" << n);
      e.failure()) {
    return e;
  }
  GemmRsArgs a;
  a.dtype = t;
  a.tf32 = tf32;
  a.algo = static_cast<RsAlgo>(algo);
  a.x = x.untyped_data();
  a.M = xr.rows;
  a.k = w != nullptr ? xr.cols : 0;
  a.n = n;
  a.y = y->untyped_data();
  a.reduce_blocks = reduce_blocks;
  if (w != nullptr) {
    const auto wd = w->dimensions();
    if (auto e = Check(op, *c, wd[0] == xr.cols && w->element_type() == x.element_type(),
                       StrCat() << "w must be [" << xr.cols << ", n] of x's dtype");
        e.failure()) {
      return e;
    }
    const size_t need = static_cast<size_t>(world - 1) * (xr.rows / world) * n * DTypeSize(t);
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
  if (a.M == 0 || a.n == 0) return ffi::Error::Success();
  return ToFfi(op, device, [&] {
    Status s = GemmRs(c, a, stream);
    return s.ok() ? s : Status::Error(Where(*c, op) + ": " + s.message());
  }());
}

ffi::Error GemmRsExecute(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer w,
                         ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> staging,
                         ffi::Result<ffi::AnyBuffer> ws, int64_t set_id, int32_t algo, bool tf32,
                         int32_t reduce_blocks) {
  return RsImpl("matmul_reduce_scatter", stream, device, x, &w, &*y, &*staging, &*ws, set_id,
                algo, tf32, reduce_blocks);
}

ffi::Error ReduceScatterExecute(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                                ffi::Result<ffi::AnyBuffer> y, int64_t set_id, int32_t algo,
                                int32_t reduce_blocks) {
  return RsImpl("reduce_scatter", stream, device, x, nullptr, &*y, nullptr, nullptr, set_id, algo,
                false, reduce_blocks);
}

}  // namespace

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
                                  .Attr<int32_t>("algo")         // AgAlgo: 0 ring, 1 all_peer
                                  .Attr<bool>("tf32"));          // float32 may use TF32

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
                                  .Attr<int32_t>("algo")         // RsAlgo: 0 ring, 1 pipeline
                                  .Attr<bool>("tf32")            // float32 may use TF32
                                  .Attr<int32_t>("reduce_blocks"));  // blocks of the fp32 sum

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxUbReduceScatter, ReduceScatterExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
                                  .Ctx<ffi::DeviceOrdinal>()     // selects the communicator
                                  .Arg<ffi::AnyBuffer>()         // x: [M, n]
                                  .Ret<ffi::AnyBuffer>()         // y: [M/world, n]
                                  .Attr<int64_t>("set_id")       // jax_ub.initialize() set
                                  .Attr<int32_t>("algo")         // RsAlgo
                                  .Attr<int32_t>("reduce_blocks"));  // blocks of the fp32 sum

}  // namespace jax_ub
