#include "kernels/flags.h"

namespace jax_ub {
namespace {
__global__ void CheckFlagKernel(const volatile uint64_t* flag) {
  if (*flag != 0) __trap();
}
}  // namespace

Status LaunchCheckFlag(const uint64_t* flag, cudaStream_t stream) {
  CheckFlagKernel<<<1, 1, 0, stream>>>(flag);
  JAX_UB_CUDA_RETURN(cudaGetLastError());
  return Status::Ok();
}

Status PreloadReduceKernels();
Status PreloadCopyKernels();

Status PreloadFlagKernels() {
  cudaFuncAttributes attr;
  JAX_UB_CUDA_RETURN(cudaFuncGetAttributes(&attr, CheckFlagKernel));
  JAX_UB_RETURN_IF_ERROR(PreloadCopyKernels());
  return PreloadReduceKernels();
}

}  // namespace jax_ub
