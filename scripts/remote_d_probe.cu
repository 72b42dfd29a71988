// Can a GEMM->RS partial be stored by the GEMM itself into the owner's memory (cuBLASLt's D a
// peer-mapped pointer, the epilogue's stores going over NVLink), instead of a local GEMM followed
// by a copy-engine push? Two GPUs, each running the same bf16 GEMM at once, four ways:
//   local   D on the GPU itself (the GEMM alone, on both GPUs at once)
//   remote  D on the other GPU (each GPU's epilogue writes into its peer)
//   ce      D local while a copy engine pushes a buffer of D's size to the peer (today's overlap
//           of a partial's push with the next partial's GEMM)
// Prints the median ms of `reps` rounds of `iters` back-to-back GEMMs per way, and how the remote
// and ce forms compare with local.
// Build: nvcc -O2 -arch=sm_90a -I$WHEEL/include -o remote_d_probe scripts/remote_d_probe.cu \
//          -L$WHEEL/lib -l:libcublasLt.so.13     (WHEEL: site-packages/nvidia/cu13)
// Run:   LD_LIBRARY_PATH=$WHEEL/lib ./remote_d_probe
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "probe_util.cuh"

struct Shape { long m, n, k; const char* what; };

struct Gpu {
  int dev;
  cublasLtHandle_t h;
  cudaStream_t cs, ce;
  void *a, *b, *d, *push_src, *ws;
  void* peer_d;     // the other GPU's d
  void* peer_push;  // the other GPU's landing buffer for our push
  cudaEvent_t e0, e1;
};

__global__ void Fill(__nv_bfloat16* p, size_t n, float scale) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    p[i] = __float2bfloat16(scale * static_cast<float>((i * 2654435761u) % 1000) / 1000.0f - 0.5f * scale);
  }
}

