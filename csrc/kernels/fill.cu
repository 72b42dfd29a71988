#include "kernels/convert.cuh"
#include "kernels/fill.h"

namespace jax_ub {
namespace {

template <typename T>
__global__ void FillUniformKernel(T* p, size_t count, uint32_t seed) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    // A 64-bit index folded into a 32-bit integer hash (lowbias32), 24 bits of it kept.
    uint32_t h = static_cast<uint32_t>(i) ^ static_cast<uint32_t>(i >> 32) * 0x9e3779b9u ^ seed;
    h ^= h >> 16;
    h *= 0x7feb352du;
    h ^= h >> 15;
    h *= 0x846ca68bu;
    h ^= h >> 16;
    p[i] = FromF32<T>(static_cast<float>(h >> 8) * (1.0f / 8388608.0f) - 1.0f);
  }
}

template <typename T>
Status Launch(void* p, size_t count, uint32_t seed, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const size_t want = (count + kThreads - 1) / kThreads;
  const int blocks = static_cast<int>(want < 4096 ? want : 4096);
  FillUniformKernel<T><<<blocks, kThreads, 0, stream>>>(static_cast<T*>(p), count, seed);
  JAX_UB_CUDA_RETURN(cudaGetLastError());
  return Status::Ok();
}

}  // namespace

Status LaunchFillUniform(DType dtype, void* p, size_t count, uint32_t seed, cudaStream_t stream) {
  if (count == 0) return Status::Ok();
  switch (dtype) {
    case DType::kF32: return Launch<float>(p, count, seed, stream);
    case DType::kF16: return Launch<__half>(p, count, seed, stream);
    case DType::kBF16: return Launch<__nv_bfloat16>(p, count, seed, stream);
    case DType::kE4M3: return Launch<__nv_fp8_e4m3>(p, count, seed, stream);
    case DType::kE5M2: return Launch<__nv_fp8_e5m2>(p, count, seed, stream);
  }
  return Status::Error("fill: unknown dtype");
}

}  // namespace jax_ub
