#include "comm/test_hooks.h"

#include <cuda_runtime_api.h>

#include <vector>

#include "comm/communicator.h"
#include "kernels/copy.h"
#include "kernels/fill.h"

namespace jax_ub {

static_assert(static_cast<int>(Failure::kNone) == Communicator::kFailNone &&
                  static_cast<int>(Failure::kBefore) == Communicator::kFailCheck &&
                  static_cast<int>(Failure::kAfter) == Communicator::kFailBody,
              "Communicator::Injected follows Failure");

bool ToFailure(int what, Failure* out) {
  switch (what) {
#define JAX_UB_FAILURE_CASE(name, text, value) \
  case value: *out = Failure::name; return true;
    JAX_UB_FAILURES(JAX_UB_FAILURE_CASE)
#undef JAX_UB_FAILURE_CASE
  }
  return false;
}

Status InjectFailure(Communicator* c, Failure what) {
  switch (what) {
    case Failure::kStallWatchdog: c->watchdog().StallReader(true); return Status::Ok();
    case Failure::kDropPoison: c->watchdog().DropPoison(true); return Status::Ok();
    case Failure::kNone:
      c->watchdog().StallReader(false);
      c->watchdog().DropPoison(false);
      c->Inject(Communicator::kFailNone);
      return Status::Ok();
    case Failure::kBefore: c->Inject(Communicator::kFailCheck); return Status::Ok();
    case Failure::kAfter: c->Inject(Communicator::kFailBody); return Status::Ok();
  }
  return Status::Error("comm_inject_failure: unknown failure");
}

Status CopyCheck(int device, size_t bytes, int dst_offset, int src_offset, int max_blocks,
                 size_t* wrong, size_t* outside) {
  *wrong = *outside = 0;
  constexpr size_t kGuard = 64;  // poisoned bytes before and after the destination range
  const size_t src_len = bytes + 16, dst_len = bytes + 2 * kGuard;
  std::vector<unsigned char> src_h(src_len), dst_h(dst_len);
  Status st = [&]() -> Status {
    JAX_UB_CUDA_RETURN(cudaSetDevice(device));
    JAX_UB_RETURN_IF_ERROR(PreloadCopyKernels());  // as a communicator's creation does
    void *src = nullptr, *dst = nullptr;
    JAX_UB_CUDA_RETURN(cudaMalloc(&src, src_len + 16));
    JAX_UB_CUDA_RETURN(cudaMalloc(&dst, dst_len));
    Status run = [&]() -> Status {
      JAX_UB_RETURN_IF_ERROR(LaunchFillUniform(DType::kF32, src, (src_len + 15) / 4, 11u, nullptr));
      JAX_UB_CUDA_RETURN(cudaMemset(dst, 0xA5, dst_len));
      JAX_UB_RETURN_IF_ERROR(LaunchCopy(static_cast<char*>(dst) + kGuard + dst_offset,
                                        static_cast<char*>(src) + src_offset, bytes, max_blocks,
                                        nullptr));
      JAX_UB_CUDA_RETURN(cudaDeviceSynchronize());
      JAX_UB_CUDA_RETURN(cudaMemcpy(src_h.data(), src, src_len, cudaMemcpyDeviceToHost));
      JAX_UB_CUDA_RETURN(cudaMemcpy(dst_h.data(), dst, dst_len, cudaMemcpyDeviceToHost));
      return Status::Ok();
    }();
    cudaFree(src);
    cudaFree(dst);
    return run;
  }();
  JAX_UB_RETURN_IF_ERROR(st);
  const size_t begin = kGuard + dst_offset;
  for (size_t i = 0; i < dst_len; ++i) {
    if (i >= begin && i < begin + bytes) {
      *wrong += dst_h[i] != src_h[src_offset + (i - begin)];
    } else {
      *outside += dst_h[i] != 0xA5;
    }
  }
  return Status::Ok();
}

}  // namespace jax_ub
