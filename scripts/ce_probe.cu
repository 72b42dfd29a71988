// Which copies need SMs? Fill every SM with a spinning kernel on a low-priority stream, then
// issue one copy on a high-priority stream and see whether it finishes before the spin does.
// A copy that finishes early ran on a copy engine; one that ends after the spin waited for SMs.
// Build: nvcc -O2 -arch=sm_90a -o ce_probe scripts/ce_probe.cu 
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>

#include "probe_util.cuh"

__global__ void spin(long long ns) {
  long long t0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  long long t = t0;
  while (t - t0 < ns) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
}

int main() {
  int ndev = 0;
  CK(cudaGetDeviceCount(&ndev));
  CK(cudaSetDevice(0));
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  int lo = 0, hi = 0;
  CK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
  cudaStream_t sa, sb;
  CK(cudaStreamCreateWithPriority(&sa, cudaStreamNonBlocking, lo));
  CK(cudaStreamCreateWithPriority(&sb, cudaStreamNonBlocking, hi));
  const size_t bytes = 64ull << 20;
  void *src, *dst, *peer = nullptr;
  CK(cudaMalloc(&src, bytes));
  CK(cudaMalloc(&dst, bytes));
  CK(cudaMemset(src, 1, bytes));
  if (ndev > 1) {
    CK(cudaDeviceEnablePeerAccess(1, 0));
    CK(cudaSetDevice(1));
    CK(cudaMalloc(&peer, bytes));
    CK(cudaDeviceEnablePeerAccess(0, 0));
    CK(cudaSetDevice(0));
  }
  cudaEvent_t e0, e1, c0, c1;
  CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  CK(cudaEventCreate(&c0)); CK(cudaEventCreate(&c1));
  const char* names[] = {"local memcpyAsync D2D", "local memcpyBatchAsync PreferOverlapWithCompute",
                         "local memcpyAsync kind Default", "local memcpyPeerAsync(0->0)",
                         "pull peer1->local memcpyAsync", "push local->peer1 memcpyAsync",
                         "push local->peer1 memcpyBatchAsync PreferOverlap"};
  const int nv = ndev > 1 ? 7 : 4;
  const long long spin_ns = 3000000;  // 3 ms
  for (int rep = 0; rep < 2; ++rep) {
    for (int v = 0; v < nv; ++v) {
      CK(cudaDeviceSynchronize());
      CK(cudaEventRecord(e0, sa));
      spin<<<sms * 2, 1024, 0, sa>>>(spin_ns);  // 2 x 1024 threads fill an SM's 2048
      CK(cudaEventRecord(e1, sa));
      CK(cudaStreamWaitEvent(sb, e0, 0));
      CK(cudaEventRecord(c0, sb));
      void* d = v == 5 || v == 6 ? peer : dst;
      const void* s = v == 4 ? peer : src;
      if (v == 1 || v == 6) {
#if CUDART_VERSION >= 12080
        cudaMemcpyAttributes attr{};
        attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
        attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
        void* ds[1] = {d}; const void* ss[1] = {s}; size_t sz[1] = {bytes}; size_t ai[1] = {0};
        CK(cudaMemcpyBatchAsync(ds, ss, sz, 1, &attr, ai, 1, sb));
#endif
      } else if (v == 2) {
        CK(cudaMemcpyAsync(d, s, bytes, cudaMemcpyDefault, sb));
      } else if (v == 3) {
        CK(cudaMemcpyPeerAsync(d, 0, s, 0, bytes, sb));
      } else {
        CK(cudaMemcpyAsync(d, s, bytes, cudaMemcpyDeviceToDevice, sb));
      }
      CK(cudaEventRecord(c1, sb));
      CK(cudaDeviceSynchronize());
      float spin_ms = 0, copy_end = 0, copy_ms = 0;
      CK(cudaEventElapsedTime(&spin_ms, e0, e1));
      CK(cudaEventElapsedTime(&copy_end, e0, c1));
      CK(cudaEventElapsedTime(&copy_ms, c0, c1));
      if (rep == 1) {
        std::printf("CEPROBE %-50s spin %.3f ms, copy ends at %.3f ms (%s)\n", names[v], spin_ms,
                    copy_end, copy_end < spin_ms - 0.5 ? "copy engine: ran under the spin"
                                                       : "WAITED for SMs");
      }
    }
  }
  // Unloaded speed of the local copy, for reference.
  CK(cudaEventRecord(c0, sb));
  CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, sb));
  CK(cudaEventRecord(c1, sb));
  CK(cudaDeviceSynchronize());
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, c0, c1));
  std::printf("CEPROBE local 64 MiB copy alone %.3f ms (%.0f GB/s)\n", ms, bytes / ms / 1e6);
  return 0;
}
