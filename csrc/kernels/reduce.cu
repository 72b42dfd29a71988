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

// 16-byte vectors: each thread sums kVec elements per input per step.
template <typename T>
__global__ void SumReduceVec(T* __restrict__ out, Inputs in, int n_in, size_t n_vec) {
  constexpr int kVec = 16 / sizeof(T);
  union Pack {
    uint4 raw;
    T v[kVec];
  };
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n_vec;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    float acc[kVec];
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[e] = 0.f;
    for (int j = 0; j < n_in; ++j) {
      Pack p;
      p.raw = reinterpret_cast<const uint4*>(in.ptr[j])[i];
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[e] += ToF32<T>(p.v[e]);
    }
    Pack o;
#pragma unroll
    for (int e = 0; e < kVec; ++e) o.v[e] = FromF32<T>(acc[e]);
    reinterpret_cast<uint4*>(out)[i] = o.raw;
  }
}

template <typename T>
__global__ void SumReduceTail(T* __restrict__ out, Inputs in, int n_in, size_t begin, size_t end) {
  for (size_t i = begin + blockIdx.x * blockDim.x + threadIdx.x; i < end;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    float acc = 0.f;
    for (int j = 0; j < n_in; ++j) acc += ToF32<T>(static_cast<const T*>(in.ptr[j])[i]);
    out[i] = FromF32<T>(acc);
  }
}

template <typename T>
Status Launch(void* out, const void* const* inputs, int n, size_t count, int max_blocks,
              cudaStream_t stream) {
  Inputs in{};
  bool aligned = reinterpret_cast<uintptr_t>(out) % 16 == 0;
  for (int j = 0; j < n; ++j) {
    in.ptr[j] = inputs[j];
    aligned = aligned && reinterpret_cast<uintptr_t>(inputs[j]) % 16 == 0;
  }
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kThreads = 512;
  const size_t n_vec = aligned ? count / kVec : 0;
  if (n_vec > 0) {
    int blocks = static_cast<int>((n_vec + kThreads - 1) / kThreads);
    if (blocks > max_blocks) blocks = max_blocks;
    SumReduceVec<T><<<blocks, kThreads, 0, stream>>>(static_cast<T*>(out), in, n, n_vec);
    JAX_UB_CUDA_RETURN(cudaGetLastError());
  }
  const size_t begin = n_vec * kVec;
  if (begin < count) {
    size_t rest = count - begin;
    int blocks = static_cast<int>((rest + kThreads - 1) / kThreads);
    if (blocks > max_blocks) blocks = max_blocks;
    SumReduceTail<T><<<blocks, kThreads, 0, stream>>>(static_cast<T*>(out), in, n, begin, count);
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
  if (num_inputs < 1 || num_inputs > kMaxReduceInputs) {
    return Status::Error(StrCat() << "sum-reduce takes 1.." << kMaxReduceInputs
                                  << " inputs; got " << num_inputs);
  }
  if (count == 0) return Status::Ok();
  if (max_blocks < 1) max_blocks = 1;
  switch (dtype) {
    case DType::kF32: return Launch<float>(out, inputs, num_inputs, count, max_blocks, stream);
    case DType::kF16: return Launch<__half>(out, inputs, num_inputs, count, max_blocks, stream);
    case DType::kBF16:
      return Launch<__nv_bfloat16>(out, inputs, num_inputs, count, max_blocks, stream);
  }
  return Status::Error("sum-reduce: unknown dtype");
}

}  // namespace jax_ub
