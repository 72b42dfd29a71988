// Is there a cuBLASLt algorithm that runs the tp row-chunk GEMMs of the overlapped schedules as
// fast as the whole GEMM? split_gemm_probe.py found the heuristic's choice 1.09x / 1.08x the whole
// GEMM at AG 8192,8192,28672 and 2048,8192,28672 (tp 4), and 1.15x at RS 2048,8192,28672 -- the
// shapes of which the tiles fill the last wave of SMs worst. JAX_UB_GEMM_TUNE looks at most at the
// heuristic's first 16 candidates, timed on a constant byte pattern (which runs at other clocks
// than real data). This probe asks for up to `cands` candidates and times every one on random
// bf16 data, per shape:
//   whole   the GEMM over all M rows, the heuristic's first candidate (the reference)
//   chunks  tp GEMMs of M/tp rows back to back over the tp row blocks of x, as the schedules run
//           them, for every candidate
// `rounds` interleaved rounds (every candidate once per round) of `iters` calls; medians.
// Prints per shape the chunks' time over the whole GEMM with the heuristic's first candidate,
// with the best candidate among the first 8 and 16 (what JAX_UB_GEMM_TUNE can reach) and among
// all, and the configuration of the best.
// Build: nvcc -O2 -std=c++17 -arch=sm_90a -I$WHEEL/include -o chunk_algo_probe \
//          scripts/chunk_algo_probe.cu -L$WHEEL/lib -l:libcublasLt.so.13   (WHEEL: nvidia/cu13)
// Per candidate it also prints the chunks' time with every call on the first row block (how the
// tuner times a candidate: the same operands again and again).
// Run:   LD_LIBRARY_PATH=$WHEEL/lib ./chunk_algo_probe [tp=4] [cands=64] [rounds=5] [iters=10]
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "lt_util.cuh"

// One GEMM configuration: row-major y[m, n] = x[m, k] @ w[k, n] as column-major y^T = w^T x^T.
struct Lt {
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t a, b, c;
  std::vector<cublasLtMatmulHeuristicResult_t> algos;
};

static Lt Make(cublasLtHandle_t h, long m, long n, long k, size_t ws, int cands) {
  Lt p;
  LT(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  LT(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, n, k, n));
  LT(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, k, m, k));
  LT(cublasLtMatrixLayoutCreate(&p.c, CUDA_R_16BF, n, m, n));
  p.algos = HeuristicList(h, p.desc, p.a, p.b, p.c, ws, cands);
  return p;
}

static void Describe(const cublasLtMatmulHeuristicResult_t& r, char* out, size_t len) {
  std::snprintf(out, len, "%s waves %.2f", AlgoConfig(r.algo).c_str(), r.wavesCount);
}

