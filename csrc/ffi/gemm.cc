// FFI handler of jax_ub.matmul and jax_ub.gemm.fp8_matmul: a row-major cuBLASLt GEMM on XLA's
// stream. Decodes and validates, then calls gemm/cublaslt. Python: jax_ub/gemm.py.
// The FP8 form: a [m, k] and b [n, k] float8 (trans_b), two float32 scale operands, a bfloat16
// or float32 result = a_scale * b_scale * (a @ b^T), with cuBLASLt's fast accumulation when the
// fast_accum attribute is set (false for the other types: Problem() refuses it).
#include "ffi/gemm.h"

#include <cstdint>
#include <optional>
#include <string>

#include "ffi/common.h"

namespace jax_ub {
namespace {

ffi::Error GemmExecute(cudaStream_t stream, int32_t device, ffi::AnyBuffer a, ffi::AnyBuffer b,
                       std::optional<ffi::AnyBuffer> a_scale, std::optional<ffi::AnyBuffer> b_scale,
                       ffi::Result<ffi::AnyBuffer> c, ffi::Result<ffi::AnyBuffer> workspace,
                       bool trans_a, bool trans_b, bool tf32, bool fast_accum) {
  GemmTypes types;
  types.fast_accum = fast_accum;
  if (!ToDType(a.element_type(), &types.a) || !ToDType(b.element_type(), &types.b) ||
      !ToDType(c->element_type(), &types.out)) {
    return InvalidArgument(StrCat()
                           << "jax_ub_gemm: a, b and the result must share one of "
                              "float32, float16, bfloat16, or be float8 operands with a "
                              "bfloat16 or float32 result; got a "
                           << Describe(a) << ", b " << Describe(b) << ", result " << Describe(*c));
  }
  if (const std::string bad = types.Problem(); !bad.empty()) {
    return InvalidArgument("jax_ub_gemm: " + bad);
  }
  if (types.fp8() && (trans_a || !trans_b)) {
    return InvalidArgument(StrCat() << "jax_ub_gemm: float8 operands must be a [m, k] and b "
                                       "[n, k] (both K-contiguous: expected trans_a=0, "
                                       "trans_b=1); received trans_a="
                                    << trans_a << ", trans_b=" << trans_b);
  }
  const float *sa = nullptr, *sb = nullptr;
  if (auto e = DecodeScales("jax_ub_gemm", types.fp8(), a_scale, b_scale, &sa, &sb); e.failure()) {
    return e;
  }
  auto ad = a.dimensions();
  auto bd = b.dimensions();
  auto cd = c->dimensions();
  if (ad.size() < 2 || bd.size() != 2 || cd.size() != ad.size() || (trans_a && ad.size() != 2)) {
    return InvalidArgument(StrCat() << "jax_ub_gemm: expected a [..., m, k] (2-D when trans_a), "
                                    << "b 2-D and c of a's rank; got ranks " << ad.size() << ", "
                                    << bd.size() << ", " << cd.size());
  }
  // Leading dims of a (and c) fold into m: row-major [..., m, k] is [prod(...)*m, k].
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < ad.size(); ++i) rows *= ad[i];
  const int64_t a_cols = ad[ad.size() - 1];
  const int64_t m = trans_a ? a_cols : rows;
  const int64_t k = trans_a ? rows : a_cols;
  const int64_t kb = trans_b ? bd[1] : bd[0];
  const int64_t n = trans_b ? bd[0] : bd[1];
  int64_t c_rows = 1;
  for (size_t i = 0; i + 1 < cd.size(); ++i) c_rows *= cd[i];
  if (kb != k || c_rows != m || cd[cd.size() - 1] != n) {
    return InvalidArgument(StrCat() << "jax_ub_gemm: shape mismatch: op(a) is [" << m << ", " << k
                                    << "], op(b) is [" << kb << ", " << n << "], c has " << c_rows
                                    << " rows and " << cd[cd.size() - 1] << " columns");
  }
  if (m == 0 || n == 0) return ffi::Error::Success();
  if (k == 0) {
    cudaError_t err = cudaMemsetAsync(c->untyped_data(), 0, c->size_bytes(), stream);
    return ToFfi("gemm", device,
                 err == cudaSuccess ? Status::Ok() : Status::Error(cudaGetErrorString(err)));
  }
  GemmArgs g;
  g.m = m;
  g.n = n;
  g.k = k;
  g.trans_a = trans_a;
  g.trans_b = trans_b;
  g.lda = a_cols;
  g.ldb = bd[1];
  g.ldc = n;
  g.types = types;
  g.tf32 = tf32;
  g.a_scale = sa;
  g.b_scale = sb;
  g.a = a.untyped_data();
  g.b = b.untyped_data();
  g.c = c->untyped_data();
  g.workspace = workspace->untyped_data();
  g.workspace_bytes = workspace->size_bytes();
  return ToFfi("gemm", device, Gemm(device, g, stream));
}

}  // namespace

// Not kCmdBufferCompatible: the plan lookup takes a host lock and may build a plan on first use,
// which must not be frozen into a CUDA graph.
// clang-format off: the Bind() slots and their comments as a table
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxUbGemm, GemmExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
                                  .Ctx<ffi::DeviceOrdinal>()        // process-local device
                                  .Arg<ffi::AnyBuffer>()            // a: [..., m, k] or [k, m]
                                  .Arg<ffi::AnyBuffer>()            // b: [k, n] or [n, k]
                                  .OptionalArg<ffi::AnyBuffer>()    // float8: a's f32 scale
                                  .OptionalArg<ffi::AnyBuffer>()    // float8: b's f32 scale
                                  .Ret<ffi::AnyBuffer>()            // c: [..., m, n]
                                  .Ret<ffi::AnyBuffer>()            // cuBLASLt workspace (u8)
                                  .Attr<bool>("trans_a")            // a is stored [k, m]
                                  .Attr<bool>("trans_b")            // b is stored [n, k]
                                  .Attr<bool>("tf32")               // allow TF32 for float32
                                  .Attr<bool>("fast_accum"));       // float8: fast accumulation
// clang-format on

}  // namespace jax_ub