int main() {
  // Per-destination partial GEMMs of bench rs (x[M/tp, K/tp] rows @ w[K/tp, N]) at tp 4 and 2.
  const std::vector<Shape> shapes = {
      {2048, 28672, 2048, "tp4 8192,8192,28672"}, {2048, 8192, 2048, "tp4 8192,8192,8192"},
      {4096, 12288, 3072, "tp4 16384,12288,12288"}, {512, 28672, 2048, "tp4 2048,8192,28672"},
      {4096, 28672, 4096, "tp2 8192,8192,28672"}, {4096, 8192, 4096, "tp2 8192,8192,8192"},
      {8192, 12288, 6144, "tp2 16384,12288,12288"}, {1024, 28672, 4096, "tp2 2048,8192,28672"},
      {2048, 4096, 2048, "tp2 4096,4096,4096"}, {4096, 4096, 2048, "tp2 8192,4096,4096"},
  };
  size_t max_a = 0, max_b = 0, max_d = 0;
  for (const Shape& s : shapes) {
    max_a = std::max<size_t>(max_a, s.m * s.k);
    max_b = std::max<size_t>(max_b, s.k * s.n);
    max_d = std::max<size_t>(max_d, s.m * s.n);
  }
  const size_t ws_bytes = 32 << 20;
  Gpu g[2];
  for (int i = 0; i < 2; ++i) {
    g[i].dev = i;
    CK(cudaSetDevice(i));
    CK(cudaDeviceEnablePeerAccess(1 - i, 0));
    LT(cublasLtCreate(&g[i].h));
    int lo = 0, hi = 0;
    CK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
    CK(cudaStreamCreateWithPriority(&g[i].cs, cudaStreamNonBlocking, lo));
    CK(cudaStreamCreateWithPriority(&g[i].ce, cudaStreamNonBlocking, hi));
    CK(cudaMalloc(&g[i].a, max_a * 2));
    CK(cudaMalloc(&g[i].b, max_b * 2));
    CK(cudaMalloc(&g[i].d, max_d * 2));
    CK(cudaMalloc(&g[i].push_src, max_d * 2));
    CK(cudaMalloc(&g[i].peer_push, max_d * 2));  // lands here: the peer pushes into it
    CK(cudaMalloc(&g[i].ws, ws_bytes));
    Fill<<<1024, 256>>>(static_cast<__nv_bfloat16*>(g[i].a), max_a, 1.0f);
    Fill<<<1024, 256>>>(static_cast<__nv_bfloat16*>(g[i].b), max_b, 0.1f);
    Fill<<<1024, 256>>>(static_cast<__nv_bfloat16*>(g[i].push_src), max_d, 1.0f);
    CK(cudaEventCreate(&g[i].e0));
    CK(cudaEventCreate(&g[i].e1));
    CK(cudaDeviceSynchronize());
  }
  g[0].peer_d = g[1].d;
  g[1].peer_d = g[0].d;
  const int iters = 10, reps = 7;
  std::printf("%-24s %18s | %8s %8s %8s | %7s %7s | %s\n", "shape", "m,n,k", "local", "remote",
              "ce", "rem/loc", "ce/loc", "D bytes, remote GB/s");
  for (const Shape& s : shapes) {
    cublasLtMatmulDesc_t desc[2];
    cublasLtMatrixLayout_t la[2], lb[2], lc[2];
    cublasLtMatmulAlgo_t algo[2];
    for (int i = 0; i < 2; ++i) {
      CK(cudaSetDevice(i));
      LT(cublasLtMatmulDescCreate(&desc[i], CUBLAS_COMPUTE_32F, CUDA_R_32F));
      // Row-major y[m, n] = x[m, k] @ w[k, n] as column-major y^T = w^T @ x^T.
      LT(cublasLtMatrixLayoutCreate(&la[i], CUDA_R_16BF, s.n, s.k, s.n));
      LT(cublasLtMatrixLayoutCreate(&lb[i], CUDA_R_16BF, s.k, s.m, s.k));
      LT(cublasLtMatrixLayoutCreate(&lc[i], CUDA_R_16BF, s.n, s.m, s.n));
      cublasLtMatmulPreference_t pref;
      LT(cublasLtMatmulPreferenceCreate(&pref));
      uint64_t ws = ws_bytes;
      LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
      cublasLtMatmulHeuristicResult_t r[1];
      int found = 0;
      LT(cublasLtMatmulAlgoGetHeuristic(g[i].h, desc[i], la[i], lb[i], lc[i], lc[i], pref, 1, r, &found));
      cublasLtMatmulPreferenceDestroy(pref);
      if (found < 1) { std::printf("no algo\n"); return 1; }
      algo[i] = r[0].algo;
    }
    const float alpha = 1.0f, beta = 0.0f;
    auto gemm = [&](int i, void* d) {
      LT(cublasLtMatmul(g[i].h, desc[i], &alpha, g[i].b, la[i], g[i].a, lb[i], &beta, d, lc[i], d,
                        lc[i], &algo[i], g[i].ws, ws_bytes, g[i].cs));
    };
    // way 0 local, 1 remote, 2 local + ce push of D's size.
    double med[3];
    for (int way = 0; way < 3; ++way) {
      std::vector<double> samples;
      for (int rep = 0; rep < reps + 1; ++rep) {
        for (int i = 0; i < 2; ++i) {
          CK(cudaSetDevice(i));
          CK(cudaEventRecord(g[i].e0, g[i].cs));
          if (way == 2) {
            CK(cudaStreamWaitEvent(g[i].ce, g[i].e0, 0));
            for (int it = 0; it < iters; ++it) {
              CK(cudaMemcpyAsync(g[1 - i].peer_push, g[i].push_src, s.m * s.n * 2, cudaMemcpyDefault,
                                 g[i].ce));
            }
          }
          for (int it = 0; it < iters; ++it) gemm(i, way == 1 ? g[i].peer_d : g[i].d);
          CK(cudaEventRecord(g[i].e1, g[i].cs));
        }
        float worst = 0;
        for (int i = 0; i < 2; ++i) {
          CK(cudaSetDevice(i));
          CK(cudaEventSynchronize(g[i].e1));
          CK(cudaStreamSynchronize(g[i].ce));
          float ms = 0;
          CK(cudaEventElapsedTime(&ms, g[i].e0, g[i].e1));
          worst = std::max(worst, ms);
        }
        if (rep > 0) samples.push_back(worst / iters);  // the first round warms up
      }
      std::sort(samples.begin(), samples.end());
      med[way] = samples[samples.size() / 2];
    }
    const double bytes = static_cast<double>(s.m) * s.n * 2;
    char mnk[64];
    std::snprintf(mnk, sizeof(mnk), "%ld,%ld,%ld", s.m, s.n, s.k);
    std::printf("%-24s %18s | %8.4f %8.4f %8.4f | %7.3f %7.3f | %.1f MB, %.0f GB/s\n", s.what, mnk,
                med[0], med[1], med[2], med[1] / med[0], med[2] / med[0], bytes / 1e6,
                bytes / (med[1] * 1e6));
    for (int i = 0; i < 2; ++i) {
      cublasLtMatrixLayoutDestroy(la[i]);
      cublasLtMatrixLayoutDestroy(lb[i]);
      cublasLtMatrixLayoutDestroy(lc[i]);
      cublasLtMatmulDescDestroy(desc[i]);
    }
  }
  std::printf("REMOTE_D_PROBE done\n");
  return 0;
}
