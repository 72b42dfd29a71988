// Is there a cuBLASLt configuration outside the heuristic's list that runs the overlapped schedules'
// row-chunk GEMMs (or the whole GEMM) faster? chunk_algo_probe.cu timed every candidate the
// heuristic returns (8 at every tp=4 bench shape, all algo 66 with split-K 1) and found the four
// 512-row chunk GEMMs of AG 2048,8192,28672 at best 1.08x the whole GEMM. The heuristic only ranks
// what its model likes; cublasLtMatmulAlgoGetIds / AlgoInit / AlgoCheck allow any configuration the
// library can run. This probe, per shape and for the whole GEMM and the tp chunk GEMMs:
//   1. level 1: every algo id for bf16 in and fp32 compute, every tile and stages id it offers, the
//      rest at defaults; keeps what AlgoCheck accepts with <= 32 MiB of workspace; screens each (one
//      warm call; one timed call, dropped beyond 2.5x the heuristic's first; else the median of 3
//      timed calls of the sequence);
//   2. level 2: around the 12 fastest of level 1 and the heuristic's 8: split-K 2/3/4 (with each
//      reduction scheme the algo supports), CTA swizzling 0/1, custom options 0-3, cluster shapes
//      auto/1x1/2x1/1x2/2x2/4x1/1x4; checked and screened the same way;
//   3. times the `top` fastest of both screens and the heuristic's first 8 in `rounds` interleaved
//      rounds of `iters` calls, on random bf16 data; medians;
//   4. confirms: the heuristic's first, the best of its 8 and the best found (as step 3 ranked
//      them) timed afresh in `confirm` rounds, each in a new random order. Step 3's best is biased
//      low (the minimum of many noisy timings); these are not;
//   5. checks the fastest's output against the heuristic's first (NaN-poisoned before each run).
// Prints, per shape: the whole GEMM with the heuristic's first (the reference), then for whole and
// chunks the heuristic's first, the best of its 8, and the best found, as ratios over the reference,
// and the best's configuration.
// Build: nvcc -O2 -std=c++17 -arch=sm_90a -I$WHEEL/include -o lt_search_probe \
//          scripts/lt_search_probe.cu -L$WHEEL/lib -l:libcublasLt.so.13   (WHEEL: nvidia/cu13)
// Run:   LD_LIBRARY_PATH=$WHEEL/lib ./lt_search_probe [tp=4] [rounds=5] [iters=10] [top=24] [ops=all]
//          [confirm=15]   (ops: "ag" or "rs" runs only that op's shapes)
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "lt_util.cuh"

__global__ void FillNaN(__nv_bfloat16* p, size_t n) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    p[i] = __float2bfloat16(NAN);
  }
}

// max |a - b| and max |b| over n elements, and the count of non-finite a.
__global__ void Compare(const __nv_bfloat16* a, const __nv_bfloat16* b, size_t n, float* out) {
  float d = 0, r = 0, bad = 0;
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float x = __bfloat162float(a[i]), y = __bfloat162float(b[i]);
    if (!isfinite(x)) bad += 1;
    else d = fmaxf(d, fabsf(x - y));
    r = fmaxf(r, fabsf(y));
  }
  atomicMax(reinterpret_cast<int*>(&out[0]), __float_as_int(d));  // non-negative floats order as ints
  atomicMax(reinterpret_cast<int*>(&out[1]), __float_as_int(r));
  atomicAdd(&out[2], bad);
}

struct Cand {
  cublasLtMatmulAlgo_t algo;
  float waves = 0;
  int heuristic_rank = -1;  // position in the heuristic's list, -1: found by the enumeration
  double screen = 0;
  std::vector<double> t;
};

// Row-major y[m, n] = x[m, k] @ w[k, n] as column-major y^T = w^T x^T (as jax_ub's gemm/cublaslt.cc).
struct Problem {
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t a, b, c;
  long m, n, k;
};

static Problem MakeProblem(long m, long n, long k) {
  Problem p{};
  p.m = m; p.n = n; p.k = k;
  LT(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  LT(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, n, k, n));
  LT(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, k, m, k));
  LT(cublasLtMatrixLayoutCreate(&p.c, CUDA_R_16BF, n, m, n));
  return p;
}

