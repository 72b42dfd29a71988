// CUDA driver entry points that jax_ub needs, reached at run time through the runtime's
// cudaGetDriverEntryPoint (no -lcuda at link time: build machines have no libcuda).
#pragma once

#include <cuda.h>  // types only
#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/status.h"

namespace jax_ub {

struct Driver {
  CUresult (*StreamWaitValue64)(CUstream, CUdeviceptr, cuuint64_t, unsigned int) = nullptr;
  CUresult (*StreamWriteValue64)(CUstream, CUdeviceptr, cuuint64_t, unsigned int) = nullptr;
  CUresult (*StreamBatchMemOp)(CUstream, unsigned int, CUstreamBatchMemOpParams*,
                               unsigned int) = nullptr;
  CUresult (*GetErrorString)(CUresult, const char**) = nullptr;
  // Virtual memory management (buffers shared within one process without
  // cudaDeviceEnablePeerAccess).
  CUresult (*MemCreate)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*,
                        unsigned long long) = nullptr;
  CUresult (*MemRelease)(CUmemGenericAllocationHandle) = nullptr;
  CUresult (*MemAddressReserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr,
                                unsigned long long) = nullptr;
  CUresult (*MemAddressFree)(CUdeviceptr, size_t) = nullptr;
  CUresult (*MemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                     unsigned long long) = nullptr;
  CUresult (*MemUnmap)(CUdeviceptr, size_t) = nullptr;
  CUresult (*MemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t) = nullptr;
  CUresult (*MemGetAllocationGranularity)(size_t*, const CUmemAllocationProp*,
                                          CUmemAllocationGranularity_flags) = nullptr;
};

// Loaded once; returns an error naming the missing entry point.
Status GetDriver(const Driver** out);

// Stream-ordered 64-bit flag operations (0 SMs): wait until (int64)(*addr - value) >= 0; write
// value.
Status StreamWaitGeq(cudaStream_t s, const uint64_t* addr, uint64_t value);
Status StreamWrite(cudaStream_t s, uint64_t* addr, uint64_t value);

// The same flag operations, collected and enqueued on one stream by one driver call
// (cuStreamBatchMemOp, in order): an op's handshake with world - 1 peers costs one call instead
// of 3 * (world - 1), where host enqueueing is what bounds small ops.
class MemOps {
 public:
  static constexpr int kMax = 64;  // cuStreamBatchMemOp takes < 256
  void WaitGeq(const uint64_t* addr, uint64_t value);
  void Write(uint64_t* addr, uint64_t value);
  // Enqueues everything collected on `s` (nothing when empty) and empties the batch; a batch
  // that would exceed kMax is an error here, naming the count.
  Status Enqueue(cudaStream_t s);

 private:
  CUstreamBatchMemOpParams* Add();  // the next slot, cleared; null (counted) when full
  CUstreamBatchMemOpParams ops_[kMax];  // [0, n_) set by Add: no clearing of all kMax per batch
  int n_ = 0;
  int overflow_ = 0;  // operations refused beyond kMax (reported by Enqueue)
};

// Device memory mapped only where asked (cuMemCreate + cuMemMap + cuMemSetAccess). Used for the
// buffers of a one-process group instead of cudaDeviceEnablePeerAccess: context-wide peer access
// made XLA's first launch on one GPU (module loading) wait for a peer GPU that was itself waiting
// in a jax_ub op for that launch -- a deadlock.
struct VmmAlloc {
  CUdeviceptr ptr = 0;
  size_t size = 0;
  CUmemGenericAllocationHandle handle = 0;
  int device = -1;
  void* get() const { return reinterpret_cast<void*>(ptr); }
};
// Rounds `bytes` up to the allocation granularity; accessible from `device` only until VmmGrant.
Status VmmCreate(int device, size_t bytes, VmmAlloc* out);
Status VmmGrant(const VmmAlloc& a, int peer_device);  // read/write access for another GPU
void VmmFree(VmmAlloc* a);                            // no-op when empty

}  // namespace jax_ub
