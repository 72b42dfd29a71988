// Decoding shared by the FFI handlers of the overlap family (ffi/overlap.cc, ffi/bulk.cc): the
// communicator lookup, argument checks that name the member, and the AG / RS buffers decoded into
// the schedules' arguments (overlap/).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "comm/communicator.h"
#include "ffi/common.h"
#include "overlap/ag_gemm.h"
#include "overlap/gemm_rs.h"

namespace jax_ub {

struct Rows {
  int64_t rows = 1;  // product of all but the last dim
  int64_t cols = 0;  // last dim
};

inline Rows Fold(const ffi::AnyBuffer::Dimensions& d) {
  Rows r;
  for (size_t i = 0; i + 1 < d.size(); ++i) r.rows *= d[i];
  r.cols = d.size() == 0 ? 0 : d[d.size() - 1];
  return r;
}

// `hold` keeps the communicator alive for the handler's call (a concurrent shutdown may destroy
// it; RunOp then refuses the op); `out` is its plain pointer.
ffi::Error Lookup(const char* op, int64_t set_id, int32_t device,
                  std::shared_ptr<Communicator>* hold, Communicator** out);

// kInvalidArgument naming the member and op where !ok.
ffi::Error Check(const char* op, const Communicator& c, bool ok, const std::string& what);

// The FP8 form's scale operands (absent for the other types) and its accumulation mode (the
// fast_accum attribute; FP8 only).
struct Scales {
  std::optional<ffi::AnyBuffer> x, w;
  bool fast_accum = false;
};

// Decodes and validates an AG op's buffers into `out` (w, y, ws null: all-gather only). FP8:
// x float8 (the all-gather moves its bytes; xg has x's type), w float8 stored [n, k], y bfloat16
// or float32, both scales given.
ffi::Error DecodeAg(const char* op, const Communicator* c, ffi::AnyBuffer x,
                    const ffi::AnyBuffer* w, ffi::AnyBuffer* y, ffi::AnyBuffer* xg,
                    ffi::AnyBuffer* ws, int32_t algo, bool tf32, AgGemmArgs* out,
                    const Scales& scales = Scales());

// Decodes and validates an RS op's buffers into `out` (w, staging, ws null: reduce-scatter only).
// FP8: x float8, w float8 stored [n, k], y (and the partials) bfloat16 or float32, both scales.
ffi::Error DecodeRs(const char* op, const Communicator* c, ffi::AnyBuffer x,
                    const ffi::AnyBuffer* w, ffi::AnyBuffer* y, ffi::AnyBuffer* staging,
                    ffi::AnyBuffer* ws, int32_t algo, bool tf32, int32_t reduce_blocks,
                    GemmRsArgs* out, int32_t splits = 1, bool split_cols = false,
                    const Scales& scales = Scales());

// A schedule's Status as the handler's result (kInternal naming the member and op).
ffi::Error Run(const char* op, int32_t device, Communicator* c, const Status& s);

}  // namespace jax_ub