static void FreeProblem(Problem& p) {
  cublasLtMatrixLayoutDestroy(p.a);
  cublasLtMatrixLayoutDestroy(p.b);
  cublasLtMatrixLayoutDestroy(p.c);
  cublasLtMatmulDescDestroy(p.desc);
}

static std::vector<Cand> Heuristic(cublasLtHandle_t h, const Problem& p, size_t ws, int count) {
  const std::vector<cublasLtMatmulHeuristicResult_t> res = HeuristicList(h, p.desc, p.a, p.b, p.c, ws, count);
  std::vector<Cand> out;
  for (int i = 0; i < static_cast<int>(res.size()); ++i) {
    Cand c;
    c.algo = res[i].algo;
    c.waves = res[i].wavesCount;
    c.heuristic_rank = i;
    out.push_back(c);
  }
  return out;
}

template <typename T>
static std::vector<T> CapArray(const cublasLtMatmulAlgo_t& a, cublasLtMatmulAlgoCapAttributes_t attr) {
  size_t bytes = 0;
  if (cublasLtMatmulAlgoCapGetAttribute(&a, attr, nullptr, 0, &bytes) != CUBLAS_STATUS_SUCCESS || bytes == 0) {
    return {};
  }
  std::vector<T> v(bytes / sizeof(T));
  cublasLtMatmulAlgoCapGetAttribute(&a, attr, v.data(), bytes, &bytes);
  return v;
}

template <typename T>
static T CapScalar(const cublasLtMatmulAlgo_t& a, cublasLtMatmulAlgoCapAttributes_t attr) {
  T v{};
  size_t w = 0;
  cublasLtMatmulAlgoCapGetAttribute(&a, attr, &v, sizeof(v), &w);
  return v;
}

template <typename T>
static void Set(cublasLtMatmulAlgo_t* a, cublasLtMatmulAlgoConfigAttributes_t attr, T v) {
  cublasLtMatmulAlgoConfigSetAttribute(a, attr, &v, sizeof(v));
}

static bool Check(cublasLtHandle_t h, const Problem& p, size_t ws, const cublasLtMatmulAlgo_t& a, Cand* c) {
  cublasLtMatmulHeuristicResult_t r{};
  if (cublasLtMatmulAlgoCheck(h, p.desc, p.a, p.b, p.c, p.c, &a, &r) != CUBLAS_STATUS_SUCCESS ||
      r.workspaceSize > ws) {
    return false;
  }
  c->algo = a;
  c->waves = r.wavesCount;
  return true;
}

// Level 1: every algo id for these types, every tile and stages id it offers, the other settings at
// their defaults (split-K 1, no swizzling, custom option 0, cluster shape auto).
static std::vector<Cand> Level1(cublasLtHandle_t h, const Problem& p, size_t ws, long* checked) {
  int ids[512];
  int nids = 0;
  LT(cublasLtMatmulAlgoGetIds(h, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF, CUDA_R_16BF, CUDA_R_16BF,
                              CUDA_R_16BF, 512, ids, &nids));
  std::vector<Cand> out;
  for (int i = 0; i < nids; ++i) {
    cublasLtMatmulAlgo_t base;
    if (cublasLtMatmulAlgoInit(h, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF, CUDA_R_16BF, CUDA_R_16BF,
                               CUDA_R_16BF, ids[i], &base) != CUBLAS_STATUS_SUCCESS) {
      continue;
    }
    std::vector<uint32_t> tiles = CapArray<uint32_t>(base, CUBLASLT_ALGO_CAP_TILE_IDS);
    std::vector<uint32_t> stages = CapArray<uint32_t>(base, CUBLASLT_ALGO_CAP_STAGES_IDS);
    if (tiles.empty()) tiles.push_back(CUBLASLT_MATMUL_TILE_UNDEFINED);
    if (stages.empty()) stages.push_back(CUBLASLT_MATMUL_STAGES_UNDEFINED);
    for (uint32_t tile : tiles) {
      for (uint32_t st : stages) {
        cublasLtMatmulAlgo_t a = base;
        Set<uint32_t>(&a, CUBLASLT_ALGO_CONFIG_TILE_ID, tile);
        Set<uint32_t>(&a, CUBLASLT_ALGO_CONFIG_STAGES_ID, st);
        ++*checked;
        Cand c;
        if (Check(h, p, ws, a, &c)) out.push_back(c);
      }
    }
  }
  return out;
}

