#include <cstdint>

#include "kernels/convert.cuh"
#include "kernels/reduce.h"

namespace jax_ub {
namespace {

struct Inputs {
  const void* ptr[kMaxReduceInputs];
};

// A [rows, cols] block with row stride `ld` (elements) in the output and every input; the flat
// sum is one row. Element (i, j) of the vector kernel is vector j of row i.
struct Block {
  size_t rows, cols, ld;
  __device__ __forceinline__ size_t At(size_t i, size_t w) const {
    return rows == 1 ? i : (i / w) * ld + i % w;
  }
};

// 16-byte vectors: each thread sums kVec elements per input per step (cols and ld in vectors).
// N > 0: the input count is a compile-time constant, so every input's load is issued before the
// first add (a loop over a run-time count waits for each load before issuing the next: one load in
// flight per thread). Measured (scripts/reduce_probe.cu at tag lab-2026-11) on one H200, 4 bf16
// inputs of 117 MB: 0.167 ms with the run-time loop, 0.146 ms unrolled (4.0 TB/s, above a same-size
// cudaMemcpy); 29 MB: 0.055 -> 0.041. Inputs are read once and the output is not read back here:
// streaming loads and stores.
template <typename T, int N>
__global__ void SumReduceVec(T* __restrict__ out, Inputs in, int n_in, Block b) {
  constexpr int kVec = 16 / sizeof(T);
  union Pack {
    uint4 raw;
    T v[kVec];
  };
  const size_t n_vec = b.rows * b.cols;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n_vec;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const size_t at = b.At(i, b.cols);
    float acc[kVec];
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[e] = 0.f;
    if constexpr (N > 0) {
      Pack p[N];
#pragma unroll
      for (int j = 0; j < N; ++j) p[j].raw = __ldcs(reinterpret_cast<const uint4*>(in.ptr[j]) + at);
#pragma unroll
      for (int j = 0; j < N; ++j) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[e] += ToF32<T>(p[j].v[e]);
      }
    } else {
      for (int j = 0; j < n_in; ++j) {
        Pack p;
        p.raw = __ldcs(reinterpret_cast<const uint4*>(in.ptr[j]) + at);
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[e] += ToF32<T>(p.v[e]);
      }
    }
    Pack o;
#pragma unroll
    for (int e = 0; e < kVec; ++e) o.v[e] = FromF32<T>(acc[e]);
    __stcs(reinterpret_cast<uint4*>(out) + at, o.raw);
  }
}

// The vector kernel for n inputs: unrolled up to kMaxUnrolled, a run-time loop above.
constexpr int kMaxUnrolled = 8;
template <typename T, int N = 1>
void LaunchVec(int n, int grid, int threads, cudaStream_t stream, T* out, const Inputs& in,
               const Block& b) {
  if constexpr (N > kMaxUnrolled) {
    SumReduceVec<T, 0><<<grid, threads, 0, stream>>>(out, in, n, b);
  } else {
    if (n == N) {
      SumReduceVec<T, N><<<grid, threads, 0, stream>>>(out, in, n, b);
    } else {
      LaunchVec<T, N + 1>(n, grid, threads, stream, out, in, b);
    }
  }
}

template <typename T, int N = 0>
void PreloadVec(cudaFuncAttributes* attr, cudaError_t* err) {
  if (*err == cudaSuccess) *err = cudaFuncGetAttributes(attr, SumReduceVec<T, N>);
  if constexpr (N < kMaxUnrolled) PreloadVec<T, N + 1>(attr, err);
}

// Element by element: columns [begin, b.cols) of every row.
template <typename T>
__global__ void SumReduceTail(T* __restrict__ out, Inputs in, int n_in, Block b, size_t begin) {
  const size_t w = b.cols - begin, n = b.rows * w;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
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
    LaunchVec<T>(n, grid(rows * vec_cols), kThreads, stream, static_cast<T*>(out), in,
                 Block{rows, vec_cols, ld / kVec});
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
  cudaError_t err = cudaSuccess;
  PreloadVec<float>(&attr, &err);
  PreloadVec<__half>(&attr, &err);
  PreloadVec<__nv_bfloat16>(&attr, &err);
  JAX_UB_CUDA_RETURN(err);
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
    return Status::Error(StrCat() << "sum-reduce takes 1.." << kMaxReduceInputs << " inputs; got "
                                  << num_inputs);
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
    case DType::kE4M3:
    case DType::kE5M2: break;  // partials are GEMM results: bfloat16 or float32
  }
  return Status::Error(StrCat() << "sum-reduce: no " << DTypeName(dtype) << " sum");
}

}  // namespace jax_ub
