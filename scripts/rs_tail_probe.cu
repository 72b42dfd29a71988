// What the fp32 sum at the end of GEMM->RS ring/pipeline costs, and how much of it row pieces
// would hide, measured on one GPU with jax_ub's own GEMM plans (gemm/cublaslt.cc, tuned as the
// library tunes) and sum kernel (kernels/reduce.cu).
//
// In the tp=4 timelines (e.g. 4xH200 rs 8192,8192,28672) every rank's last GEMM is its own partial
// and the last peer push lands just before it ends; then one sum over the world partials (0.17 ms
// of a 1.6 ms op) runs alone. Its tail could shrink if the own partial's GEMM ran in P row pieces
// and each piece's sum started as soon as the piece was computed (and the last peer's push of it
// had landed), beside the next piece's GEMM. This probe times the compute side of that, per
// iteration (one op's end):
//   gemm    the previous partial's GEMM, then the own partial's, no sum (the floor)
//   P=1     the same, then the whole sum (what the library does)
//   P2/4/8  the own partial in P pieces, each piece summed on a second stream once computed
//   Pp/S    the same with the GEMM pieces before the last planned for S SMs fewer (cuBLASLt's
//           sm_count target), so that the sums beside them have S SMs
// with the peers' partials already in place (their pushes land before the own GEMM ends there).
// Iterations run back to back, each joined on the last sum (op boundaries); `rounds` interleaved
// rounds of `iters` iterations; medians. Checks every pieced variant's output against P1's.
//
// Build (repository root):
//   nvcc -O3 -std=c++17 -arch=sm_90a -Icsrc -o /tmp/rs_tail scripts/rs_tail_probe.cu \
//        csrc/gemm/cublaslt.cc csrc/common/dynlib.cc csrc/kernels/reduce.cu csrc/kernels/fill.cu -ldl
// Run: LD_LIBRARY_PATH=<dir of libcublasLt.so.*> /tmp/rs_tail [rounds=7] [iters=10]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "gemm/cublaslt.h"
#include "kernels/fill.h"
#include "kernels/reduce.h"

#include "probe_util.cuh"

using jax_ub::DType;

#define ST(x) do { jax_ub::Status s_ = (x); if (!s_.ok()) { \
  std::printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, s_.message().c_str()); std::exit(1);} } while (0)

