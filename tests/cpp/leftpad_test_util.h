// tests/cpp/leftpad_test_util.h — forward_kvcache with cache_leftpad for the CPU and CUDA tests:
// a varlen problem whose sequence i has exactly the keys of cache rows [cache_leftpad[i],
// cache_seqlens[i] + sk_new), those rows filled from it (the cached part in the cache, the rest as
// k_new/v_new), every other cache row poison; the call's outputs put back into the varlen
// problem's layout for check_forward (SPEC §7 against its fp64 reference).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "test_util.h"

namespace fa_test {

struct LeftpadCase {
  DType dtype = DType::bf16;
  int sq = 3, sk_new = 0, heads = 4, heads_k = 2, d = 64;
  std::vector<int> seqlens = {20, 7, 33};  // cache_seqlens (before the append)
  std::vector<int> leftpad = {5, 0, 33};
  bool causal = true;
  Alibi alibi = Alibi::none;
  int capacity = 40;
};

struct LeftpadCall {
  LeftpadCase lc;
  AttnProblem p;  // the oracle's varlen problem
  Tensor q;       // (b, sq, h, d): a view of p.q
  Tensor k_cache, v_cache, k_new, v_new, seqlens, leftpad;
  Tensor out, lse;  // (b, sq, h, d), (b, h, sq): poisoned

  flashattn::KVCacheInputs inputs() const {
    flashattn::KVCacheInputs in;
    in.q = q.tv();
    in.k_cache = k_cache.tv();
    in.v_cache = v_cache.tv();
    in.cache_seqlens = seqlens.tv();
    in.cache_leftpad = leftpad.tv();
    if (lc.sk_new > 0) {
      in.k_new = k_new.tv();
      in.v_new = v_new.tv();
    }
    return in;
  }

  // out and lse in the varlen problem's layout: (total_q, h, d) and (h, total_q).
  ForwardResult varlen_result() const {
    ForwardResult res = make_forward_outputs(p);
    const int b = int(lc.seqlens.size());
    for (int i = 0; i < b; ++i)
      for (int r = 0; r < lc.sq; ++r)
        for (int hh = 0; hh < lc.heads; ++hh) {
          res.lse.set({hh, i * lc.sq + r}, lse.get({i, hh, r}));
          for (int e = 0; e < lc.d; ++e) res.out.set({i * lc.sq + r, hh, e}, out.get({i, r, hh, e}));
        }
    return res;
  }

  // Whether k_new / v_new sit at the absolute rows cache_seqlens[i] + t (bit for bit).
  testing::AssertionResult appended_at_cache_seqlens() const {
    for (int i = 0; i < int(lc.seqlens.size()); ++i)
      for (int t = 0; t < lc.sk_new; ++t)
        for (int g = 0; g < lc.heads_k; ++g)
          for (int e = 0; e < lc.d; ++e) {
            const int row = lc.seqlens[std::size_t(i)] + t;
            if (k_cache.bits_at(k_cache.offset({i, row, g, e})) != k_new.bits_at(k_new.offset({i, t, g, e})) ||
                v_cache.bits_at(v_cache.offset({i, row, g, e})) != v_new.bits_at(v_new.offset({i, t, g, e}))) {
              return testing::AssertionFailure() << "sequence " << i << " row " << row << " is not k_new/v_new " << t;
            }
          }
    return testing::AssertionSuccess();
  }
};

inline LeftpadCall make_leftpad_call(const LeftpadCase& lc) {
  LeftpadCall c;
  c.lc = lc;
  const int b = int(lc.seqlens.size()), hk = lc.heads_k, d = lc.d, h = lc.heads;
  AttnConfig cfg;
  cfg.dtype = lc.dtype;
  cfg.heads = h;
  cfg.heads_k = hk;
  cfg.head_dim = d;
  cfg.alibi = lc.alibi;
  cfg.opt.causal = lc.causal;
  for (int i = 0; i < b; ++i) {
    cfg.varlen_q.push_back(lc.sq);
    cfg.varlen_k.push_back(lc.seqlens[std::size_t(i)] - lc.leftpad[std::size_t(i)] + lc.sk_new);
  }
  c.p = make_problem(cfg);
  const AttnProblem& p = c.p;
  c.k_cache = Tensor(lc.dtype, {b, lc.capacity, hk, d});  // poison
  c.v_cache = Tensor(lc.dtype, {b, lc.capacity, hk, d});
  c.k_new = Tensor(lc.dtype, {b, std::max(lc.sk_new, 1), hk, d});
  c.v_new = Tensor(lc.dtype, {b, std::max(lc.sk_new, 1), hk, d});
  for (int i = 0; i < b; ++i) {
    const int row0 = int(p.cu_seqlens_k.get({i})), pad = lc.leftpad[std::size_t(i)];
    const int cached = lc.seqlens[std::size_t(i)] - pad;
    for (int j = 0; j < cfg.varlen_k[std::size_t(i)]; ++j)
      for (int g = 0; g < hk; ++g)
        for (int e = 0; e < d; ++e) {
          const float kx = p.k.get({row0 + j, g, e}), vx = p.v.get({row0 + j, g, e});
          if (j < cached) {
            c.k_cache.set({i, pad + j, g, e}, kx);
            c.v_cache.set({i, pad + j, g, e}, vx);
          } else {
            c.k_new.set({i, j - cached, g, e}, kx);
            c.v_new.set({i, j - cached, g, e}, vx);
          }
        }
  }
  c.seqlens = Tensor::from_i32(std::vector<std::int32_t>(lc.seqlens.begin(), lc.seqlens.end()));
  c.leftpad = Tensor::from_i32(std::vector<std::int32_t>(lc.leftpad.begin(), lc.leftpad.end()));
  c.q = p.q.view(0, {b, lc.sq, h, d}, {lc.sq * p.q.stride()[0], p.q.stride()[0], p.q.stride()[1], 1});
  c.out = Tensor(lc.dtype, {b, lc.sq, h, d});
  c.lse = Tensor(DType::f32, {b, h, lc.sq});
  return c;
}

}  // namespace fa_test
