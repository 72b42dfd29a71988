// Compile-time check that gemm/cublaslt_api.h matches the real cuBLASLt header, when one is
// available at build time (CUDA toolkit or the nvidia-cublas wheel). Nothing here runs.
#include "gemm/cublaslt_api.h"

#if __has_include(<cublasLt.h>)
#include <cublasLt.h>

#include <type_traits>

namespace jax_ub::lt {
static_assert(kSuccess == CUBLAS_STATUS_SUCCESS);
static_assert(kCompute32F == CUBLAS_COMPUTE_32F);
static_assert(kCompute32FFastTF32 == CUBLAS_COMPUTE_32F_FAST_TF32);
static_assert(kOpN == CUBLAS_OP_N && kOpT == CUBLAS_OP_T);
static_assert(kDescTransA == CUBLASLT_MATMUL_DESC_TRANSA);
static_assert(kDescTransB == CUBLASLT_MATMUL_DESC_TRANSB);
static_assert(kDescSmCountTarget == CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET);
static_assert(kDescAScalePointer == CUBLASLT_MATMUL_DESC_A_SCALE_POINTER);
static_assert(kDescBScalePointer == CUBLASLT_MATMUL_DESC_B_SCALE_POINTER);
static_assert(kDescFastAccum == CUBLASLT_MATMUL_DESC_FAST_ACCUM);
static_assert(kPrefMaxWorkspaceBytes == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES);
static_assert(kPrefMinAlignmentABytes == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES);
static_assert(kPrefMinAlignmentBBytes == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES);
static_assert(kPrefMinAlignmentCBytes == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES);
static_assert(kPrefMinAlignmentDBytes == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES);
static_assert(sizeof(MatmulAlgo) == sizeof(cublasLtMatmulAlgo_t));
static_assert(sizeof(HeuristicResult) == sizeof(cublasLtMatmulHeuristicResult_t));
static_assert(offsetof(HeuristicResult, workspaceSize) ==
              offsetof(cublasLtMatmulHeuristicResult_t, workspaceSize));
static_assert(offsetof(HeuristicResult, state) == offsetof(cublasLtMatmulHeuristicResult_t, state));
static_assert(sizeof(Status) == sizeof(cublasStatus_t));
static_assert(
    std::is_same_v<decltype(&cublasLtMatmul),
                   cublasStatus_t (*)(cublasLtHandle_t, cublasLtMatmulDesc_t, const void*,
                                      const void*, cublasLtMatrixLayout_t, const void*,
                                      cublasLtMatrixLayout_t, const void*, const void*,
                                      cublasLtMatrixLayout_t, void*, cublasLtMatrixLayout_t,
                                      const cublasLtMatmulAlgo_t*, void*, size_t, cudaStream_t)>);
}  // namespace jax_ub::lt
#define JAX_UB_CUBLASLT_API_CHECKED 1
#else
#define JAX_UB_CUBLASLT_API_CHECKED 0
#endif

namespace jax_ub {
bool CublasLtApiChecked() { return JAX_UB_CUBLASLT_API_CHECKED != 0; }
}  // namespace jax_ub
