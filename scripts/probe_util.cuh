// Shared by the standalone probe programs of scripts/ (each is built alone with nvcc, as its header
// says; this file is found beside it): error checks that say where and exit, a median, and random
// bf16 data.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

// A CUDA runtime call: on failure, print file:line, the call and the error, and exit(1).
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
  std::printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); std::exit(1);} } while (0)
// A cuBLASLt call (include <cublasLt.h> before using it): the same with its status.
#define LT(x) do { cublasStatus_t s_ = (x); if (s_ != CUBLAS_STATUS_SUCCESS) { \
  std::printf("%s:%d %s: status %d\n", __FILE__, __LINE__, #x, static_cast<int>(s_)); std::exit(1);} } while (0)

// The upper median (0 for none).
static inline double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// The bench ag|rs shapes (global M, K, N; the issues' tp=4 shapes). The GEMM each rank runs per
// chunk: AG x[M/tp, K] @ w[K, N/tp]; RS (rs = true) x[M/tp, K/tp] @ w[K/tp, N].
struct Op { const char* name; long M, K, N; bool rs; };
static const std::vector<Op> kBenchOps = {
    {"ag", 8192, 8192, 28672, false},  {"ag", 8192, 8192, 8192, false},
    {"ag", 16384, 12288, 12288, false}, {"ag", 2048, 8192, 28672, false},
    {"rs", 8192, 8192, 28672, true},   {"rs", 8192, 8192, 8192, true},
    {"rs", 16384, 12288, 12288, true},  {"rs", 2048, 8192, 28672, true}};

// Uniform values in [-1, 1) from a hash of the index: random to a GEMM, cheap to make.
static __global__ void FillRandom(__nv_bfloat16* p, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    unsigned h = static_cast<unsigned>(i) * 2654435761u ^ seed;
    h ^= h >> 16; h *= 0x7feb352du; h ^= h >> 15; h *= 0x846ca68bu; h ^= h >> 16;
    p[i] = __float2bfloat16(static_cast<float>(h >> 8) / 8388608.0f - 1.0f);
  }
}
