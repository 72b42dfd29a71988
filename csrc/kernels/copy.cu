#include "kernels/copy.h"

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace jax_ub {
namespace {

constexpr int kThreads = 1024;
constexpr int kUnroll = 8;  // 16-byte vectors per thread per step: 128 KiB in flight per block

// 16-byte vectors [0, n): each step a block moves kUnroll * kThreads vectors, all loads first.
__global__ void __launch_bounds__(kThreads)
    CopyVec(uint4* __restrict__ dst, const uint4* __restrict__ src, size_t n) {
  const size_t step = static_cast<size_t>(gridDim.x) * kThreads * kUnroll;
  for (size_t base = static_cast<size_t>(blockIdx.x) * kThreads * kUnroll + threadIdx.x; base < n;
       base += step) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const size_t i = base + static_cast<size_t>(u) * kThreads;
      if (i < n) v[u] = src[i];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const size_t i = base + static_cast<size_t>(u) * kThreads;
      if (i < n) dst[i] = v[u];
    }
  }
}

// Units of T [0, n): the body of a copy whose pointers are misaligned alike only modulo
// sizeof(T) < 16 (a chunk at a row offset whose rows are not a multiple of 16 bytes).
template <typename T>
__global__ void CopyUnits(T* __restrict__ dst, const T* __restrict__ src, size_t n) {
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    dst[i] = src[i];
  }
}

// The bytes before and after the body, one per thread (fewer than 16 each): [0, head) and
// [tail_begin, bytes).
__global__ void CopyEdges(char* __restrict__ dst, const char* __restrict__ src, size_t head,
                          size_t tail_begin, size_t bytes) {
  const size_t i = threadIdx.x;
  if (i < head) dst[i] = src[i];
  if (tail_begin + i < bytes) dst[tail_begin + i] = src[tail_begin + i];
}

// Hopper and later: each block (one thread at work) streams its tiles through shared memory with
// bulk asynchronous copies (TMA, no tensor map: cp.async.bulk), kTmaStages tiles in flight. A
// block of plain loads tops out near 32 GB/s (its SM's outstanding misses), so a few SMs beside a
// GEMM could not keep up; the bulk copies keep kTmaStages * kTmaTile bytes in flight per SM.
constexpr int kTmaStages = 4;
constexpr uint32_t kTmaTile = 32u << 10;
constexpr size_t kTmaSmem = size_t(kTmaStages) * kTmaTile;

__global__ void __launch_bounds__(32)
    CopyTma(char* __restrict__ dst, const char* __restrict__ src, size_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char stage_mem[];
  __shared__ __align__(8) uint64_t bar[kTmaStages];
  if (threadIdx.x != 0) return;
  const size_t tiles = (bytes + kTmaTile - 1) / kTmaTile;
  const size_t mine = tiles > blockIdx.x ? (tiles - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
  const uint32_t smem0 = static_cast<uint32_t>(__cvta_generic_to_shared(stage_mem));
  uint32_t bars[kTmaStages];
#pragma unroll
  for (int s = 0; s < kTmaStages; ++s) {
    bars[s] = static_cast<uint32_t>(__cvta_generic_to_shared(&bar[s]));
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bars[s]) : "memory");
  }
  asm volatile("fence.mbarrier_init.release.cluster;\n\tfence.proxy.async.shared::cta;" ::
                   : "memory");
  auto tile = [&](size_t i, size_t* off) {
    *off = (blockIdx.x + i * gridDim.x) * static_cast<size_t>(kTmaTile);
    return static_cast<uint32_t>(bytes - *off < kTmaTile ? bytes - *off : kTmaTile);
  };
  auto load = [&](size_t i) {
    size_t off;
    const uint32_t n = tile(i, &off), s = static_cast<uint32_t>(i % kTmaStages);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bars[s]), "r"(n)
                 : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
            "r"(smem0 + s * kTmaTile),
        "l"(src + off), "r"(n), "r"(bars[s])
        : "memory");
  };
  for (size_t i = 0; i < mine && i < static_cast<size_t>(kTmaStages); ++i) load(i);
  for (size_t i = 0; i < mine; ++i) {
    size_t off;
    const uint32_t n = tile(i, &off), s = static_cast<uint32_t>(i % kTmaStages);
    const uint32_t parity = static_cast<uint32_t>((i / kTmaStages) & 1);
    asm volatile(
        "{\n\t.reg .pred p;\n\tWAIT:\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n\t"
        "@p bra DONE;\n\tbra WAIT;\n\tDONE:\n\t}" ::"r"(bars[s]),
        "r"(parity)
        : "memory");
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst + off),
                 "r"(smem0 + s * kTmaTile), "r"(n)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    // Refill the stage the previous tile's store read from, once that read is done (this tile's
    // store may still be reading).
    if (i >= 1 && i - 1 + kTmaStages < mine) {
      asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
      load(i - 1 + kTmaStages);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
#else
  // An image for an earlier architecture (e.g. the compute_80 PTX that the driver compiles for a
  // GPU this build has no binary for): HasTma() does not pick this kernel there, but should it
  // run, it copies all the same, 16-byte vectors (the caller passes aligned whole vectors).
  const size_t n = bytes / 16;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
  }
#endif
}