int main(int argc, char** argv) {
  const int tp = argc > 1 ? std::atoi(argv[1]) : 4;
  const int cands = argc > 2 ? std::atoi(argv[2]) : 64;
  const int rounds = argc > 3 ? std::atoi(argv[3]) : 5;
  const int iters = argc > 4 ? std::atoi(argv[4]) : 10;
  const std::vector<Op>& ops = kBenchOps;
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
  std::printf("tp %d, up to %d candidates, %d rounds x %d calls, random bf16; ratios over the whole GEMM "
              "(heuristic's first)\n", tp, cands, rounds, iters);
  std::printf("%-3s %-18s %5s %9s %7s %7s %7s %7s  best (rank: config)\n", "op", "M,K,N", "cands",
              "whole ms", "first", "top8", "top16", "all");
  for (const Op& op : ops) {
    const long m = op.M, k = op.rs ? op.K / tp : op.K, n = op.rs ? op.N : op.N / tp;
    const long mc = m / tp;
    __nv_bfloat16 *x, *w, *y;
    CK(cudaMalloc(&x, m * k * 2));
    CK(cudaMalloc(&w, k * n * 2));
    CK(cudaMalloc(&y, m * n * 2));
    FillRandom<<<1024, 256, 0, s>>>(x, m * k, 1u);
    FillRandom<<<1024, 256, 0, s>>>(w, k * n, 2u);
    CK(cudaGetLastError());
    Lt whole = Make(h, m, n, k, ws_bytes, 1);
    Lt chunk = Make(h, mc, n, k, ws_bytes, cands);
    if (whole.algos.empty() || chunk.algos.empty()) {
      std::printf("%-3s %ld,%ld,%ld: no algorithm\n", op.name, op.M, op.K, op.N);
      continue;
    }
    const float alpha = 1, beta = 0;
    // whole: one call; chunks (candidate i): tp calls over the row blocks, or (same) tp calls on
    // the first block, as JAX_UB_GEMM_TUNE times a candidate.
    bool same = false;
    auto run = [&](int cand) -> bool {
      if (cand < 0) {
        return cublasLtMatmul(h, whole.desc, &alpha, w, whole.a, x, whole.b, &beta, y, whole.c, y,
                              whole.c, &whole.algos[0].algo, ws, ws_bytes, s) == CUBLAS_STATUS_SUCCESS;
      }
      for (int j = 0; j < tp; ++j) {
        const long b = same ? 0 : j;
        if (cublasLtMatmul(h, chunk.desc, &alpha, w, chunk.a, x + b * mc * k, chunk.b, &beta,
                           y + b * mc * n, chunk.c, y + b * mc * n, chunk.c, &chunk.algos[cand].algo,
                           ws, ws_bytes, s) != CUBLAS_STATUS_SUCCESS) {
          return false;
        }
      }
      return true;
    };
    const int nc = static_cast<int>(chunk.algos.size());
    std::vector<bool> ok(nc + 1, true);
    std::vector<std::vector<double>> t(nc + 1), ts(nc + 1);  // [0]: whole; [i + 1]: candidate i
    for (int c = -1; c < nc; ++c) {
      for (int i = 0; i < 2 && ok[c + 1]; ++i) ok[c + 1] = run(c);
    }
    CK(cudaStreamSynchronize(s));
    for (int rd = 0; rd < rounds; ++rd) {
      for (int pass = 0; pass < 2; ++pass) {
        same = pass == 1;
        for (int c = same ? 0 : -1; c < nc; ++c) {
          if (!ok[c + 1]) continue;
          CK(cudaEventRecord(e0, s));
          for (int i = 0; i < iters; ++i) run(c);
          CK(cudaEventRecord(e1, s));
          CK(cudaEventSynchronize(e1));
          float ms = 0;
          CK(cudaEventElapsedTime(&ms, e0, e1));
          (same ? ts : t)[c + 1].push_back(ms / iters);
        }
      }
    }
    const double wh = Median(t[0]);
    auto best_of = [&](int upto, int* which) {
      double b = 1e30;
      for (int c = 0; c < std::min(upto, nc); ++c) {
        if (ok[c + 1] && Median(t[c + 1]) < b) {
          b = Median(t[c + 1]);
          *which = c;
        }
      }
      return b;
    };
    int b8 = 0, b16 = 0, ball = 0;
    const double t8 = best_of(8, &b8), t16 = best_of(16, &b16), tall = best_of(nc, &ball);
    char cfg[200], cfg0[200];
    Describe(chunk.algos[ball], cfg, sizeof(cfg));
    Describe(chunk.algos[0], cfg0, sizeof(cfg0));
    char shape[40];
    std::snprintf(shape, sizeof(shape), "%ld,%ld,%ld", op.M, op.K, op.N);
    std::printf("%-3s %-18s %5d %9.4f %7.3f %7.3f %7.3f %7.3f  %d: %s\n", op.name, shape, nc, wh,
                Median(t[1]) / wh, t8 / wh, t16 / wh, tall / wh, ball, cfg);
    std::printf("    first: %s; chunk %ldx%ldx%ld\n", cfg0, mc, n, k);
    for (int c = 0; c < nc; ++c) {  // per candidate: over the row blocks, and on one block
      Describe(chunk.algos[c], cfg, sizeof(cfg));
      std::printf("    %2d  blocks %.3f  same block %.3f  %s\n", c, Median(t[c + 1]) / wh,
                  Median(ts[c + 1]) / wh, cfg);
    }
    std::fflush(stdout);
    CK(cudaFree(x));
    CK(cudaFree(w));
    CK(cudaFree(y));
    for (Lt* p : {&whole, &chunk}) {
      cublasLtMatrixLayoutDestroy(p->a);
      cublasLtMatrixLayoutDestroy(p->b);
      cublasLtMatrixLayoutDestroy(p->c);
      cublasLtMatmulDescDestroy(p->desc);
    }
  }
  return 0;
}
