// What the cuBLASLt probes of scripts/ share beyond probe_util.cuh: an algorithm's configuration
// as text, and the heuristic's candidate list as jax_ub asks for it. Include after <cublasLt.h>'s search path is given (-I$WHEEL/include).
#pragma once

#include <cublasLt.h>

#include <cstdint>
#include <string>
#include <vector>

#include "probe_util.cuh"

// "algo 66 tile 20 stages 35 splitk 1 red 0 swz 0 custom 1 cluster 3". Each attribute is read
// with the size of its own type: cuBLASLt refuses any other size, and a 4-byte read of the 2-byte
// cluster shape id printed "cluster 0" for every algorithm in the first runs of chunk_algo_probe
// and lt_align_probe.
static inline std::string AlgoConfig(const cublasLtMatmulAlgo_t& a) {
  int32_t id = -1, splitk = 0;
  uint32_t tile = 0, stages = 0, red = 0, swizzle = 0, custom = 0;
  uint16_t cluster = 0;
  size_t w = 0;
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof(id), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof(stages), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof(splitk), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &red, sizeof(red), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &swizzle, sizeof(swizzle), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, &custom, sizeof(custom), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster, sizeof(cluster), &w);
  return "algo " + std::to_string(id) + " tile " + std::to_string(tile) + " stages " + std::to_string(stages) +
         " splitk " + std::to_string(splitk) + " red " + std::to_string(red) + " swz " + std::to_string(swizzle) +
         " custom " + std::to_string(custom) + " cluster " + std::to_string(cluster);
}

// The heuristic's top `count` results that it marks runnable, for the GEMM of these descriptors with
// `ws` bytes of workspace and 16-byte alignment of every operand, as jax_ub asks (gemm/cublaslt.cc):
// the same candidate list as the library's plans.
static inline std::vector<cublasLtMatmulHeuristicResult_t> HeuristicList(
    cublasLtHandle_t h, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
    cublasLtMatrixLayout_t c, size_t ws, int count) {
  cublasLtMatmulPreference_t pref;
  LT(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t wsb = ws;
  LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof(wsb)));
  const uint32_t al = 16;
  for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
    LT(cublasLtMatmulPreferenceSetAttribute(pref, attr, &al, sizeof(al)));
  }
  std::vector<cublasLtMatmulHeuristicResult_t> res(count);
  int found = 0;
  LT(cublasLtMatmulAlgoGetHeuristic(h, desc, a, b, c, c, pref, count, res.data(), &found));
  cublasLtMatmulPreferenceDestroy(pref);
  std::vector<cublasLtMatmulHeuristicResult_t> out;
  for (int i = 0; i < found; ++i) {
    if (res[i].state == CUBLAS_STATUS_SUCCESS) out.push_back(res[i]);
  }
  return out;
}
