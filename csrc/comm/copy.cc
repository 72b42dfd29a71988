#include "comm/copy.h"

#include <atomic>

namespace jax_ub {

cudaError_t CopyAsync(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  // Nothing to move (an empty collective). cudaMemcpyBatchAsync refuses a zero size, and its
  // failure below would turn the batch path off for the whole process.
  if (bytes == 0) return cudaSuccess;
#if CUDART_VERSION >= 12080
  static std::atomic<bool> batch_ok{true};
  if (batch_ok.load(std::memory_order_relaxed)) {
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    void* dsts[1] = {dst};
    const void* srcs[1] = {src};
    size_t sizes[1] = {bytes};
    size_t attr_idx[1] = {0};
#if CUDART_VERSION >= 13000
    cudaError_t err = cudaMemcpyBatchAsync(dsts, srcs, sizes, 1, &attr, attr_idx, 1, stream);
#else  // CUDA 12.8 and 12.9: one more argument, the index of a failed copy
    size_t fail_idx = 0;
    cudaError_t err = cudaMemcpyBatchAsync(dsts, const_cast<void**>(srcs), sizes, 1, &attr,
                                           attr_idx, 1, &fail_idx, stream);
#endif
    if (err == cudaSuccess) return err;
    cudaGetLastError();
    batch_ok.store(false);  // unsupported here: plain copies from now on
  }
#endif
  return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream);
}

cudaError_t CopyBlockToPeerAsync(void* dst, const void* src, size_t width, size_t rows,
                                 size_t pitch, cudaStream_t stream) {
  if (width == pitch) return CopyAsync(dst, src, width * rows, stream);
  return cudaMemcpy2DAsync(dst, pitch, src, pitch, width, rows, cudaMemcpyDefault, stream);
}

}  // namespace jax_ub
