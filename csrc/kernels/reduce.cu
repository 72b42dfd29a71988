#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/reduce.h"

namespace jax_ub {
namespace {

struct Inputs {
  const void* ptr[kMaxReduceInputs];
};

template <typename T>
__device__ __forceinline__ float ToF32(T v);
template <>
__device__ __forceinline__ float ToF32<float>(float v) { return v; }
template <>
__device__ __forceinline__ float ToF32<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float ToF32<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T FromF32(float v);
template <>
__device__ __forceinline__ float FromF32<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half FromF32<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 FromF32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// A [rows, cols] block with row stride `ld` (elements) in the output and every input; the flat
// sum is one row. Element (i, j) of the vector kernel is vector j of row i.
struct Block {
  size_t rows, cols, ld;
  __device__ __forceinline__ size_t At(size_t i, size_t w) const {
    return rows == 1 ? i : (i / w) * ld + i % w;
  }
};

// 16-byte vectors: each thread sums kVec elements per input per step (cols and ld in vectors).
template <typename T>
__global__ void SumReduceVec(T* __restrict__ out, Inputs in, int n_in, Block b) {
  constexpr int kVec = 16 / sizeof(T);
  union Pack {
    uint4 raw;
    T v[kVec];
  };
  const size_t n_vec = b.rows * b.cols;
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n_vec;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const size_t at = b.At(i, b.cols);
    float acc[kVec];
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[e] = 0.f;
    for (int j = 0; j < n_in; ++j) {
      Pack p;
      p.raw = reinterpret_cast<const uint4*>(in.ptr[j])[at];
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[e] += ToF32<T>(p.v[e]);
    }
    Pack o;
#pragma unroll
    for (int e = 0; e < kVec; ++e) o.v[e] = FromF32<T>(acc[e]);
    reinterpret_cast<uint4*>(out)[at] = o.raw;
  }
}

// Element by element: columns [begin, b.cols) of every row.
template <typename T>
__global__ void SumReduceTail(T* __restrict__ out, Inputs in, int n_in, Block b, size_t begin) {
  const size_t w = b.cols - begin, n = b.rows * w;
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const size_t at = (b.rows == 1 ? 0 : (i / w) * b.ld) + begin + i % w;
    float acc = 0.f;
    for (int j = 0; j < n_in; ++j) acc += ToF32<T>(static_cast<const T*>(in.ptr[j])[at]);
    out[at] = FromF32<T>(acc);
  }
}

template <typename T>
Status Launch(void* out, const void* const* inputs, int n, size_t rows, size_t cols, size_t ld,
              int max_blocks, cudaStream_t stream) {
  Inputs in{};
  constexpr int kVec = 16 / sizeof(T);
  bool aligned = reinterpret_cast<uintptr_t>(out) % 16 == 0 && (rows == 1 || ld % kVec == 0);
  for (int j = 0; j < n; ++j) {
    in.ptr[j] = inputs[j];
    aligned = aligned && reinterpret_cast<uintptr_t>(inputs[j]) % 16 == 0;
  }
  constexpr int kThreads = 512;
  // A block of several rows is summed by vectors only when every row is whole vectors.
  const size_t vec_cols = aligned && (rows == 1 || cols % kVec == 0) ? cols / kVec : 0;
  auto grid = [&](size_t work) {
    const size_t blocks = (work + kThreads - 1) / kThreads;
    return static_cast<int>(blocks < static_cast<size_t>(max_blocks) ? blocks : max_blocks);
  };
  if (vec_cols > 0) {
    SumReduceVec<T><<<grid(rows * vec_cols), kThreads, 0, stream>>>(
        static_cast<T*>(out), in, n, Block{rows, vec_cols, ld / kVec});
    JAX_UB_CUDA_RETURN(cudaGetLastError());
  }
  const size_t begin = vec_cols * kVec;
  if (begin < cols) {
    SumReduceTail<T><<<grid(rows * (cols - begin)), kThreads, 0, stream>>>(
        static_cast<T*>(out), in, n, Block{rows, cols, ld}, begin);
    JAX_UB_CUDA_RETURN(cudaGetLastError());
  }
  return Status::Ok();
}

}  // namespace

Status PreloadReduceKernels() {
  cudaFuncAttributes attr;
  JAX_UB_CUDA_RETURN(cudaFuncGetAttributes(&attr, SumReduceVec<float>));
  JAX_UB_CUDA_RETURN(cudaFuncGetAttributes(&attr, SumReduceVec<__half>));
  JAX_UB_CUDA_RETURN(cudaFuncGetAttributes(&attr, SumReduceVec<__nv_bfloat16>));
  JAX_UB_CUDA_RETURN(cudaFuncGetAttributes(&attr, SumReduceTail<float>));
  JAX_UB_CUDA_RETURN(cudaFuncGetAttributes(&attr, SumReduceTail<__half>));
  JAX_UB_CUDA_RETURN(cudaFuncGetAttributes(&attr, SumReduceTail<__nv_bfloat16>));
  return Status::Ok();
}

Status LaunchSumReduce(DType dtype, void* out, const void* const* inputs, int num_inputs,
                       size_t count, int max_blocks, cudaStream_t stream) {
  return LaunchSumReduceBlock(dtype, out, inputs, num_inputs, 1, count, count, max_blocks, stream);
}

Status LaunchSumReduceBlock(DType dtype, void* out, const void* const* inputs, int num_inputs,
                            size_t rows, size_t cols, size_t ld, int max_blocks,
                            cudaStream_t stream) {
  if (num_inputs < 1 || num_inputs > kMaxReduceInputs) {
    return Status::Error(StrCat() << "sum-reduce takes 1.." << kMaxReduceInputs
                                  << " inputs; got " << num_inputs);
  }
  if (rows > 1 && ld < cols) {
    return Status::Error(StrCat() << "sum-reduce: row stride " << ld << " < " << cols
                                  << " columns");
  }
  if (rows == 0 || cols == 0) return Status::Ok();
  if (max_blocks < 1) max_blocks = 1;
  switch (dtype) {
    case DType::kF32:
      return Launch<float>(out, inputs, num_inputs, rows, cols, ld, max_blocks, stream);
    case DType::kF16:
      return Launch<__half>(out, inputs, num_inputs, rows, cols, ld, max_blocks, stream);
    case DType::kBF16:
      return Launch<__nv_bfloat16>(out, inputs, num_inputs, rows, cols, ld, max_blocks, stream);
  }
  return Status::Error("sum-reduce: unknown dtype");
}

}  // namespace jax_ub
