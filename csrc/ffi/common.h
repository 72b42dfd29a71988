// Helpers shared by the FFI handlers: Status -> ffi::Error, XLA dtype -> jax_ub::DType.
#pragma once

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

// Maps an XLA element type to jax_ub's; false for unsupported types.
inline bool ToDType(ffi::DataType t, DType* out) {
  switch (t) {
    case ffi::DataType::F32: *out = DType::kF32; return true;
    case ffi::DataType::F16: *out = DType::kF16; return true;
    case ffi::DataType::BF16: *out = DType::kBF16; return true;
    default: return false;
  }
}

// "bfloat16", "float16", "float32", else "element type N": for messages.
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
