// FFI handler of the bulk family: a bare collective under an independent GEMM, in one op
// (overlap/bulk.h). Python: jax_ub/bulk.py.
//
// Not kCmdBufferCompatible: each call advances a host-side epoch counter and registers its waits
// with the watchdog, which a CUDA graph would freeze.
#include "ffi/bulk.h"

#include <cstdint>
#include <memory>

#include "ffi/overlap_decode.h"
#include "overlap/bulk.h"

namespace jax_ub {
namespace {

// Bulk overlap: collective of x (all-gather: out [world*m, k]; reduce-scatter: out [M/world, n])
// under the independent GEMM gy = ga @ gb.
ffi::Error BulkExecute(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer ga,
                       ffi::AnyBuffer gb, ffi::Result<ffi::AnyBuffer> out,
                       ffi::Result<ffi::AnyBuffer> gy, ffi::Result<ffi::AnyBuffer> ws,
                       int64_t set_id, int32_t kind, int32_t algo, bool tf32, int32_t side_sms,
                       int64_t side_rows) {
  const bool rs = kind == static_cast<int32_t>(BulkKind::kReduceScatter);
  const char* op = rs ? "bulk_reduce_scatter" : "bulk_all_gather";
  std::shared_ptr<Communicator> hold;
  Communicator* c = nullptr;
  if (auto e = Lookup(op, set_id, device, &hold, &c); e.failure()) return e;
  BulkArgs a;
  a.reduce_scatter = rs;
  const int sms = side_sms > 0 && side_sms < c->sms() ? side_sms : 0;
  if (a.reduce_scatter) {
    if (auto e = DecodeRs(op, c, x, nullptr, &*out, nullptr, nullptr, algo, false, 4 * sms, &a.rs);
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
  if (auto e =
          Check(op, *c,
                ad.size() == 2 && bd.size() == 2 && yd.size() == 2 && ad[1] == bd[0] &&
                    yd[0] == ad[0] && yd[1] == bd[1] && ga.element_type() == gb.element_type() &&
                    gy->element_type() == ga.element_type() && ToDType(ga.element_type(), &gt) &&
                    !IsFp8(gt),
                StrCat() << "the GEMM operands must be a[m, k] @ b[k, n] -> [m, n] of one "
                            "of float32, float16, bfloat16; got a "
                         << Describe(ga) << ", b " << Describe(gb) << ", result " << Describe(*gy));
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
  a.gemm = RowGemm::Make(GemmTypes::Same(gt), tf32, ad[1], bd[1], gb.untyped_data(),
                         ws->untyped_data(), ws->size_bytes());
  a.gemm_side = RowGemm::Make(GemmTypes::Same(gt), tf32, ad[1], bd[1], gb.untyped_data(),
                              ws->untyped_data(), ws->size_bytes(), sms > 0 ? c->sms() - sms : 0);
  a.ga = ga.untyped_data();
  a.gm = ad[0] > 0 && ad[1] > 0 && bd[1] > 0 ? ad[0] : 0;
  a.side_rows = sms > 0 ? side_rows : 0;
  a.gy = gy->untyped_data();
  return Run(op, device, c, Bulk(c, a, stream));
}

}  // namespace

// clang-format off: the Bind() slots and their comments as a table
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
                                  .Attr<int32_t>("kind")         // BulkKind (0 ag, 1 rs)
                                  .Attr<int32_t>("algo")         // AgAlgo / RsAlgo
                                  .Attr<bool>("tf32")            // float32 GEMM may use TF32
                                  .Attr<int32_t>("side_sms")     // SMs left to the collective
                                  .Attr<int64_t>("side_rows"));  // by the GEMM's first rows
// clang-format on

}  // namespace jax_ub
