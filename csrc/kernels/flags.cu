#include "kernels/copy.h"
#include "kernels/flags.h"

namespace jax_ub {
namespace {
__global__ void CheckFlagKernel(const volatile uint64_t* flag, const volatile uint64_t* host_mark) {
  if (*flag != 0 || (host_mark != nullptr && *host_mark != 0)) __trap();
}

__global__ void CheckOpKernel(const volatile uint64_t* poison, const volatile uint64_t* ids,
                              int world, int rank, uint64_t want, volatile uint64_t* report) {
  const uint64_t poisoned = *poison;
  if (poisoned != 0) {
    report[5] = want >> 32;
    __threadfence_system();
    report[4] = poisoned;
    __threadfence_system();
    __trap();
  }
  for (int q = 0; q < world; ++q) {
    if (q == rank) continue;
    const uint64_t v = ids[q];
    if ((v >> 32) == (want >> 32) && v != want) {
      report[1] = static_cast<uint64_t>(q);
      report[2] = v;
      report[3] = want;
      __threadfence_system();
      report[0] = want >> 32;
      __threadfence_system();
      __trap();
    }
  }
}
}  // namespace

Status LaunchCheckFlag(const uint64_t* flag, const uint64_t* host_mark, cudaStream_t stream) {
  CheckFlagKernel<<<1, 1, 0, stream>>>(flag, host_mark);
  JAX_UB_CUDA_RETURN(cudaGetLastError());
  return Status::Ok();
}

Status LaunchCheckOp(const uint64_t* poison, const uint64_t* ids, int world, int rank,
                     uint64_t want, uint64_t* report, cudaStream_t stream) {
  CheckOpKernel<<<1, 1, 0, stream>>>(poison, ids, world, rank, want, report);
  JAX_UB_CUDA_RETURN(cudaGetLastError());
  return Status::Ok();
}

Status PreloadReduceKernels();

Status PreloadFlagKernels() {
  cudaFuncAttributes attr;
  JAX_UB_CUDA_RETURN(cudaFuncGetAttributes(&attr, CheckFlagKernel));
  JAX_UB_CUDA_RETURN(cudaFuncGetAttributes(&attr, CheckOpKernel));
  JAX_UB_RETURN_IF_ERROR(PreloadCopyKernels());
  return PreloadReduceKernels();
}

}  // namespace jax_ub
