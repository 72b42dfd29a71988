#include "comm/device_info.h"

#include <cuda_runtime_api.h>

#include <cctype>

#include "comm/driver.h"

namespace jax_ub {

RuntimeFacts QueryRuntime() {
  RuntimeFacts f;
  int driver = 0;
  cudaError_t err = cudaDriverGetVersion(&driver);
  f.driver_version = err == cudaSuccess ? driver : 0;
  int count = 0;
  err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    f.error = std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
    cudaGetLastError();
    return f;
  }
  f.device_count = count;
  return f;
}

std::vector<std::string> PciBusIds() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return {};
  }
  std::vector<std::string> out(n);
  for (int i = 0; i < n; ++i) {
    char buf[32] = {0};
    if (cudaDeviceGetPCIBusId(buf, sizeof(buf), i) != cudaSuccess) {
      cudaGetLastError();
      continue;
    }
    std::string id(buf);
    for (char& c : id) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    out[i] = id;
  }
  return out;
}

std::vector<std::vector<int>> P2PMatrix() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return {};
  }
  std::vector<std::vector<int>> m(n, std::vector<int>(n, 1));
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      if (i != j && cudaDeviceCanAccessPeer(&m[i][j], i, j) != cudaSuccess) m[i][j] = 0;
    }
  }
  cudaGetLastError();
  return m;
}

Status DeviceMemory(int device, size_t* free_bytes, size_t* total_bytes) {
  *free_bytes = *total_bytes = 0;
  if (cudaSetDevice(device) != cudaSuccess ||
      cudaMemGetInfo(free_bytes, total_bytes) != cudaSuccess) {
    cudaGetLastError();
    return Status::Error(StrCat() << "cudaMemGetInfo failed on device " << device);
  }
  return Status::Ok();
}

std::string DriverProblem() {
  const Driver* d = nullptr;
  Status s = GetDriver(&d);
  return s.ok() ? std::string() : s.message();
}

}  // namespace jax_ub
