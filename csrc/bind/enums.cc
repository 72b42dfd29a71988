// enums(): the integers Python passes to (or reads from) the extension, by name, built from the
// C++ enums' own lists (common/enums.h), so that jax_ub's Python side need not copy them.
#include <nanobind/nanobind.h>

#include "bind/bind.h"
#include "comm/test_hooks.h"
#include "gemm/cublaslt.h"
#include "overlap/ag_gemm.h"
#include "overlap/bulk.h"
#include "overlap/gemm_rs.h"

namespace jax_ub {
namespace {

#define JAX_UB_ENUM_ITEM(name, text, value) d[text] = value;

nb::dict Enums() {
  nb::dict out;
  {
    nb::dict d;
    JAX_UB_AG_ALGORITHMS(JAX_UB_ENUM_ITEM)
    out["ag_algorithm"] = d;  // FFI attribute `algo` of the all-gather ops (AgAlgo)
  }
  {
    nb::dict d;
    JAX_UB_RS_ALGORITHMS(JAX_UB_ENUM_ITEM)
    out["rs_algorithm"] = d;  // FFI attribute `algo` of the reduce-scatter ops (RsAlgo)
  }
  {
    nb::dict d;
    JAX_UB_BULK_KINDS(JAX_UB_ENUM_ITEM)
    out["bulk_kind"] = d;  // FFI attribute `kind` of jax_ub_bulk (BulkKind)
  }
  {
    nb::dict d;
    JAX_UB_DTYPES(JAX_UB_ENUM_ITEM)
    out["dtype"] = d;  // gemm_warmup's `dtype` (DType; FP8 pairs: GemmTypes::Code)
  }
  {
    nb::dict d;
    JAX_UB_FAILURES(JAX_UB_ENUM_ITEM)
    out["failure"] = d;  // comm_inject_failure's `what` (Failure)
  }
  return out;
}

#undef JAX_UB_ENUM_ITEM

}  // namespace

void BindEnums(nb::module_& m) {
  m.def("enums", &Enums,
        "{enum: {name: value}} for every integer the extension takes from Python: ag_algorithm, "
        "rs_algorithm (FFI attribute algo), bulk_kind (jax_ub_bulk's kind), dtype (gemm_warmup), "
        "failure (comm_inject_failure's what).");
}

}  // namespace jax_ub
