// Would running the tp chunk GEMMs of AG->GEMM (and the tp partial GEMMs of GEMM->RS) on two
// compute streams, alternately, lower the split floor? One GPU, jax_ub's own GEMM plans
// (gemm/cublaslt.cc, tuned as the library tunes: 8 candidates).
//
// The split floor (NOTES, twenty-fifth session): at AG 2048,8192,28672 tp=4 each chunk GEMM
// [512, 8192] @ [8192, 7168] fills 0.85 of its last wave of SMs, so tp of them back to back on one
// stream take 1.17-1.19x the whole GEMM, and T/T_ideal <= 1.10 is out of reach for every schedule
// that runs them one after another. On two streams, chunk i+1's first tiles may take the SMs that
// chunk i's last wave leaves idle. Per iteration (one op), with every operand in place:
//   whole    one GEMM over all rows
//   1 stream the tp row-chunk GEMMs back to back (what the library does)
//   2 streams chunk j on stream j % 2 (each with its own cuBLASLt workspace)
// Iterations are joined on both streams (op boundaries); `rounds` rounds of `iters` iterations,
// each round in a new random order; medians. Checks that both chunked variants write the same bits.
//
// Build (repository root):
//   nvcc -O3 -std=c++17 -arch=sm_90a -Icsrc -o /tmp/chunk_streams scripts/chunk_streams_probe.cu \
//        csrc/gemm/cublaslt.cc csrc/common/dynlib.cc csrc/kernels/fill.cu -ldl
// Run: LD_LIBRARY_PATH=<dir of libcublasLt.so.*> /tmp/chunk_streams [rounds=15] [iters=10]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "gemm/cublaslt.h"
#include "kernels/fill.h"

#include "probe_util.cuh"

using jax_ub::DType;

#define ST(x) do { jax_ub::Status s_ = (x); if (!s_.ok()) { \
  std::printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, s_.message().c_str()); std::exit(1);} } while (0)

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 15;
  const int iters = argc > 2 ? std::atoi(argv[2]) : 10;
  const int dev = 0;
  CK(cudaSetDevice(dev));
  std::printf("%s\n", jax_ub::CublasLtDescription().c_str());
  const size_t ws_bytes = 32u << 20;
  void* ws[2];
  cudaStream_t s[2];
  for (int i = 0; i < 2; ++i) {
    CK(cudaMalloc(&ws[i], ws_bytes));
    CK(cudaStreamCreateWithFlags(&s[i], cudaStreamNonBlocking));
  }
  cudaEvent_t join, t0, t1;
  CK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  CK(cudaEventCreate(&t0));
  CK(cudaEventCreate(&t1));
  std::printf("%d rounds x %d iterations, random bf16, tuned plans (8 candidates), each round in a "
              "new random order; median ms per iteration, and over whole\n", rounds, iters);
  std::printf("%-3s %-18s %3s %8s %8s %8s %8s %8s  %s\n", "op", "M,K,N", "tp", "whole", "1stream",
              "2streams", "1s/whole", "2s/whole", "same bits");
  std::mt19937 rng(1234);
  for (int tp : {4, 2}) {
    for (const Op& op : kBenchOps) {
      // A rank's GEMM per chunk: AG x[M/tp, K] @ w[K, N/tp]; RS x[M/tp, K/tp] @ w[K/tp, N].
      const long rows = op.M / tp, k = op.rs ? op.K / tp : op.K, n = op.rs ? op.N : op.N / tp;
      const long m = rows * tp;
      char *x, *w, *y, *y2;
      CK(cudaMalloc(&x, m * k * 2));
      CK(cudaMalloc(&w, k * n * 2));
      CK(cudaMalloc(&y, m * n * 2));
      CK(cudaMalloc(&y2, m * n * 2));
      ST(jax_ub::LaunchFillUniform(DType::kBF16, x, m * k, 1, s[0]));
      ST(jax_ub::LaunchFillUniform(DType::kBF16, w, k * n, 2, s[0]));
      auto gemm = [&](long r, const char* a, char* out, int si) {
        return jax_ub::RowMajorGemm(r, n, k, DType::kBF16, false, a, w, out, ws[si], ws_bytes);
      };
      jax_ub::GemmTuneResult tr;
      ST(jax_ub::GemmTune(dev, gemm(m, x, y, 0), 8, 5, s[0], &tr));
      ST(jax_ub::GemmTune(dev, gemm(rows, x, y, 0), 8, 5, s[0], &tr));
      // variant 0 whole, 1 one stream, 2 two streams
      auto iteration = [&](int v, char* out) {
        CK(cudaEventRecord(join, s[1]));
        CK(cudaStreamWaitEvent(s[0], join, 0));  // the previous op's end, on both streams
        CK(cudaEventRecord(join, s[0]));
        CK(cudaStreamWaitEvent(s[1], join, 0));
        if (v == 0) {
          ST(jax_ub::Gemm(dev, gemm(m, x, out, 0), s[0]));
          return;
        }
        for (int j = 0; j < tp; ++j) {
          const int si = v == 2 ? j % 2 : 0;
          ST(jax_ub::Gemm(dev, gemm(rows, x + j * rows * k * 2, out + j * rows * n * 2, si), s[si]));
        }
      };
      for (int v = 0; v < 3; ++v) iteration(v, y);  // warm
      CK(cudaDeviceSynchronize());
      std::vector<std::vector<double>> t(3);
      int order[3] = {0, 1, 2};
      for (int rd = 0; rd < rounds; ++rd) {
        std::shuffle(order, order + 3, rng);
        for (int v : order) {
          for (int it = 0; it < iters; ++it) iteration(v, y);  // an untimed burst first
          CK(cudaEventRecord(t0, s[0]));
          for (int it = 0; it < iters; ++it) iteration(v, y);
          CK(cudaEventRecord(join, s[1]));
          CK(cudaStreamWaitEvent(s[0], join, 0));
          CK(cudaEventRecord(t1, s[0]));
          CK(cudaEventSynchronize(t1));
          float ms = 0;
          CK(cudaEventElapsedTime(&ms, t0, t1));
          t[v].push_back(ms / iters);
        }
      }
      // Both chunked variants run the same plans on the same rows: the same bits, every element
      // written (the outputs are NaN-poisoned first).
      CK(cudaMemset(y, 0xff, m * n * 2));
      CK(cudaMemset(y2, 0xff, m * n * 2));
      iteration(1, y);
      iteration(2, y2);
      CK(cudaDeviceSynchronize());
      std::vector<unsigned short> a(m * n), b(m * n);
      CK(cudaMemcpy(a.data(), y, m * n * 2, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(b.data(), y2, m * n * 2, cudaMemcpyDeviceToHost));
      long nan = 0;
      for (unsigned short u : a) nan += (u & 0x7f80) == 0x7f80 && (u & 0x7f) != 0;
      const bool same = std::memcmp(a.data(), b.data(), m * n * 2) == 0 && nan == 0;
      const double w0 = Median(t[0]), w1 = Median(t[1]), w2 = Median(t[2]);
      char mkn[32];
      std::snprintf(mkn, sizeof(mkn), "%ld,%ld,%ld", op.M, op.K, op.N);
      std::printf("%-3s %-18s %3d %8.3f %8.3f %8.3f %8.3f %8.3f  %s\n", op.name, mkn, tp, w0, w1, w2,
                  w1 / w0, w2 / w0, same ? "yes" : "NO");
      std::fflush(stdout);
      for (char* p : {x, w, y, y2}) CK(cudaFree(p));
    }
  }
  return 0;
}