// Whether CopyTma runs its bulk-copy body on the current device: the device is Hopper or later
// AND the image the driver loaded for it was compiled for sm_90 or later. A build without an sm_90
// binary (JAX_UB_CUDA_ARCHS without 90a, or a newer GPU, which JIT-compiles the compute_80 PTX)
// has the fallback body there. Asked once per device.
bool HasTma() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> known[kMaxDevices] = {};  // 0 unknown, 1 no, 2 yes
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  if (device >= 0 && device < kMaxDevices) {
    const int k = known[device].load(std::memory_order_relaxed);
    if (k != 0) return k == 2;
  }
  int major = 0, smem_optin = 0;
  cudaFuncAttributes attr{};
  // The stages need kTmaSmem of dynamic shared memory beside the static barriers: more than some
  // GPUs with TMA allow a block (sm_120: 99 KiB), where the plain vector copy serves.
  const bool yes =
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
      major >= 9 &&
      cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) ==
          cudaSuccess &&
      cudaFuncGetAttributes(&attr, CopyTma) == cudaSuccess && attr.ptxVersion >= 90 &&
      attr.binaryVersion >= 90 &&
      static_cast<size_t>(smem_optin) >= kTmaSmem + attr.sharedSizeBytes;
  cudaGetLastError();
  if (device >= 0 && device < kMaxDevices) known[device].store(yes ? 2 : 1);
  return yes;
}

int Grid(size_t work, int max_blocks) {
  const size_t blocks = (work + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < static_cast<size_t>(max_blocks) ? blocks : max_blocks);
}

}  // namespace

Status PreloadCopyKernels() {
  cudaFuncAttributes attr;
  JAX_UB_CUDA_RETURN(cudaFuncGetAttributes(&attr, CopyVec));
  JAX_UB_CUDA_RETURN(cudaFuncGetAttributes(&attr, CopyUnits<uint2>));
  JAX_UB_CUDA_RETURN(cudaFuncGetAttributes(&attr, CopyUnits<uint32_t>));
  JAX_UB_CUDA_RETURN(cudaFuncGetAttributes(&attr, CopyUnits<uint16_t>));
  JAX_UB_CUDA_RETURN(cudaFuncGetAttributes(&attr, CopyUnits<char>));
  JAX_UB_CUDA_RETURN(cudaFuncGetAttributes(&attr, CopyEdges));
  JAX_UB_CUDA_RETURN(cudaFuncGetAttributes(&attr, CopyTma));
  // Once per device (communicator creation), before any op launches CopyTma there.
  if (HasTma()) {
    JAX_UB_CUDA_RETURN(cudaFuncSetAttribute(CopyTma, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(kTmaSmem)));
  }
  return Status::Ok();
}

Status LaunchCopy(void* dst, const void* src, size_t bytes, int max_blocks, cudaStream_t stream) {
  if (bytes == 0) return Status::Ok();
  if (max_blocks < 1) max_blocks = 1;
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  // The widest unit (16 bytes down to 1) in which both pointers are misaligned alike: the bytes up
  // to a unit boundary (head) and after the last whole unit (tail) go one by one, the body in
  // units.
  const uintptr_t da = reinterpret_cast<uintptr_t>(d), sa = reinterpret_cast<uintptr_t>(s);
  size_t unit = 16;
  while (unit > 1 && da % unit != sa % unit) unit /= 2;
  const size_t head = std::min(bytes, (unit - da % unit) % unit);
  const size_t units = (bytes - head) / unit, body = units * unit;
  char* bd = d + head;
  const char* bs = s + head;
  if (units == 0) {
  } else if (unit == 16 && HasTma()) {  // its shared-memory size was allowed at preload
    const size_t tiles = (body + kTmaTile - 1) / kTmaTile;
    CopyTma<<<static_cast<int>(tiles < static_cast<size_t>(max_blocks) ? tiles : max_blocks), 32,
              kTmaSmem, stream>>>(bd, bs, body);
  } else if (unit == 16) {
    CopyVec<<<Grid((units + kUnroll - 1) / kUnroll, max_blocks), kThreads, 0, stream>>>(
        reinterpret_cast<uint4*>(bd), reinterpret_cast<const uint4*>(bs), units);
  } else if (unit == 8) {
    CopyUnits<<<Grid(units, max_blocks), kThreads, 0, stream>>>(
        reinterpret_cast<uint2*>(bd), reinterpret_cast<const uint2*>(bs), units);
  } else if (unit == 4) {
    CopyUnits<<<Grid(units, max_blocks), kThreads, 0, stream>>>(
        reinterpret_cast<uint32_t*>(bd), reinterpret_cast<const uint32_t*>(bs), units);
  } else if (unit == 2) {
    CopyUnits<<<Grid(units, max_blocks), kThreads, 0, stream>>>(
        reinterpret_cast<uint16_t*>(bd), reinterpret_cast<const uint16_t*>(bs), units);
  } else {
    CopyUnits<<<Grid(units, max_blocks), kThreads, 0, stream>>>(bd, bs, units);
  }
  if (units > 0) JAX_UB_CUDA_RETURN(cudaGetLastError());
  const size_t tail_begin = head + body;
  if (head > 0 || tail_begin < bytes) {
    CopyEdges<<<1, 32, 0, stream>>>(d, s, head, tail_begin, bytes);
    JAX_UB_CUDA_RETURN(cudaGetLastError());
  }
  return Status::Ok();
}

}  // namespace jax_ub
