// The nanobind module _jax_ub_cuda: the registry of FFI handlers (one entry per custom-call target,
// registered for platform CUDA by jax_ub/_ext.py) and small host-side queries. No GPU work happens
// at import.
#include <cuda_runtime_api.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include "common/dynlib.h"
#include "ffi/gemm.h"
#include "gemm/cublaslt.h"

namespace nb = nanobind;

namespace jax_ub {
bool CublasLtApiChecked();
}

namespace {

template <typename Fn>
nb::capsule Capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

nb::dict Registrations() {
  nb::dict d;
  // target name -> execute-stage handler capsule; jax_ub/_ext.py registers every entry.
  d["jax_ub_gemm"] = Capsule(JaxUbGemm);
  return d;
}

nb::dict BuildInfo() {
  nb::dict d;
  d["cuda_runtime_version"] = CUDART_VERSION;
  d["cublaslt_api_checked"] = jax_ub::CublasLtApiChecked();
#ifdef JAX_UB_CUDA_ARCHS
  d["cuda_archs"] = std::string(JAX_UB_CUDA_ARCHS);
#endif
#ifdef JAX_UB_NVCC_VERSION
  d["nvcc_version"] = std::string(JAX_UB_NVCC_VERSION);
#endif
  return d;
}

// Driver and devices as seen by the CUDA runtime; never raises.
nb::dict RuntimeInfo() {
  nb::dict d;
  int driver = 0;
  cudaError_t err = cudaDriverGetVersion(&driver);
  d["driver_version"] = err == cudaSuccess ? driver : 0;
  int count = 0;
  err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    d["device_count"] = 0;
    d["error"] = std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
    cudaGetLastError();
    return d;
  }
  d["device_count"] = count;
  return d;
}

}  // namespace

NB_MODULE(_jax_ub_cuda, m) {
  m.doc() = "jax_ub CUDA extension: XLA FFI handlers for overlapped TP GEMM/communication.";
  m.def("registrations", &Registrations, "FFI target name -> {stage: PyCapsule}");
  m.def("build_info", &BuildInfo, "How this extension was compiled.");
  m.def("runtime_info", &RuntimeInfo, "CUDA driver version and device count (no exceptions).");
  m.def("set_library_candidates", &jax_ub::SetLibraryCandidates, nb::arg("lib"), nb::arg("paths"),
        "Paths to try, in order, when dlopen()ing `lib` ('cublasLt' or 'nccl').");
  m.def("cublaslt_description", &jax_ub::CublasLtDescription,
        "Loads cuBLASLt if needed and says which library is used, or why it cannot be loaded.");
  m.def("gemm_plan_cache_size", &jax_ub::GemmPlanCacheSize);
}
