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

// Feature configurations that the forward and backward tests both check, per dtype.

// Windows over d 64/128/256: left + right, left only, and causal + left with sq > sk (the first
// rows see no key: out 0, lse +∞, zero gradients).
inline std::vector<AttnConfig> window_configs(flashattn::DType dtype) {
  std::vector<AttnConfig> cfgs;
  for (int d : {64, 128, 256}) {
    AttnConfig cfg = feature_config(dtype, d, 239, 700);
    cfg.opt.window_left = 64;
    cfg.opt.window_right = 17;
    cfgs.push_back(cfg);
    cfg.opt.window_right = -1;
    cfgs.push_back(cfg);
    cfg.opt.causal = true;
    cfg.opt.window_left = 100;
    cfg.seqlen_q = 700;
    cfg.seqlen_k = 239;
    cfgs.push_back(cfg);
  }
  return cfgs;
}

// Softcap 1.5 with scores well past it (q, k in ±3) over d 64/128/256, causal or not.
inline std::vector<AttnConfig> softcap_configs(flashattn::DType dtype) {
  std::vector<AttnConfig> cfgs;
  for (int d : {64, 128, 256}) {
    for (bool causal : {false, true}) {
      AttnConfig cfg = feature_config(dtype, d, 177, 301);
      cfg.qk_amplitude = 3.0f;
      cfg.opt.softcap = 1.5f;
      cfg.opt.causal = causal;
      cfgs.push_back(cfg);
    }
  }
  return cfgs;
}

// Dropout p = 0.17 over d 64/128/256, causal or not.
inline std::vector<AttnConfig> dropout_configs(flashattn::DType dtype) {
  std::vector<AttnConfig> cfgs;
  for (int d : {64, 128, 256}) {
    for (bool causal : {false, true}) {
      AttnConfig cfg = feature_config(dtype, d, 150, 333);
      cfg.opt.dropout_p = 0.17f;
      cfg.opt.dropout_seed = 0x1234567890abcdefull;
      cfg.opt.dropout_offset = 5;
      cfg.opt.causal = causal;
      cfgs.push_back(cfg);
    }
  }
  return cfgs;
}

// Varlen batches with empty query and key sequences, with and without seqused_k.
inline std::vector<AttnConfig> varlen_configs(flashattn::DType dtype) {
  std::vector<AttnConfig> cfgs;
  for (int d : {64, 128, 256}) {
    for (bool causal : {false, true}) {
      for (bool used : {false, true}) {
        AttnConfig cfg = feature_config(dtype, d, 0, 0);
        cfg.varlen_q = {0, 113, 1, 239, 0, 64, 130};
        cfg.varlen_k = {17, 203, 0, 239, 0, 1, 129};
        if (used) cfg.seqused_k = {9, 150, 0, 200, 0, 1, 128};
        cfg.opt.causal = causal;
        cfgs.push_back(cfg);
      }
    }
  }
  return cfgs;
}

// Packed qkv, (b, h, s, d) and padded layouts (padded outputs too), causal.
inline std::vector<AttnConfig> strided_configs(flashattn::DType dtype) {
  std::vector<AttnConfig> cfgs;
  for (Layout layout : {Layout::packed_qkv, Layout::bhsd, Layout::padded}) {
    AttnConfig cfg = feature_config(dtype, 128, 200, 200);
    cfg.heads_k = cfg.heads;
    cfg.layout = layout;
    cfg.padded_outputs = layout == Layout::padded;
    cfg.opt.causal = true;
    cfgs.push_back(cfg);
  }
  return cfgs;
}

}  // namespace fa_test::cuda
