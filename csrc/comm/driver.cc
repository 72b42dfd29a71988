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
  JAX_UB_RETURN_IF_ERROR(Entry("cuStreamBatchMemOp", &d->StreamBatchMemOp));
  JAX_UB_RETURN_IF_ERROR(Entry("cuGetErrorString", &d->GetErrorString));
  JAX_UB_RETURN_IF_ERROR(Entry("cuMemCreate", &d->MemCreate));
  JAX_UB_RETURN_IF_ERROR(Entry("cuMemRelease", &d->MemRelease));
  JAX_UB_RETURN_IF_ERROR(Entry("cuMemAddressReserve", &d->MemAddressReserve));
  JAX_UB_RETURN_IF_ERROR(Entry("cuMemAddressFree", &d->MemAddressFree));
  JAX_UB_RETURN_IF_ERROR(Entry("cuMemMap", &d->MemMap));
  JAX_UB_RETURN_IF_ERROR(Entry("cuMemUnmap", &d->MemUnmap));
  JAX_UB_RETURN_IF_ERROR(Entry("cuMemSetAccess", &d->MemSetAccess));
  JAX_UB_RETURN_IF_ERROR(Entry("cuMemGetAllocationGranularity", &d->MemGetAllocationGranularity));
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
  CUresult r =
      d->StreamWaitValue64(reinterpret_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(addr),
                           value, CU_STREAM_WAIT_VALUE_GEQ);
  if (r != CUDA_SUCCESS) {
    return Status::Error(StrCat() << "cuStreamWaitValue64 failed: " << CuError(d, r));
  }
  return Status::Ok();
}

Status StreamWrite(cudaStream_t s, uint64_t* addr, uint64_t value) {
  const Driver* d = nullptr;
  JAX_UB_RETURN_IF_ERROR(GetDriver(&d));
  CUresult r =
      d->StreamWriteValue64(reinterpret_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(addr),
                            value, CU_STREAM_WRITE_VALUE_DEFAULT);
  if (r != CUDA_SUCCESS) {
    return Status::Error(StrCat() << "cuStreamWriteValue64 failed: " << CuError(d, r));
  }
  return Status::Ok();
}

CUstreamBatchMemOpParams* MemOps::Add() {
  if (n_ == kMax) {
    ++overflow_;
    return nullptr;
  }
  CUstreamBatchMemOpParams* p = &ops_[n_++];
  *p = {};
  return p;
}

void MemOps::WaitGeq(const uint64_t* addr, uint64_t value) {
  if (CUstreamBatchMemOpParams* p = Add()) {
    p->waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_64;
    p->waitValue.address = reinterpret_cast<CUdeviceptr>(addr);
    p->waitValue.value64 = value;
    p->waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
  }
}

void MemOps::Write(uint64_t* addr, uint64_t value) {
  if (CUstreamBatchMemOpParams* p = Add()) {
    p->writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
    p->writeValue.address = reinterpret_cast<CUdeviceptr>(addr);
    p->writeValue.value64 = value;
    p->writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
  }
}

Status MemOps::Enqueue(cudaStream_t s) {
  const int n = n_, over = overflow_;
  n_ = overflow_ = 0;
  if (over > 0) {
    return Status::Error(StrCat() << "a batch of " << (n + over) << " stream memory operations "
                                  << "exceeds its " << kMax << " slots");
  }
  if (n == 0) return Status::Ok();
  const Driver* d = nullptr;
  JAX_UB_RETURN_IF_ERROR(GetDriver(&d));
  CUresult r =
      d->StreamBatchMemOp(reinterpret_cast<CUstream>(s), static_cast<unsigned>(n), ops_, 0);
  if (r != CUDA_SUCCESS) {
    return Status::Error(StrCat() << "cuStreamBatchMemOp (" << n
                                  << " operations) failed: " << CuError(d, r));
  }
  return Status::Ok();
}

namespace {

CUmemAllocationProp Prop(int device) {
  CUmemAllocationProp p{};
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = device;
  return p;
}

Status Access(const Driver* d, const VmmAlloc& a, int device) {
  CUmemAccessDesc desc{};
  desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  desc.location.id = device;
  desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CUresult r = d->MemSetAccess(a.ptr, a.size, &desc, 1);
  if (r != CUDA_SUCCESS) {
    return Status::Error(StrCat() << "cuMemSetAccess(device " << device << " on GPU " << a.device
                                  << "'s buffer) failed: " << CuError(d, r));
  }
  return Status::Ok();
}

}  // namespace

Status VmmCreate(int device, size_t bytes, VmmAlloc* out) {
  const Driver* d = nullptr;
  JAX_UB_RETURN_IF_ERROR(GetDriver(&d));
  const CUmemAllocationProp prop = Prop(device);
  size_t gran = 0;
  CUresult r = d->MemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
  if (r != CUDA_SUCCESS || gran == 0) gran = size_t(2) << 20;
  VmmAlloc a;
  a.device = device;
  a.size = (bytes + gran - 1) / gran * gran;
  r = d->MemCreate(&a.handle, a.size, &prop, 0);
  if (r != CUDA_SUCCESS) {
    return Status::Error(StrCat() << "cuMemCreate(" << a.size << " bytes on GPU " << device
                                  << ") failed: " << CuError(d, r));
  }
  r = d->MemAddressReserve(&a.ptr, a.size, gran, 0, 0);
  if (r != CUDA_SUCCESS) {
    d->MemRelease(a.handle);
    return Status::Error(StrCat() << "cuMemAddressReserve(" << a.size
                                  << ") failed: " << CuError(d, r));
  }
  r = d->MemMap(a.ptr, a.size, 0, a.handle, 0);
  if (r != CUDA_SUCCESS) {
    d->MemAddressFree(a.ptr, a.size);
    d->MemRelease(a.handle);
    return Status::Error(StrCat() << "cuMemMap failed: " << CuError(d, r));
  }
  Status s = Access(d, a, device);
  if (!s.ok()) {
    VmmFree(&a);
    return s;
  }
  *out = a;
  return Status::Ok();
}

Status VmmGrant(const VmmAlloc& a, int peer_device) {
  const Driver* d = nullptr;
  JAX_UB_RETURN_IF_ERROR(GetDriver(&d));
  return Access(d, a, peer_device);
}

void VmmFree(VmmAlloc* a) {
  if (a->ptr == 0) return;
  const Driver* d = nullptr;
  if (!GetDriver(&d).ok()) return;
  d->MemUnmap(a->ptr, a->size);
  d->MemAddressFree(a->ptr, a->size);
  d->MemRelease(a->handle);
  *a = VmmAlloc();
}

}  // namespace jax_ub