struct Shape { const char* name; int world; long mo, k, n; };  // own partial x[mo, k] @ w[k, n]

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 7;
  const int iters = argc > 2 ? std::atoi(argv[2]) : 10;
  // bench rs shapes (M, K, N) at tp 4 and 2: a rank's partial is x[M/tp, K/tp] @ w[K/tp, N].
  const std::vector<Shape> shapes = {
      {"tp4 8192,8192,28672", 4, 2048, 2048, 28672}, {"tp4 16384,12288,12288", 4, 4096, 3072, 12288},
      {"tp4 8192,8192,8192", 4, 2048, 2048, 8192},   {"tp4 2048,8192,28672", 4, 512, 2048, 28672},
      {"tp2 8192,8192,28672", 2, 4096, 4096, 28672}, {"tp2 16384,12288,12288", 2, 8192, 6144, 12288}};
  // p: -1 the GEMMs only, 0 the whole sum only, >= 1 the own partial in p pieces; leave: SMs the
  // GEMM pieces before the last leave to the sums beside them (sm_count = SMs - leave), which get
  // 4 blocks per left SM (the last piece's sum, with nothing beside it, gets the whole GPU).
  struct Variant { int p, leave; const char* name; };
  const std::vector<Variant> variants = {{-1, 0, "gemm"}, {0, 0, "sum"},     {1, 0, "P1"},
                                         {2, 0, "P2"},    {4, 0, "P4"},      {8, 0, "P8"},
                                         {2, 16, "P2/16"}, {4, 16, "P4/16"}, {4, 32, "P4/32"},
                                         {8, 32, "P8/32"}};
  const int dev = 0;
  CK(cudaSetDevice(dev));
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  std::printf("%s\n", jax_ub::CublasLtDescription().c_str());
  const size_t ws_bytes = 32u << 20;
  void* ws = nullptr;
  CK(cudaMalloc(&ws, ws_bytes));
  cudaStream_t cs, red;
  CK(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&red, cudaStreamNonBlocking));
  std::vector<cudaEvent_t> ev(9);
  for (auto& e : ev) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  cudaEvent_t t0, t1;
  CK(cudaEventCreate(&t0));
  CK(cudaEventCreate(&t1));
  std::printf("%d rounds x %d iterations, random bf16, tuned plans (8 candidates); ms per iteration\n",
              rounds, iters);
  std::printf("ms per iteration: gemm (the two GEMMs alone) and sum (alone); then each variant's tail "
              "(its time - gemm's); max |variant - P1| / max |P1| over the pieced variants\n");
  std::printf("%-22s", "shape");
  for (const Variant& v : variants) std::printf(" %6s", v.name);
  std::printf("  err\n");
  for (const Shape& sh : shapes) {
    const int world = sh.world;
    const long mo = sh.mo, k = sh.k, n = sh.n;
    const size_t part = static_cast<size_t>(mo) * n;
    char *xp, *xo, *w, *stage, *slots, *y, *y1;
    CK(cudaMalloc(&xp, mo * k * 2));
    CK(cudaMalloc(&xo, mo * k * 2));
    CK(cudaMalloc(&w, k * n * 2));
    CK(cudaMalloc(&stage, part * 2));
    CK(cudaMalloc(&slots, world * part * 2));
    CK(cudaMalloc(&y, part * 2));
    CK(cudaMalloc(&y1, part * 2));
    ST(jax_ub::LaunchFillUniform(DType::kBF16, xp, mo * k, 1, cs));
    ST(jax_ub::LaunchFillUniform(DType::kBF16, xo, mo * k, 2, cs));
    ST(jax_ub::LaunchFillUniform(DType::kBF16, w, k * n, 3, cs));
    ST(jax_ub::LaunchFillUniform(DType::kBF16, slots, world * part, 4, cs));
    const int own = 0;  // the own slot (rank 0); the others hold the peers' partials
    char* mine = slots + own * part * 2;
    auto first = [&](int p, int j) { return mo * j / p; };
    auto gemm = [&](const char* x, long rows, char* out, int leave) {
      return jax_ub::RowMajorGemm(rows, n, k, DType::kBF16, false, x, w, out, ws, ws_bytes,
                                  leave > 0 ? sms - leave : 0);
    };
    // Tune every row count (and SM count) the variants use, as the library's warm-up does.
    for (const Variant& v : variants) {
      for (int j = 0; j < std::max(v.p, 1); ++j) {
        jax_ub::GemmTuneResult r;
        const long rows = first(std::max(v.p, 1), j + 1) - first(std::max(v.p, 1), j);
        ST(jax_ub::GemmTune(dev, gemm(xo, rows, mine, j + 1 < v.p ? v.leave : 0), 8, 5, cs, &r));
      }
    }
    std::vector<const void*> in(world);
    auto iteration = [&](const Variant& v, char* out) {
      CK(cudaEventRecord(ev[8], red));
      CK(cudaStreamWaitEvent(cs, ev[8], 0));  // the previous op's end
      if (v.p == 0) {  // the whole sum alone
        for (int q = 0; q < world; ++q) in[q] = slots + q * part * 2;
        ST(jax_ub::LaunchSumReduce(DType::kBF16, out, in.data(), world, part, 4 * sms, red));
        return;
      }
      ST(jax_ub::Gemm(dev, gemm(xp, mo, stage, 0), cs));
      const int p = std::max(v.p, 1);
      for (int j = 0; j < p; ++j) {
        const bool last = j + 1 == p;
        ST(jax_ub::Gemm(dev, gemm(xo + first(p, j) * k * 2, first(p, j + 1) - first(p, j),
                                  mine + first(p, j) * n * 2, last ? 0 : v.leave), cs));
        CK(cudaEventRecord(ev[j], cs));
        CK(cudaStreamWaitEvent(red, ev[j], 0));
        if (v.p < 0) continue;
        for (int q = 0; q < world; ++q) in[q] = slots + (q * part + first(p, j) * n) * 2;
        ST(jax_ub::LaunchSumReduce(DType::kBF16, out + first(p, j) * n * 2, in.data(), world,
                                   (first(p, j + 1) - first(p, j)) * n,
                                   last || v.leave == 0 ? 4 * sms : 4 * v.leave, red));
      }
    };
    std::vector<std::vector<double>> t(variants.size());
    for (const Variant& v : variants) iteration(v, v.p == 1 && v.leave == 0 ? y1 : y);  // warm
    CK(cudaDeviceSynchronize());
    for (int rd = 0; rd < rounds; ++rd) {
      for (size_t c = 0; c < variants.size(); ++c) {
        const size_t i = (c + rd) % variants.size();
        char* out = i == 2 ? y1 : y;
        CK(cudaEventRecord(t0, red));
        for (int it = 0; it < iters; ++it) iteration(variants[i], out);
        CK(cudaEventRecord(t1, red));
        CK(cudaEventSynchronize(t1));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, t0, t1));
        t[i].push_back(ms / iters);
      }
    }
    // Every pieced variant's output against P=1's (the own partial's bits may differ with its plan).
    std::vector<__nv_bfloat16> a(part), b(part);
    CK(cudaMemcpy(a.data(), y1, part * 2, cudaMemcpyDeviceToHost));
    double scale = 0;
    for (size_t i = 0; i < part; ++i) scale = std::max(scale, std::fabs(double(__bfloat162float(a[i]))));
    double err = 0;
    for (size_t vi = 3; vi < variants.size(); ++vi) {
      CK(cudaMemset(y, 0xff, part * 2));  // NaN: an unwritten element shows
      iteration(variants[vi], y);
      CK(cudaDeviceSynchronize());
      CK(cudaMemcpy(b.data(), y, part * 2, cudaMemcpyDeviceToHost));
      for (size_t i = 0; i < part; ++i) {
        const double d = std::fabs(double(__bfloat162float(a[i])) - double(__bfloat162float(b[i])));
        err = std::isnan(d) ? INFINITY : std::max(err, d / scale);
      }
    }
    const double g = Median(t[0]);
    std::printf("%-22s %6.3f %6.3f", sh.name, g, Median(t[1]));
    for (size_t vi = 2; vi < variants.size(); ++vi) std::printf(" %6.3f", Median(t[vi]) - g);
    std::printf("  %.1e\n", err);
    std::fflush(stdout);
    for (char* p : {xp, xo, w, stage, slots, y, y1}) CK(cudaFree(p));
  }
  return 0;
}
