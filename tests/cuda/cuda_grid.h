// tests/cuda/cuda_grid.h — the shape grid every CUDA kernel family is tested on: dtypes, head dims
// (instantiated and predicated, d ≠ dv), causal or not, odd lengths, MHA and GQA; plus the shared
// naming and the per-dtype base configuration of the feature tests.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "test_util.h"

namespace fa_test::cuda {

inline const char* dtype_tag(flashattn::DType t) { return t == flashattn::DType::f16 ? "f16" : "bf16"; }

struct GridCase {
  flashattn::DType dtype;
  int d, dv;
  bool causal;
  int sq, sk;
  int group;  // h / hk
};

// Every combination of dtype × (d, dv) × causal × (sq, sk) × group ∈ {1, 8}.
inline std::vector<GridCase> grid_cases(const std::vector<std::pair<int, int>>& shapes) {
  const std::pair<int, int> dims[] = {{64, 64}, {96, 96}, {128, 128}, {256, 256}, {192, 128}};
  std::vector<GridCase> cases;
  for (flashattn::DType dt : {flashattn::DType::f16, flashattn::DType::bf16})
    for (auto [d, dv] : dims)
      for (bool causal : {false, true})
        for (auto [sq, sk] : shapes)
          for (int group : {1, 8}) cases.push_back({dt, d, dv, causal, sq, sk, group});
  return cases;
}

inline std::string grid_name(const testing::TestParamInfo<GridCase>& info) {
  const GridCase& g = info.param;
  return std::string(dtype_tag(g.dtype)) + "_d" + std::to_string(g.d) + "_dv" + std::to_string(g.dv) +
         (g.causal ? "_causal" : "_full") + "_" + std::to_string(g.sq) + "x" + std::to_string(g.sk) + "_gqa" +
         std::to_string(g.group);
}

// The problem of one grid case: hk = 2 (MHA) or 1 (GQA 8:1); two batch entries where the fp64
// reference stays cheap.
inline AttnConfig grid_config(const GridCase& g) {
  AttnConfig cfg;
  cfg.dtype = g.dtype;
  cfg.head_dim = g.d;
  cfg.head_dim_v = g.dv;
  cfg.seqlen_q = g.sq;
  cfg.seqlen_k = g.sk;
  cfg.heads_k = g.group == 1 ? 2 : 1;
  cfg.heads = cfg.heads_k * g.group;
  cfg.batch = std::int64_t(g.sq) * g.sk > 100000 ? 1 : 2;
  cfg.opt.causal = g.causal;
  return cfg;
}

// Base of the per-dtype feature tests: b = 2, h = 4, hk = 2.
inline AttnConfig feature_config(flashattn::DType dtype, int d, int sq, int sk) {
  AttnConfig cfg;
  cfg.dtype = dtype;
  cfg.head_dim = d;
  cfg.seqlen_q = sq;
  cfg.seqlen_k = sk;
  cfg.batch = 2;
  cfg.heads = 4;
  cfg.heads_k = 2;
  return cfg;
}

}  // namespace fa_test::cuda