// Level 2: around each seed, split-K 2/3/4 (each reduction scheme the algo supports), CTA swizzling,
// custom options 0-3 and cluster shapes auto/1x1/2x1/1x2/2x2/4x1/1x4.
static std::vector<Cand> Level2(cublasLtHandle_t h, const Problem& p, size_t ws, const std::vector<Cand>& seeds,
                                long* checked) {
  const uint16_t clusters[] = {CUBLASLT_CLUSTER_SHAPE_AUTO, CUBLASLT_CLUSTER_SHAPE_1x1x1,
                               CUBLASLT_CLUSTER_SHAPE_2x1x1, CUBLASLT_CLUSTER_SHAPE_1x2x1,
                               CUBLASLT_CLUSTER_SHAPE_2x2x1, CUBLASLT_CLUSTER_SHAPE_4x1x1,
                               CUBLASLT_CLUSTER_SHAPE_1x4x1};
  std::vector<Cand> out;
  for (const Cand& seed : seeds) {
    const cublasLtMatmulAlgo_t& base = seed.algo;
    const int32_t splitk_ok = CapScalar<int32_t>(base, CUBLASLT_ALGO_CAP_SPLITK_SUPPORT);
    const uint32_t red_mask = CapScalar<uint32_t>(base, CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK);
    const uint32_t swz_ok = CapScalar<uint32_t>(base, CUBLASLT_ALGO_CAP_CTA_SWIZZLING_SUPPORT);
    const int32_t custom_max = CapScalar<int32_t>(base, CUBLASLT_ALGO_CAP_CUSTOM_OPTION_MAX);
    std::vector<std::pair<int32_t, uint32_t>> splits = {{1, CUBLASLT_REDUCTION_SCHEME_NONE}};
    if (splitk_ok) {
      for (int32_t sk : {2, 3, 4}) {
        for (uint32_t r : {CUBLASLT_REDUCTION_SCHEME_INPLACE, CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE,
                           CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE}) {
          if (red_mask & r) splits.emplace_back(sk, r);
        }
      }
    }
    for (auto [sk, red] : splits) {
      for (uint32_t swz = 0; swz <= (swz_ok ? 1u : 0u); ++swz) {
        for (int32_t cu = 0; cu <= std::min(custom_max, 3); ++cu) {
          for (uint16_t cl : clusters) {
            if (sk == 1 && swz == 0 && cu == 0 && cl == CUBLASLT_CLUSTER_SHAPE_AUTO) continue;  // the seed
            cublasLtMatmulAlgo_t a = base;
            Set<int32_t>(&a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, sk);
            Set<uint32_t>(&a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, red);
            Set<uint32_t>(&a, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, swz);
            Set<uint32_t>(&a, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, static_cast<uint32_t>(cu));
            if (cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cl,
                                                     sizeof(cl)) != CUBLAS_STATUS_SUCCESS) {
              continue;
            }
            ++*checked;
            Cand c;
            if (Check(h, p, ws, a, &c)) out.push_back(c);
          }
        }
      }
    }
  }
  return out;
}

static std::string Describe(const Cand& c) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), " waves %.2f", c.waves);
  return AlgoConfig(c.algo) + buf +
         (c.heuristic_rank >= 0 ? " (heuristic #" + std::to_string(c.heuristic_rank) + ")" : std::string());
}

