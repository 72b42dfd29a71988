// How close does GEMM->RS's final fp32 sum (kernels/reduce.cu) come to the GPU's memory
// bandwidth? On one GPU, bf16: out = sum of n inputs of `count` elements, timed (CUDA events,
// median of 20 after 5 warm-ups) for the library's launcher at its default grid (4 blocks per SM)
// and for variants of one probe kernel that keeps U 16-byte vectors per input in flight per
// thread, at several grids. Reference: a device-to-device cudaMemcpy of the same output size.
// Prints GB/s of (n + 1) * bytes (every input read once, the output written once).
// Build: nvcc -O3 -std=c++17 -arch=sm_90a -Icsrc -o reduce_probe scripts/reduce_probe.cu \
//          csrc/kernels/reduce.cu
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kernels/reduce.h"

#include "probe_util.cuh"

struct Ptrs {
  const uint4* p[8];
};

__device__ __forceinline__ void Add8(float* acc, uint4 v) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 f = __bfloat1622float2(h[i]);
    acc[2 * i] += f.x;
    acc[2 * i + 1] += f.y;
  }
}

__device__ __forceinline__ uint4 Pack8(const float* acc) {
  uint4 o;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
  return o;
}

// U vectors per thread per step, loads of every input issued before any add.
template <int U, int N>
__global__ void SumU(uint4* __restrict__ out, Ptrs in, size_t n_vec) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t i = blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + (U - 1) * stride < n_vec; i += U * stride) {
    uint4 v[N][U];
#pragma unroll
    for (int j = 0; j < N; ++j)
#pragma unroll
      for (int u = 0; u < U; ++u) v[j][u] = __ldcs(in.p[j] + i + u * stride);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
      for (int j = 0; j < N; ++j) Add8(acc, v[j][u]);
      __stcs(out + i + u * stride, Pack8(acc));
    }
  }
  for (; i < n_vec; i += stride) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
    for (int j = 0; j < N; ++j) Add8(acc, in.p[j][i]);
    out[i] = Pack8(acc);
  }
}

template <class F>
float Median(F&& launch, cudaStream_t s) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 5; ++i) launch();
  std::vector<float> t;
  for (int i = 0; i < 20; ++i) {
    CK(cudaEventRecord(a, s));
    launch();
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  CK(cudaGetLastError());
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

template <int N>
void Run(size_t count, int sms, cudaStream_t s) {
  const size_t bytes = count * 2;
  std::vector<void*> in(N);
  for (auto& p : in) {
    CK(cudaMalloc(&p, bytes));
    CK(cudaMemset(p, 0x3c, bytes));
  }
  void* out;
  CK(cudaMalloc(&out, bytes));
  const double total = (N + 1.0) * bytes;
  auto report = [&](const char* what, float ms, double moved) {
    std::printf("REDUCE n=%d %.1f MB each: %-34s %.4f ms %7.0f GB/s\n", N, bytes / 1e6, what, ms,
                moved / ms / 1e6);
  };
  report("cudaMemcpy D2D (output size)",
         Median([&] { CK(cudaMemcpyAsync(out, in[0], bytes, cudaMemcpyDeviceToDevice, s)); }, s),
         2.0 * bytes);
  report("library launcher (4 blocks/SM)", Median([&] {
           jax_ub::Status st = jax_ub::LaunchSumReduce(jax_ub::DType::kBF16, out, in.data(), N,
                                                       count, 4 * sms, s);
           if (!st.ok()) std::exit(2);
         }, s), total);
  Ptrs p{};
  for (int j = 0; j < N; ++j) p.p[j] = static_cast<const uint4*>(in[j]);
  const size_t n_vec = bytes / 16;
  char name[64];
  for (int threads : {256, 512}) {
    for (int per_sm : {1, 2, 4, 8}) {
      if (threads * per_sm > 2048) continue;
      const int grid = per_sm * sms;
      std::snprintf(name, sizeof name, "U=1 %d thr x %d/SM", threads, per_sm);
      report(name, Median([&] { SumU<1, N><<<grid, threads, 0, s>>>(static_cast<uint4*>(out), p, n_vec); }, s), total);
      std::snprintf(name, sizeof name, "U=2 %d thr x %d/SM", threads, per_sm);
      report(name, Median([&] { SumU<2, N><<<grid, threads, 0, s>>>(static_cast<uint4*>(out), p, n_vec); }, s), total);
      std::snprintf(name, sizeof name, "U=4 %d thr x %d/SM", threads, per_sm);
      report(name, Median([&] { SumU<4, N><<<grid, threads, 0, s>>>(static_cast<uint4*>(out), p, n_vec); }, s), total);
    }
  }
  for (auto p : in) CK(cudaFree(p));
  CK(cudaFree(out));
}

int main() {
  CK(cudaSetDevice(0));
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  // Per-rank output sizes of the bench's GEMM->RS: tp 4 [2048, 28672], [4096, 12288],
  // [512, 28672]; tp 2 [4096, 28672].
  for (size_t count : {2048ull * 28672, 4096ull * 12288, 512ull * 28672}) Run<4>(count, sms, s);
  Run<2>(4096ull * 28672, sms, s);
  return 0;
}
