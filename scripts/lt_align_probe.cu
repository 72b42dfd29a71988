// Does the pointer alignment that cuBLASLt's heuristic is told change the algorithm it picks for
// jax_ub's chunk GEMMs? For each (m, n, k) of the benchmark shapes, asks for the top candidates
// with minimum alignments 256..16 bytes and prints the top one's configuration (algo, tile,
// stages, split-k, swizzle, custom option, cluster shape) and, optionally, its time.
// Build: nvcc -O2 -arch=sm_90a -I$WHEEL/include -o lt_align_probe scripts/lt_align_probe.cu \
//          -L$WHEEL/lib -l:libcublasLt.so.13     (WHEEL: site-packages/nvidia/cu13)
// Run:   LD_LIBRARY_PATH=$WHEEL/lib ./lt_align_probe [time]
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "lt_util.cuh"

struct Shape { long m, n, k; };

static void Config(const cublasLtMatmulAlgo_t& a, char* out, size_t len) {
  std::snprintf(out, len, "%s", AlgoConfig(a).c_str());
}

int main(int argc, char** argv) {
  const bool timed = argc > 1 && std::strcmp(argv[1], "time") == 0;
  // Chunk GEMMs of bench ag/rs at tp 4 and 2 (AG: [M/tp, K] @ [K, N/tp]; RS: [M/tp or half, K/tp]
  // @ [K/tp, N]), and the non-power-of-two test shape 6144x5120x13824.
  const std::vector<Shape> shapes = {
      {2048, 7168, 8192}, {2048, 2048, 8192}, {4096, 3072, 12288}, {512, 7168, 8192},
      {2048, 28672, 2048}, {1024, 28672, 2048}, {2048, 8192, 2048}, {4096, 12288, 3072},
      {512, 28672, 2048}, {4096, 14336, 8192}, {4096, 28672, 4096}, {2048, 28672, 4096},
      {1536, 3456, 5120}, {1536, 13824, 1280}, {768, 13824, 1280}};
  const int aligns[] = {256, 128, 64, 32, 16};
  CK(cudaSetDevice(0));
  cublasLtHandle_t h;
  LT(cublasLtCreate(&h));
  const size_t ws_bytes = 32u << 20;
  void* ws = nullptr;
  CK(cudaMalloc(&ws, ws_bytes));
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  int differ = 0;
  for (const Shape& sh : shapes) {
    const cudaDataType t = CUDA_R_16BF;
    cublasLtMatmulDesc_t desc;
    LT(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    // Row-major y[m, n] = x[m, k] @ w[k, n] as column-major y^T = w^T x^T: cuBLASLt's A is w.
    cublasLtMatrixLayout_t la, lb, lc;
    LT(cublasLtMatrixLayoutCreate(&la, t, sh.n, sh.k, sh.n));
    LT(cublasLtMatrixLayoutCreate(&lb, t, sh.k, sh.m, sh.k));
    LT(cublasLtMatrixLayoutCreate(&lc, t, sh.n, sh.m, sh.n));
    void *x = nullptr, *w = nullptr, *y = nullptr;
    if (timed) {
      CK(cudaMalloc(&x, sh.m * sh.k * 2));
      CK(cudaMalloc(&w, sh.k * sh.n * 2));
      CK(cudaMalloc(&y, sh.m * sh.n * 2));
      CK(cudaMemset(x, 0x3c, sh.m * sh.k * 2));
      CK(cudaMemset(w, 0x3c, sh.k * sh.n * 2));
    }
    char first[160] = {};
    for (int al : aligns) {
      cublasLtMatmulPreference_t pref;
      LT(cublasLtMatmulPreferenceCreate(&pref));
      const uint64_t wsb = ws_bytes;
      const uint32_t a32 = al;
      LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof(wsb)));
      LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &a32, sizeof(a32)));
      LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &a32, sizeof(a32)));
      LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &a32, sizeof(a32)));
      LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &a32, sizeof(a32)));
      cublasLtMatmulHeuristicResult_t res[8] = {};
      int found = 0;
      LT(cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, lc, lc, pref, 8, res, &found));
      cublasLtMatmulPreferenceDestroy(pref);
      char cfg[160];
      Config(res[0].algo, cfg, sizeof(cfg));
      const bool same = al == aligns[0] || std::strcmp(cfg, first) == 0;
      if (al == aligns[0]) std::strcpy(first, cfg);
      if (!same) ++differ;
      double ms = 0;
      if (timed && found > 0) {
        const float alpha = 1, beta = 0;
        for (int i = 0; i < 3; ++i)
          LT(cublasLtMatmul(h, desc, &alpha, w, la, x, lb, &beta, y, lc, y, lc, &res[0].algo, ws, ws_bytes, s));
        CK(cudaEventRecord(e0, s));
        for (int i = 0; i < 20; ++i)
          LT(cublasLtMatmul(h, desc, &alpha, w, la, x, lb, &beta, y, lc, y, lc, &res[0].algo, ws, ws_bytes, s));
        CK(cudaEventRecord(e1, s));
        CK(cudaEventSynchronize(e1));
        float t_ms = 0;
        CK(cudaEventElapsedTime(&t_ms, e0, e1));
        ms = t_ms / 20;
      }
      std::printf("m=%ld n=%ld k=%ld align %3d: found %d, top: %s%s", sh.m, sh.n, sh.k, al, found, cfg,
                  same ? "" : "  <- DIFFERS from 256");
      if (timed) std::printf("  %.4f ms", ms);
      std::printf("\n");
    }
    if (timed) {
      CK(cudaFree(x));
      CK(cudaFree(w));
      CK(cudaFree(y));
    }
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(lc);
    cublasLtMatmulDescDestroy(desc);
  }
  std::printf("ALIGN PROBE: %d of %zu (shape, alignment < 256) pairs pick another top algorithm\n",
              differ, shapes.size() * 4);
  return 0;
}
