// Helpers shared by the FFI handlers: Status -> ffi::Error, XLA dtype -> jax_ub::DType.
#pragma once

#include <optional>
#include <string>

#include "common/status.h"
#include "gemm/cublaslt.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ub {

namespace ffi = ::xla::ffi;

inline ffi::Error ToFfi(const char* op, int device, const Status& s) {
  if (s.ok()) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kInternal,
                    StrCat() << "jax_ub " << op << " (device " << device << "): " << s.message());
}

inline ffi::Error InvalidArgument(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, msg);
}

// Maps an XLA element type to jax_ub's; false for unsupported types. FP8 types map too: each
// handler says where it takes them.
inline bool ToDType(ffi::DataType t, DType* out) {
  switch (t) {
    case ffi::DataType::F32: *out = DType::kF32; return true;
    case ffi::DataType::F16: *out = DType::kF16; return true;
    case ffi::DataType::BF16: *out = DType::kBF16; return true;
    case ffi::DataType::F8E4M3FN: *out = DType::kE4M3; return true;
    case ffi::DataType::F8E5M2: *out = DType::kE5M2; return true;
    default: return false;
  }
}

// "bfloat16", "float8_e4m3fn", ..., else "element type N": for messages.
inline std::string TypeName(ffi::DataType t) {
  DType d;
  if (ToDType(t, &d)) return DTypeName(d);
  return StrCat() << "element type " << static_cast<int>(t);
}

// "[a, b, c] bfloat16": a buffer's shape and type, for messages.
inline std::string Describe(const ffi::AnyBuffer& b) {
  StrCat out;
  out << "[";
  const auto d = b.dimensions();
  for (size_t i = 0; i < d.size(); ++i) out << (i ? ", " : "") << d[i];
  out << "] " << TypeName(b.element_type());
  return out;
}

}  // namespace jax_ub

namespace jax_ub {

// The FP8 form's scales: absent (a GEMM of one float type), or both present as float32 scalars.
// Sets *a_scale / *b_scale to their device pointers; `what` names the op for the messages.
inline ffi::Error DecodeScales(const char* what, bool fp8, const std::optional<ffi::AnyBuffer>& sa,
                               const std::optional<ffi::AnyBuffer>& sb, const float** a_scale,
                               const float** b_scale) {
  *a_scale = *b_scale = nullptr;
  if (!fp8) {
    if (sa.has_value() || sb.has_value()) {
      return InvalidArgument(StrCat() << what
                                      << ": scales are for float8 operands only; the operands "
                                         "are not float8 but scales were given");
    }
    return ffi::Error::Success();
  }
  if (!sa.has_value() || !sb.has_value()) {
    return InvalidArgument(StrCat() << what
                                    << ": float8 operands need two float32 scales (expected 2 "
                                       "scale operands, received "
                                    << sa.has_value() + sb.has_value() << ")");
  }
  for (const ffi::AnyBuffer* s : {&*sa, &*sb}) {
    if (s->element_type() != ffi::DataType::F32 || s->element_count() != 1) {
      return InvalidArgument(StrCat()
                             << what << ": each scale must be one float32 (shape ()); received "
                             << Describe(*s));
    }
  }
  *a_scale = static_cast<const float*>(sa->untyped_data());
  *b_scale = static_cast<const float*>(sb->untyped_data());
  return ffi::Error::Success();
}

}  // namespace jax_ub
