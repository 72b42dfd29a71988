// What the cuBLASLt probes of scripts/ share beyond probe_util.cuh: an algorithm's configuration
// as text. Include after <cublasLt.h>'s search path is given (-I$WHEEL/include).
#pragma once

#include <cublasLt.h>

#include <cstdint>
#include <string>

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
