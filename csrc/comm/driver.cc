#include "comm/driver.h"

#include <mutex>

namespace jax_ub {
namespace {

template <typename Fn>
Status Entry(const char* name, Fn* out) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
  cudaError_t err = cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &q);
#else
  cudaError_t err = cudaGetDriverEntryPoint(name, &fn, cudaEnableDefault, &q);
#endif
  if (err != cudaSuccess || q != cudaDriverEntryPointSuccess || fn == nullptr) {
    return Status::Error(StrCat() << "CUDA driver entry point " << name << " unavailable ("
                                  << cudaGetErrorString(err) << ", query result " << int(q)
                                  << "); is the NVIDIA driver >= 525 installed?");
  }
  *out = reinterpret_cast<Fn>(fn);
  return Status::Ok();
}

Status Load(Driver* d) {
  JAX_UB_RETURN_IF_ERROR(Entry("cuStreamWaitValue64", &d->StreamWaitValue64));
  JAX_UB_RETURN_IF_ERROR(Entry("cuStreamWriteValue64", &d->StreamWriteValue64));
  JAX_UB_RETURN_IF_ERROR(Entry("cuGetErrorString", &d->GetErrorString));
  return Status::Ok();
}

std::string CuError(const Driver* d, CUresult r) {
  const char* s = nullptr;
  if (d->GetErrorString != nullptr) d->GetErrorString(r, &s);
  return StrCat() << (s ? s : "unknown CUDA driver error") << " (" << int(r) << ")";
}

}  // namespace

Status GetDriver(const Driver** out) {
  static Driver* driver = nullptr;
  static Status status;
  static std::once_flag once;
  std::call_once(once, [] {
    auto* d = new Driver();
    status = Load(d);
    driver = d;
  });
  *out = driver;
  return status;
}

Status StreamWaitGeq(cudaStream_t s, const uint64_t* addr, uint64_t value) {
  const Driver* d = nullptr;
  JAX_UB_RETURN_IF_ERROR(GetDriver(&d));
  CUresult r = d->StreamWaitValue64(reinterpret_cast<CUstream>(s),
                                    reinterpret_cast<CUdeviceptr>(addr), value,
                                    CU_STREAM_WAIT_VALUE_GEQ);
  if (r != CUDA_SUCCESS) {
    return Status::Error(StrCat() << "cuStreamWaitValue64 failed: " << CuError(d, r));
  }
  return Status::Ok();
}

Status StreamWrite(cudaStream_t s, uint64_t* addr, uint64_t value) {
  const Driver* d = nullptr;
  JAX_UB_RETURN_IF_ERROR(GetDriver(&d));
  CUresult r = d->StreamWriteValue64(reinterpret_cast<CUstream>(s),
                                     reinterpret_cast<CUdeviceptr>(addr), value,
                                     CU_STREAM_WRITE_VALUE_DEFAULT);
  if (r != CUDA_SUCCESS) {
    return Status::Error(StrCat() << "cuStreamWriteValue64 failed: " << CuError(d, r));
  }
  return Status::Ok();
}

}  // namespace jax_ub
