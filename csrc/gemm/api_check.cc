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
static_assert(kPrefMaxWorkspaceBytes == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES);
static_assert(kPrefMinAlignmentABytes == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES);
static_assert(kPrefMinAlignmentBBytes == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES);
static_assert(kPrefMinAlignmentCBytes == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES);
static_assert(kPrefMinAlignmentDBytes == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES);
static_assert(kAlgoConfigId == CUBLASLT_ALGO_CONFIG_ID);
static_assert(kAlgoConfigTileId == CUBLASLT_ALGO_CONFIG_TILE_ID);
static_assert(kAlgoConfigSplitKNum == CUBLASLT_ALGO_CONFIG_SPLITK_NUM);
static_assert(kAlgoConfigCustomOption == CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION);
static_assert(kAlgoConfigStagesId == CUBLASLT_ALGO_CONFIG_STAGES_ID);
static_assert(kAlgoConfigClusterShapeId == CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID);
static_assert(kAlgoCapCustomOptionMax == CUBLASLT_ALGO_CAP_CUSTOM_OPTION_MAX);
static_assert(kClusterShapeAuto == CUBLASLT_CLUSTER_SHAPE_AUTO);
static_assert(kClusterShape1x1x1 == CUBLASLT_CLUSTER_SHAPE_1x1x1);
static_assert(kClusterShape2x1x1 == CUBLASLT_CLUSTER_SHAPE_2x1x1);
static_assert(kClusterShape1x2x1 == CUBLASLT_CLUSTER_SHAPE_1x2x1);
static_assert(std::is_same_v<decltype(&cublasLtMatmulAlgoCheck),
                             cublasStatus_t (*)(cublasLtHandle_t, cublasLtMatmulDesc_t,
                                                cublasLtMatrixLayout_t, cublasLtMatrixLayout_t,
                                                cublasLtMatrixLayout_t, cublasLtMatrixLayout_t,
                                                const cublasLtMatmulAlgo_t*,
                                                cublasLtMatmulHeuristicResult_t*)>);
static_assert(std::is_same_v<decltype(&cublasLtMatmulAlgoConfigSetAttribute),
                             cublasStatus_t (*)(cublasLtMatmulAlgo_t*, cublasLtMatmulAlgoConfigAttributes_t,
                                                const void*, size_t)>);
static_assert(std::is_same_v<decltype(&cublasLtMatmulAlgoConfigGetAttribute),
                             cublasStatus_t (*)(const cublasLtMatmulAlgo_t*,
                                                cublasLtMatmulAlgoConfigAttributes_t, void*, size_t,
                                                size_t*)>);
static_assert(std::is_same_v<decltype(&cublasLtMatmulAlgoCapGetAttribute),
                             cublasStatus_t (*)(const cublasLtMatmulAlgo_t*,
                                                cublasLtMatmulAlgoCapAttributes_t, void*, size_t,
                                                size_t*)>);
static_assert(sizeof(MatmulAlgo) == sizeof(cublasLtMatmulAlgo_t));
static_assert(sizeof(HeuristicResult) == sizeof(cublasLtMatmulHeuristicResult_t));
static_assert(offsetof(HeuristicResult, workspaceSize) ==
              offsetof(cublasLtMatmulHeuristicResult_t, workspaceSize));
static_assert(offsetof(HeuristicResult, state) == offsetof(cublasLtMatmulHeuristicResult_t, state));
static_assert(sizeof(Status) == sizeof(cublasStatus_t));
static_assert(std::is_same_v<decltype(&cublasLtMatmul),
                             cublasStatus_t (*)(cublasLtHandle_t, cublasLtMatmulDesc_t, const void*,
                                                const void*, cublasLtMatrixLayout_t, const void*,
                                                cublasLtMatrixLayout_t, const void*, const void*,
                                                cublasLtMatrixLayout_t, void*,
                                                cublasLtMatrixLayout_t, const cublasLtMatmulAlgo_t*,
                                                void*, size_t, cudaStream_t)>);
}  // namespace jax_ub::lt
#define JAX_UB_CUBLASLT_API_CHECKED 1
#else
#define JAX_UB_CUBLASLT_API_CHECKED 0
#endif

namespace jax_ub {
bool CublasLtApiChecked() { return JAX_UB_CUBLASLT_API_CHECKED != 0; }
}  // namespace jax_ub