int main(int argc, char** argv) {
  const int tp = argc > 1 ? std::atoi(argv[1]) : 4;
  const int rounds = argc > 2 ? std::max(1, std::atoi(argv[2])) : 5;
  const int iters = argc > 3 ? std::atoi(argv[3]) : 10;
  const int top = argc > 4 ? std::atoi(argv[4]) : 24;
  const char* only = argc > 5 && std::strcmp(argv[5], "all") != 0 ? argv[5] : nullptr;
  const int confirm = argc > 6 ? std::atoi(argv[6]) : 15;
  std::mt19937 rng(7);
  const std::vector<Op>& ops = kBenchOps;
  CK(cudaSetDevice(0));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  cublasLtHandle_t h;
  LT(cublasLtCreate(&h));
  std::printf("# %s, cuBLASLt %zu; tp %d, %d rounds x %d calls, top %d of the screen; random bf16\n",
              prop.name, cublasLtGetVersion(), tp, rounds, iters, top);
  const size_t ws_bytes = 32u << 20;
  void* ws = nullptr;
  CK(cudaMalloc(&ws, ws_bytes));
  float* cmp = nullptr;
  CK(cudaMalloc(&cmp, 3 * sizeof(float)));
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  const float alpha = 1, beta = 0;
  for (const Op& op : ops) {
    if (only && std::strcmp(only, op.name) != 0) continue;
    const long m = op.M, k = op.rs ? op.K / tp : op.K, n = op.rs ? op.N : op.N / tp;
    __nv_bfloat16 *x, *w, *y, *yref;
    CK(cudaMalloc(&x, m * k * 2));
    CK(cudaMalloc(&w, k * n * 2));
    CK(cudaMalloc(&y, m * n * 2));
    CK(cudaMalloc(&yref, m * n * 2));
    FillRandom<<<1024, 256, 0, s>>>(x, m * k, 1u);
    FillRandom<<<1024, 256, 0, s>>>(w, k * n, 2u);
    CK(cudaGetLastError());
    char shape[40];
    std::snprintf(shape, sizeof(shape), "%ld,%ld,%ld", op.M, op.K, op.N);
    double ref_ms = 0;  // the whole GEMM with the heuristic's first
    double ref_confirmed = 1;  // the same, in its confirmation rounds
    for (int parts : {1, tp}) {
      const long mc = m / parts;
      Problem p = MakeProblem(mc, n, k);
      std::vector<Cand> heur = Heuristic(h, p, ws_bytes, 8);
      long checked = 0;
      const auto t_start = std::chrono::steady_clock::now();
      if (heur.empty()) {
        std::printf("%s %s parts %d: the heuristic has no algorithm\n", op.name, shape, parts);
        FreeProblem(p);
        continue;
      }
      auto run = [&](const Cand& c, __nv_bfloat16* out) -> bool {
        for (int j = 0; j < parts; ++j) {
          if (cublasLtMatmul(h, p.desc, &alpha, w, p.a, x + j * mc * k, p.b, &beta, out + j * mc * n, p.c,
                             out + j * mc * n, p.c, &c.algo, ws, ws_bytes, s) != CUBLAS_STATUS_SUCCESS) {
            return false;
          }
        }
        return true;
      };
      auto time_calls = [&](const Cand& c, int calls) -> double {
        CK(cudaEventRecord(e0, s));
        for (int i = 0; i < calls; ++i) run(c, y);
        CK(cudaEventRecord(e1, s));
        CK(cudaEventSynchronize(e1));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        return ms / calls;
      };
      // Heat the GPU to its sustained clocks with the heuristic's first (about 300 ms).
      const double one = time_calls(heur[0], 3);
      time_calls(heur[0], std::max(3, static_cast<int>(300.0 / std::max(one, 1e-3))));
      // Screen: one warm call, one timed call (dropped if 2.5x the heuristic's first), then the median
      // of 3 single timed calls; sorted fastest first.
      long screened = 0;
      auto screen = [&](std::vector<Cand>& cands) {
        std::vector<Cand> ran;
        for (Cand& c : cands) {
          if (!run(c, y) || cudaStreamSynchronize(s) != cudaSuccess) {
            cudaGetLastError();
            continue;
          }
          if (time_calls(c, 1) > 2.5 * one) continue;  // far slower: not worth 3 more calls
          std::vector<double> v;
          for (int i = 0; i < 3; ++i) v.push_back(time_calls(c, 1));
          c.screen = Median(v);
          ran.push_back(c);
        }
        screened += static_cast<long>(ran.size());
        std::sort(ran.begin(), ran.end(), [](const Cand& a, const Cand& b) { return a.screen < b.screen; });
        return ran;
      };
      std::vector<Cand> l1 = Level1(h, p, ws_bytes, &checked);
      std::vector<Cand> ran = screen(l1);
      std::vector<Cand> seeds(ran.begin(), ran.begin() + std::min<size_t>(ran.size(), 12));
      for (const Cand& c : heur) seeds.push_back(c);
      std::vector<Cand> l2 = Level2(h, p, ws_bytes, seeds, &checked);
      std::vector<Cand> ran2 = screen(l2);
      ran.insert(ran.end(), ran2.begin(), ran2.end());
      std::sort(ran.begin(), ran.end(), [](const Cand& a, const Cand& b) { return a.screen < b.screen; });
      if (static_cast<int>(ran.size()) > top) ran.resize(top);
      std::vector<Cand> timed = heur;
      for (Cand& c : ran) timed.push_back(c);
      for (int rd = 0; rd < rounds; ++rd) {
        for (Cand& c : timed) c.t.push_back(time_calls(c, iters));
      }
      if (parts == 1) ref_ms = Median(timed[0].t);
      int best_h = 0, best = 0;
      for (int i = 0; i < static_cast<int>(timed.size()); ++i) {
        if (i < static_cast<int>(heur.size()) && Median(timed[i].t) < Median(timed[best_h].t)) best_h = i;
        if (Median(timed[i].t) < Median(timed[best].t)) best = i;
      }
      // Confirmation, free of the search's selection bias (the fastest of many noisy timings is
      // faster than its true time): the heuristic's first, the best of its 8 and the best found,
      // timed afresh in `confirm` rounds, each in a new random order.
      const Cand* fin[3] = {&timed[0], &timed[best_h], &timed[best]};
      std::vector<double> ct[3];
      int ord[3] = {0, 1, 2};
      for (int rd = 0; rd < confirm; ++rd) {
        std::shuffle(ord, ord + 3, rng);
        for (int i : ord) ct[i].push_back(time_calls(*fin[i], iters));
      }
      const double c0 = Median(ct[0]);
      if (parts == 1) ref_confirmed = c0;
      // The best's output against the heuristic's first, both over NaN-poisoned memory.
      FillNaN<<<1024, 256, 0, s>>>(yref, m * n);
      FillNaN<<<1024, 256, 0, s>>>(y, m * n);
      run(timed[0], yref);
      run(timed[best], y);
      CK(cudaMemsetAsync(cmp, 0, 3 * sizeof(float), s));
      Compare<<<1024, 256, 0, s>>>(y, yref, m * n, cmp);
      float c3[3];
      CK(cudaMemcpyAsync(c3, cmp, sizeof(c3), cudaMemcpyDeviceToHost, s));
      CK(cudaStreamSynchronize(s));
      std::printf("%s %-18s %s  checked %6ld  ran %5ld  ref %.4f ms  heuristic first %.3f  best of its %zu "
                  "%.3f  best found %.3f  (max|d| %.3g of max %.3g, non-finite %.0f)\n",
                  op.name, shape, parts == 1 ? "whole " : "chunks", checked, screened, ref_ms,
                  Median(timed[0].t) / ref_ms, heur.size(), Median(timed[best_h].t) / ref_ms,
                  Median(timed[best].t) / ref_ms, c3[0], c3[1], c3[2]);
      std::printf("    confirmed (%d rounds, random order): heuristic first %.4f ms (%.3f of the whole's), best of "
                  "its 8 %.3f, best found %.3f of the heuristic's first\n", confirm, c0, c0 / ref_confirmed,
                  Median(ct[1]) / c0, Median(ct[2]) / c0);
      std::printf("    heuristic first: %s\n    best found:      %s\n    (%.1f s)\n", Describe(timed[0]).c_str(),
                  Describe(timed[best]).c_str(),
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count());
      for (int i = 0; i < std::min<int>(5, static_cast<int>(ran.size())); ++i) {
        const Cand& c = timed[heur.size() + i];
        std::printf("    screen #%d %.3f: %s\n", i, Median(c.t) / ref_ms, Describe(c).c_str());
      }
      std::fflush(stdout);
      FreeProblem(p);
    }
    CK(cudaFree(x));
    CK(cudaFree(w));
    CK(cudaFree(y));
    CK(cudaFree(yref));
  }
  return 0;
}
