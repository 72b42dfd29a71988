// The slice of the cuBLASLt C API that jax_ub calls, declared here so the build needs no cuBLAS
// headers (the library itself is dlopen()ed at run time from jax's nvidia-cublas wheel).
// Values are those of the public cublasLt.h / cublas_api.h; gemm/api_check.cc static_asserts them
// against the real headers whenever those are found at build time.
#pragma once

#include <cuda_runtime_api.h>
#include <library_types.h>  // cudaDataType (CUDA toolkit)

#include <cstddef>
#include <cstdint>

namespace jax_ub::lt {

using Status = int;  // cublasStatus_t
constexpr Status kSuccess = 0;
using Handle = struct cublasLtContext*;
using MatmulDesc = struct cublasLtMatmulDescOpaque_t*;
using MatrixLayout = struct cublasLtMatrixLayoutOpaque_t*;
using MatmulPreference = struct cublasLtMatmulPreferenceOpaque_t*;

struct MatmulAlgo {
  uint64_t data[8];
};
struct HeuristicResult {
  MatmulAlgo algo;
  size_t workspaceSize;
  Status state;
  float wavesCount;
  int reserved[4];
};

// cublasComputeType_t
constexpr int kCompute32F = 68;
constexpr int kCompute32FFastTF32 = 77;
// cublasOperation_t
constexpr int kOpN = 0;
constexpr int kOpT = 1;
// cublasLtMatmulDescAttributes_t
constexpr int kDescTransA = 3;
constexpr int kDescTransB = 4;
constexpr int kDescSmCountTarget = 15;
constexpr int kDescAScalePointer = 17;  // const void* (device float32 for fp32 compute)
constexpr int kDescBScalePointer = 18;
constexpr int kDescFastAccum = 25;  // int8_t: FP8 accumulation without periodic fp32 promotion
// cublasLtMatmulPreferenceAttributes_t
constexpr int kPrefMaxWorkspaceBytes = 1;
constexpr int kPrefMinAlignmentABytes = 5;
constexpr int kPrefMinAlignmentBBytes = 6;
constexpr int kPrefMinAlignmentCBytes = 7;
constexpr int kPrefMinAlignmentDBytes = 8;

// Function pointer types, one per entry point.
using CreateFn = Status(Handle*);
using DestroyFn = Status(Handle);
using GetVersionFn = size_t();
using GetStatusStringFn = const char*(Status);
using MatmulDescCreateFn = Status(MatmulDesc*, int /*compute*/, cudaDataType /*scale*/);
using MatmulDescDestroyFn = Status(MatmulDesc);
using MatmulDescSetAttributeFn = Status(MatmulDesc, int, const void*, size_t);
using MatrixLayoutCreateFn = Status(MatrixLayout*, cudaDataType, uint64_t, uint64_t, int64_t);
using MatrixLayoutDestroyFn = Status(MatrixLayout);
using MatmulPreferenceCreateFn = Status(MatmulPreference*);
using MatmulPreferenceDestroyFn = Status(MatmulPreference);
using MatmulPreferenceSetAttributeFn = Status(MatmulPreference, int, const void*, size_t);
using MatmulAlgoGetHeuristicFn = Status(Handle, MatmulDesc, MatrixLayout, MatrixLayout,
                                        MatrixLayout, MatrixLayout, MatmulPreference, int,
                                        HeuristicResult*, int*);
using MatmulFn = Status(Handle, MatmulDesc, const void* alpha, const void* A, MatrixLayout,
                        const void* B, MatrixLayout, const void* beta, const void* C, MatrixLayout,
                        void* D, MatrixLayout, const MatmulAlgo*, void* workspace, size_t,
                        cudaStream_t);

}  // namespace jax_ub::lt
