// Every GPU sends B bytes to every other GPU at once (the traffic of a bare reduce-scatter or
// all-gather over all local GPUs): which mechanism moves it fastest? The question behind tp=4's
// bare reduce-scatter at ~250 GB/s per GPU against ~390 GB/s of ingress (NOTES.md): copy-engine
// pushes from one GPU to three peers were seen to run one after another.
//
//   ce_push      each GPU: one cudaMemcpyAsync per peer, each on its own stream, into the peer
//   ce_push_1s   the same copies on one stream per GPU (one after another)
//   ce_pull      each GPU: one copy per peer, reading the peer's memory into its own
//   sm_push      each GPU: one kernel of `blocks` CTAs storing 16-byte vectors into every peer
//   sm_pull      each GPU: one kernel of `blocks` CTAs loading every peer's vectors
// and, to tell egress from ingress limits, the same with only GPU 0 active (`solo`).
//
// Prints per mode the median over `reps` of the wall time of `iters` rounds (all GPUs launched,
// then all synchronized), and the per-GPU rate (bytes each active GPU sends / time).
// Build: nvcc -O3 -std=c++17 -arch=sm_90a -o a2a_probe scripts/a2a_probe.cu
// Run:   ./a2a_probe [MiB per peer = 32 64 128] [ngpus = all]
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "probe_util.cuh"

constexpr int kMaxGpus = 8;

struct Ptrs {
  uint4* p[kMaxGpus];
};

// Vector i of the (n - 1) peers' slices: peer q (every rank but me, in order) and offset.
struct Slot {
  int q;
  size_t off;
};
__device__ __forceinline__ Slot SlotOf(size_t i, int me, size_t per) {
  const int j = static_cast<int>(i / per);
  return {j >= me ? j + 1 : j, i % per};
}

// push: my src slice for peer q -> q's dst slot `me`; pull: q's src slice for me -> my dst slot q.
template <bool kPush>
__global__ void SmExchange(Ptrs peers, uint4* __restrict__ mine, int me, int n, size_t per) {
  const size_t total = per * (n - 1);
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const Slot s = SlotOf(i, me, per);
    if (kPush) {
      peers.p[s.q][me * per + s.off] = mine[s.q * per + s.off];
    } else {
      mine[s.q * per + s.off] = peers.p[s.q][me * per + s.off];
    }
  }
}

