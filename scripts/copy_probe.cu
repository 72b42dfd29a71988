// What the bounded-block copy (kernels/copy.cu) gains where source and destination are misaligned
// alike only modulo 8, 4 or 2 bytes (a chunk at a row offset whose rows are not a multiple of 16
// bytes): GB/s of LaunchCopy at each misalignment, and of the byte-by-byte kernel that such a copy
// ran before, at the same block counts (a copy beside a GEMM gets a few SMs). CUDA events, median
// of 15 after 3 warm-ups, one GPU.
// Build: nvcc -O3 -std=c++17 -arch=sm_90a -Icsrc -o copy_probe scripts/copy_probe.cu \
//          csrc/kernels/copy.cu
// Run:   ./copy_probe [MiB (64)]
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kernels/copy.h"

#include "probe_util.cuh"

__global__ void OldBytes(char* __restrict__ dst, const char* __restrict__ src, size_t n) {
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    dst[i] = src[i];
  }
}

template <typename F>
double TimeMs(F&& launch) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) launch();
  std::vector<double> ms;
  for (int i = 0; i < 15; ++i) {
    CK(cudaEventRecord(a));
    launch();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float t = 0;
    CK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  return Median(ms);
}

int main(int argc, char** argv) {
  const size_t bytes = (argc > 1 ? std::atol(argv[1]) : 64) << 20;
  CK(cudaSetDevice(0));
  if (!jax_ub::PreloadCopyKernels().ok()) return 1;
  char *src = nullptr, *dst = nullptr;
  CK(cudaMalloc(&src, bytes + 64));
  CK(cudaMalloc(&dst, bytes + 64));
  CK(cudaMemset(src, 0x5a, bytes + 64));
  std::printf("%zu MiB; GB/s (bytes copied / median time)\n", bytes >> 20);
  std::printf("%-8s %-10s %-8s %10s %10s %8s\n", "blocks", "dst,src", "unit", "LaunchCopy",
              "bytewise", "ratio");
  const int offsets[][2] = {{0, 0}, {8, 0}, {4, 0}, {2, 0}, {1, 0}, {3, 3}};
  const char* units[] = {"16", "8", "4", "2", "1", "16+edges"};
  for (int blocks : {4, 8, 32}) {
    for (int i = 0; i < 6; ++i) {
      char* d = dst + offsets[i][0];
      const char* s = src + offsets[i][1];
      const double lib = TimeMs([&] {
        if (!jax_ub::LaunchCopy(d, s, bytes, blocks, nullptr).ok()) std::exit(1);
      });
      const double old = TimeMs([&] { OldBytes<<<blocks, 1024>>>(d, s, bytes); });
      CK(cudaGetLastError());
      std::printf("%-8d %d,%-8d %-8s %10.1f %10.1f %7.2fx\n", blocks, offsets[i][0],
                  offsets[i][1], units[i], bytes / lib / 1e6, bytes / old / 1e6, old / lib);
    }
  }
  return 0;
}
