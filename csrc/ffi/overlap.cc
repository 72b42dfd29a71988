// FFI handlers of the overlap family (AG->GEMM, GEMM->RS and the bare collectives): decode,
// validate, look up this device's communicator, launch the schedule (overlap/). Python:
// jax_ub/overlap.py.
//
// None is kCmdBufferCompatible: each call advances a host-side epoch counter and registers its
// waits with the watchdog, which a CUDA graph would freeze.
#include "ffi/overlap.h"

#include <cstdint>
#include <memory>
#include <optional>

#include "ffi/overlap_decode.h"

namespace jax_ub {
namespace {

ffi::Error AgImpl(const char* op, cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                  const ffi::AnyBuffer* w, ffi::AnyBuffer* y, ffi::AnyBuffer* xg,
                  ffi::AnyBuffer* ws, int64_t set_id, int32_t algo, bool tf32, int32_t pieces = 1,
                  bool merge = false, const Scales& scales = Scales()) {
  std::shared_ptr<Communicator> hold;
  Communicator* c = nullptr;
  if (auto e = Lookup(op, set_id, device, &hold, &c); e.failure()) return e;
  AgGemmArgs a;
  if (auto e = DecodeAg(op, c, x, w, y, xg, ws, algo, tf32, &a, scales); e.failure()) return e;
  if (pieces < 1 || pieces > kMaxChainPieces || a.m % pieces != 0) {
    return Check(op, *c, false,
                 StrCat() << "pieces must be in [1, " << kMaxChainPieces
                          << "] and divide the local rows " << a.m << "; got " << pieces);
  }
  if (merge && (a.algo != AgAlgo::kPush || pieces != 1)) {
    return Check(op, *c, false,
                 StrCat() << "merge applies to the push algorithm without pieces; "
                             "got algorithm "
                          << algo << ", pieces " << pieces);
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
                         std::optional<ffi::AnyBuffer> x_scale,
                         std::optional<ffi::AnyBuffer> w_scale, ffi::Result<ffi::AnyBuffer> y,
                         ffi::Result<ffi::AnyBuffer> xg, ffi::Result<ffi::AnyBuffer> ws,
                         int64_t set_id, int32_t algo, bool tf32, int32_t pieces, bool merge,
                         bool fast_accum) {
  return AgImpl("all_gather_matmul", stream, device, x, &w, &*y, &*xg, &*ws, set_id, algo, tf32,
                pieces, merge, Scales{x_scale, w_scale, fast_accum});
}

ffi::Error AllGatherExecute(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                            ffi::Result<ffi::AnyBuffer> xg, int64_t set_id, int32_t algo) {
  return AgImpl("all_gather", stream, device, x, nullptr, nullptr, &*xg, nullptr, set_id, algo,
                false);
}

ffi::Error RsImpl(const char* op, cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                  const ffi::AnyBuffer* w, ffi::AnyBuffer* y, ffi::AnyBuffer* staging,
                  ffi::AnyBuffer* ws, int64_t set_id, int32_t algo, bool tf32,
                  int32_t reduce_blocks, int32_t splits = 1, bool split_cols = false,
                  const Scales& scales = Scales()) {
  std::shared_ptr<Communicator> hold;
  Communicator* c = nullptr;
  if (auto e = Lookup(op, set_id, device, &hold, &c); e.failure()) return e;
  GemmRsArgs a;
  if (auto e = DecodeRs(op, c, x, w, y, staging, ws, algo, tf32, reduce_blocks, &a, splits,
                        split_cols, scales);
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
                         std::optional<ffi::AnyBuffer> x_scale,
                         std::optional<ffi::AnyBuffer> w_scale, ffi::Result<ffi::AnyBuffer> y,
                         ffi::Result<ffi::AnyBuffer> staging, ffi::Result<ffi::AnyBuffer> ws,
                         int64_t set_id, int32_t algo, bool tf32, int32_t reduce_blocks,
                         int32_t splits, bool split_cols, bool fast_accum) {
  return RsImpl("matmul_reduce_scatter", stream, device, x, &w, &*y, &*staging, &*ws, set_id, algo,
                tf32, reduce_blocks, splits, split_cols, Scales{x_scale, w_scale, fast_accum});
}

ffi::Error ReduceScatterExecute(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                                ffi::Result<ffi::AnyBuffer> y, int64_t set_id, int32_t algo,
                                int32_t reduce_blocks, int32_t splits) {
  return RsImpl("reduce_scatter", stream, device, x, nullptr, &*y, nullptr, nullptr, set_id, algo,
                false, reduce_blocks, splits);
}

}  // namespace

// clang-format off: the Bind() slots and their comments as a table
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxUbAgGemm, AgGemmExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
                                  .Ctx<ffi::DeviceOrdinal>()     // selects the communicator
                                  .Arg<ffi::AnyBuffer>()         // x: [m, k] local shard
                                  .Arg<ffi::AnyBuffer>()         // w: [k, n] (float8: [n, k])
                                  .OptionalArg<ffi::AnyBuffer>()  // float8: x's f32 scale
                                  .OptionalArg<ffi::AnyBuffer>()  // float8: w's f32 scale
                                  .Ret<ffi::AnyBuffer>()         // y: [world*m, n]
                                  .Ret<ffi::AnyBuffer>()         // xg: [world*m, k] gathered x
                                  .Ret<ffi::AnyBuffer>()         // cuBLASLt workspace (u8)
                                  .Attr<int64_t>("set_id")       // jax_ub.initialize() set
                                  .Attr<int32_t>("algo")         // AgAlgo (ring, all_peer, push)
                                  .Attr<bool>("tf32")            // float32 may use TF32
                                  .Attr<int32_t>("pieces")       // push: row pieces of last chunk
                                  .Attr<bool>("merge")           // push: peers' chunks, <= 2 GEMMs
                                  .Attr<bool>("fast_accum"));    // float8: fast accumulation
// clang-format on

// clang-format off: the Bind() slots and their comments as a table
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxUbAllGather, AllGatherExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
                                  .Ctx<ffi::DeviceOrdinal>()     // selects the communicator
                                  .Arg<ffi::AnyBuffer>()         // x: [m, k] local shard
                                  .Ret<ffi::AnyBuffer>()         // xg: [world*m, k]
                                  .Attr<int64_t>("set_id")       // jax_ub.initialize() set
                                  .Attr<int32_t>("algo"));       // AgAlgo
// clang-format on

// clang-format off: the Bind() slots and their comments as a table
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxUbGemmRs, GemmRsExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
                                  .Ctx<ffi::DeviceOrdinal>()     // selects the communicator
                                  .Arg<ffi::AnyBuffer>()         // x: [M, k] local
                                  .Arg<ffi::AnyBuffer>()         // w: [k, n] (float8: [n, k])
                                  .OptionalArg<ffi::AnyBuffer>()  // float8: x's f32 scale
                                  .OptionalArg<ffi::AnyBuffer>()  // float8: w's f32 scale
                                  .Ret<ffi::AnyBuffer>()         // y: [M/world, n]
                                  .Ret<ffi::AnyBuffer>()         // staging for peers' partials
                                  .Ret<ffi::AnyBuffer>()         // cuBLASLt workspace (u8)
                                  .Attr<int64_t>("set_id")       // jax_ub.initialize() set
                                  .Attr<int32_t>("algo")         // RsAlgo (ring, ..., columns)
                                  .Attr<bool>("tf32")            // float32 may use TF32
                                  .Attr<int32_t>("reduce_blocks")  // blocks of the fp32 sum
                                  .Attr<int32_t>("splits")       // per peer partial: 1-2,
                                                                 // chain 1-4, columns 1-8
                                  .Attr<bool>("split_cols")      // chain: column pieces
                                  .Attr<bool>("fast_accum"));    // float8: fast accumulation
// clang-format on

// clang-format off: the Bind() slots and their comments as a table
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxUbReduceScatter, ReduceScatterExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
                                  .Ctx<ffi::DeviceOrdinal>()     // selects the communicator
                                  .Arg<ffi::AnyBuffer>()         // x: [M, n]
                                  .Ret<ffi::AnyBuffer>()         // y: [M/world, n]
                                  .Attr<int64_t>("set_id")       // jax_ub.initialize() set
                                  .Attr<int32_t>("algo")         // RsAlgo
                                  .Attr<int32_t>("reduce_blocks")  // blocks of the fp32 sum
                                  .Attr<int32_t>("splits"));     // row pieces, each summed on
// clang-format on
// arrival (1-8)

}  // namespace jax_ub