int main(int argc, char** argv) {
  int n = 0;
  CK(cudaGetDeviceCount(&n));
  std::vector<size_t> mibs;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("n=", 0) == 0) n = std::min(n, std::atoi(a.c_str() + 2));
    else mibs.push_back(std::strtoull(a.c_str(), nullptr, 10));
  }
  if (mibs.empty()) mibs = {32, 64, 128};
  n = std::min(n, kMaxGpus);
  if (n < 2) {
    std::printf("needs >= 2 GPUs, found %d\n", n);
    return 1;
  }
  const size_t max_b = *std::max_element(mibs.begin(), mibs.end()) << 20;
  std::vector<uint4*> src(n), dst(n);
  std::vector<std::vector<cudaStream_t>> st(n, std::vector<cudaStream_t>(n));
  int sms = 0;
  for (int g = 0; g < n; ++g) {
    CK(cudaSetDevice(g));
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, g));
    for (int q = 0; q < n; ++q) {
      if (q == g) continue;
      int can = 0;
      CK(cudaDeviceCanAccessPeer(&can, g, q));
      if (!can) {
        std::printf("GPU %d cannot access GPU %d\n", g, q);
        return 1;
      }
      CK(cudaDeviceEnablePeerAccess(q, 0));
    }
    CK(cudaMalloc(&src[g], max_b * n));
    CK(cudaMalloc(&dst[g], max_b * n));
    CK(cudaMemset(src[g], 1 + g, max_b * n));
    for (int q = 0; q < n; ++q) CK(cudaStreamCreateWithFlags(&st[g][q], cudaStreamNonBlocking));
  }
  auto sync_all = [&] {
    for (int g = 0; g < n; ++g) {
      CK(cudaSetDevice(g));
      CK(cudaDeviceSynchronize());
    }
  };
  const int iters = 5, reps = 7;
  std::printf("%d GPUs, %d SMs each; per mode: median of %d x %d rounds; rate = bytes each active "
              "GPU sends (to %d peers) / time\n", n, sms, reps, iters, n - 1);
  std::printf("%-14s %6s %5s %9s %9s\n", "mode", "MiB", "gpus", "ms", "GB/s");
  for (size_t mib : mibs) {
    const size_t b = mib << 20, per = b / sizeof(uint4);
    auto run = [&](const std::string& mode, bool solo, int blocks) {
      const int active = solo ? 1 : n;
      auto round = [&] {
        for (int g = 0; g < active; ++g) {
          CK(cudaSetDevice(g));
          char* s = reinterpret_cast<char*>(src[g]);
          char* d = reinterpret_cast<char*>(dst[g]);
          if (mode == "sm_push" || mode == "sm_pull") {
            Ptrs p{};
            for (int q = 0; q < n; ++q) p.p[q] = mode == "sm_push" ? dst[q] : src[q];
            if (mode == "sm_push") SmExchange<true><<<blocks, 512, 0, st[g][0]>>>(p, src[g], g, n, per);
            else SmExchange<false><<<blocks, 512, 0, st[g][0]>>>(p, dst[g], g, n, per);
            CK(cudaGetLastError());
            continue;
          }
          for (int q = 0; q < n; ++q) {
            if (q == g) continue;
            cudaStream_t s1 = mode == "ce_push_1s" ? st[g][0] : st[g][q];
            if (mode == "ce_pull") {
              CK(cudaMemcpyAsync(d + q * b, reinterpret_cast<char*>(src[q]) + g * b, b,
                                 cudaMemcpyDeviceToDevice, s1));
            } else {
              CK(cudaMemcpyAsync(reinterpret_cast<char*>(dst[q]) + g * b, s + q * b, b,
                                 cudaMemcpyDeviceToDevice, s1));
            }
          }
        }
      };
      round();
      sync_all();
      std::vector<double> ms;
      for (int r = 0; r < reps; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < iters; ++i) {
          round();
          sync_all();  // rounds do not overlap: each is one exchange
        }
        ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                         .count() / iters);
      }
      std::sort(ms.begin(), ms.end());
      const double m = ms[ms.size() / 2];
      std::string name = mode + (blocks ? "/" + std::to_string(blocks) : "");
      std::printf("%-14s %6zu %5s %9.3f %9.1f\n", name.c_str(), mib, solo ? "0" : "all", m,
                  (n - 1) * static_cast<double>(b) / (m * 1e6));
    };
    for (bool solo : {false, true}) {
      run("ce_push", solo, 0);
      run("ce_push_1s", solo, 0);
      run("ce_pull", solo, 0);
      for (int blocks : {16, 32, 64, sms}) {
        run("sm_push", solo, blocks);
        run("sm_pull", solo, blocks);
      }
    }
  }
  // Correctness of the two kernels (the copies are cudaMemcpyAsync): zero every dst, run one
  // exchange on all GPUs at the largest size, then slot q of every dst must hold bytes 1 + q
  // (first, middle and last byte checked).
  const size_t b = mibs.back() << 20, per = b / sizeof(uint4);
  for (int push = 0; push < 2; ++push) {
    for (int g = 0; g < n; ++g) {
      CK(cudaSetDevice(g));
      CK(cudaMemset(dst[g], 0, max_b * n));
    }
    sync_all();
    for (int g = 0; g < n; ++g) {
      CK(cudaSetDevice(g));
      Ptrs p{};
      for (int q = 0; q < n; ++q) p.p[q] = push ? dst[q] : src[q];
      if (push) SmExchange<true><<<sms, 512>>>(p, src[g], g, n, per);
      else SmExchange<false><<<sms, 512>>>(p, dst[g], g, n, per);
      CK(cudaGetLastError());
    }
    sync_all();
    for (int g = 0; g < n; ++g) {
      CK(cudaSetDevice(g));
      for (int q = 0; q < n; ++q) {
        if (q == g) continue;
        for (size_t at : {size_t{0}, b / 2, b - 1}) {
          unsigned char v = 0;
          CK(cudaMemcpy(&v, reinterpret_cast<char*>(dst[g]) + q * b + at, 1, cudaMemcpyDeviceToHost));
          if (v != 1 + q) {
            std::printf("CHECK FAILED (%s): GPU %d slot %d byte %zu holds %d, want %d\n",
                        push ? "sm_push" : "sm_pull", g, q, at, v, 1 + q);
            return 2;
          }
        }
      }
    }
  }
  std::printf("check: sm_push and sm_pull put every sender's bytes in its slot\n");
  return 0;
}
