// tests/cpp/test_kvcache_leftpad.cpp — forward_kvcache with cache_leftpad (left-padded cache
// rows): sequence i attends to rows [cache_leftpad[i], cache_seqlens[i] + sk_new) of its cache row,
// with mask and ALiBi positions counted from the first of them. The oracle is the varlen problem
// whose keys are exactly those rows (SPEC §7 against its fp64 reference); the rows before the
// padding hold poison, so reading one fails. k_new lands at rows cache_seqlens[i] + t. Bad values
// are refused naming cache_leftpad, with nothing written.
#include <cmath>
#include <string>
#include <vector>

#include "test_util.h"

namespace fa_test {
namespace {

struct LeftpadCase {
  DType dtype = DType::bf16;
  int sq = 3, sk_new = 0, heads = 4, heads_k = 2, d = 64;
  std::vector<int> seqlens = {20, 7, 33};  // cache_seqlens (before the append)
  std::vector<int> leftpad = {5, 0, 33};
  bool causal = true;
  Alibi alibi = Alibi::none;
};

void run_leftpad(const LeftpadCase& lc, Backend backend) {
  const int b = int(lc.seqlens.size());
  AttnConfig cfg;
  cfg.dtype = lc.dtype;
  cfg.heads = lc.heads;
  cfg.heads_k = lc.heads_k;
  cfg.head_dim = lc.d;
  cfg.alibi = lc.alibi;
  cfg.opt.causal = lc.causal;
  for (int i = 0; i < b; ++i) {
    cfg.varlen_q.push_back(lc.sq);
    cfg.varlen_k.push_back(lc.seqlens[std::size_t(i)] - lc.leftpad[std::size_t(i)] + lc.sk_new);
  }
  const AttnProblem p = make_problem(cfg);
  SCOPED_TRACE(describe(p.cfg) + " sk_new=" + std::to_string(lc.sk_new));
  const int hk = lc.heads_k, d = lc.d, h = lc.heads;
  const int capacity = 40;
  Tensor k_cache(lc.dtype, {b, capacity, hk, d}), v_cache(lc.dtype, {b, capacity, hk, d});  // poison
  Tensor k_new(lc.dtype, {b, std::max(lc.sk_new, 1), hk, d}), v_new(lc.dtype, {b, std::max(lc.sk_new, 1), hk, d});
  for (int i = 0; i < b; ++i) {
    const int row0 = int(p.cu_seqlens_k.get({i})), pad = lc.leftpad[std::size_t(i)];
    const int cached = lc.seqlens[std::size_t(i)] - pad;
    for (int j = 0; j < cfg.varlen_k[std::size_t(i)]; ++j)
      for (int g = 0; g < hk; ++g)
        for (int e = 0; e < d; ++e) {
          const float kx = p.k.get({row0 + j, g, e}), vx = p.v.get({row0 + j, g, e});
          if (j < cached) {
            k_cache.set({i, pad + j, g, e}, kx);
            v_cache.set({i, pad + j, g, e}, vx);
          } else {
            k_new.set({i, j - cached, g, e}, kx);
            v_new.set({i, j - cached, g, e}, vx);
          }
        }
  }
  const Tensor seqlens = Tensor::from_i32(std::vector<std::int32_t>(lc.seqlens.begin(), lc.seqlens.end()));
  const Tensor leftpad = Tensor::from_i32(std::vector<std::int32_t>(lc.leftpad.begin(), lc.leftpad.end()));
  const Tensor q = p.q.view(0, {b, lc.sq, h, d}, {lc.sq * p.q.stride()[0], p.q.stride()[0], p.q.stride()[1], 1});
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
  Tensor out(lc.dtype, {b, lc.sq, h, d});
  Tensor lse(DType::f32, {b, h, lc.sq});
  flashattn::Options opt = p.opt;
  opt.backend = backend;
  flashattn::forward_kvcache(in, {out.tv(), lse.tv()}, opt);

  // The result in the varlen problem's layout: out (total_q, h, d), lse (h, total_q).
  ForwardResult res = make_forward_outputs(p);
  for (int i = 0; i < b; ++i)
    for (int r = 0; r < lc.sq; ++r)
      for (int hh = 0; hh < h; ++hh) {
        res.lse.set({hh, i * lc.sq + r}, lse.get({i, hh, r}));
        for (int e = 0; e < d; ++e) res.out.set({i * lc.sq + r, hh, e}, out.get({i, r, hh, e}));
      }
  EXPECT_TRUE(check_forward(p, res));
  // k_new was written at the absolute rows cache_seqlens[i] + t.
  for (int i = 0; i < b; ++i)
    for (int t = 0; t < lc.sk_new; ++t)
      for (int e = 0; e < d; ++e) {
        ASSERT_EQ(k_cache.get({i, lc.seqlens[std::size_t(i)] + t, 0, e}), k_new.get({i, t, 0, e})) << i << " " << t;
      }
}

TEST(KvcacheLeftpad, MatchesVarlenOracle) {
  for (Backend backend : {Backend::cpu, Backend::cpu_reference}) {
    LeftpadCase lc;  // one sequence with no cached keys left after its padding
    run_leftpad(lc, backend);
    lc.sk_new = 4;  // appended keys follow the cached ones
    lc.causal = false;
    run_leftpad(lc, backend);
  }
}

TEST(KvcacheLeftpad, GqaAlibiAndOneQuery) {
  LeftpadCase lc;
  lc.dtype = DType::f16;
  lc.sq = 1;
  lc.heads = 8;
  lc.heads_k = 1;
  lc.sk_new = 1;
  lc.seqlens = {1, 39, 16, 0};
  lc.leftpad = {1, 12, 3, 0};
  lc.alibi = Alibi::per_head;
  run_leftpad(lc, Backend::cpu);
}

TEST(KvcacheLeftpad, BadValuesAndCombinationsRefused) {
  const int b = 2, capacity = 16, d = 32;
  Tensor q(DType::f16, {b, 1, 2, d}), k_cache(DType::f16, {b, capacity, 2, d}), v_cache = Tensor::empty_like(k_cache);
  q.fill_random(test_seed(1));
  Tensor out(DType::f16, {b, 1, 2, d}), lse(DType::f32, {b, 2, 1});
  const Tensor seqlens = Tensor::from_i32({10, 4});
  flashattn::Options opt;
  opt.backend = Backend::cpu;
  auto expect_refused = [&](const flashattn::KVCacheInputs& in, const std::string& part) {
    try {
      flashattn::forward_kvcache(in, {out.tv(), lse.tv()}, opt);
      ADD_FAILURE() << "expected flashattn::Error (" << part << ")";
    } catch (const flashattn::Error& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
    for (float x : out.to_vector()) ASSERT_TRUE(std::isnan(x)) << "out was written";
  };
  flashattn::KVCacheInputs in;
  in.q = q.tv();
  in.k_cache = k_cache.tv();
  in.v_cache = v_cache.tv();
  in.cache_seqlens = seqlens.tv();
  const Tensor past = Tensor::from_i32({3, 5});
  in.cache_leftpad = past.tv();
  expect_refused(in, "cache_leftpad: entry 1 must lie in [0, cache_seqlens[1]]; expected 0 ≤ x ≤ 4, got 5");
  const Tensor negative = Tensor::from_i32({-1, 0});
  in.cache_leftpad = negative.tv();
  expect_refused(in, "cache_leftpad: entry 0");
  const Tensor wrong_length = Tensor::from_i32({0, 0, 0});
  in.cache_leftpad = wrong_length.tv();
  expect_refused(in, "cache_leftpad: wrong shape");
  const Tensor good = Tensor::from_i32({1, 0});
  in.cache_leftpad = good.tv();
  in.cache_seqlens = {};
  expect_refused(in, "cache_seqlens: is required with cache_leftpad");
  in.cache_seqlens = seqlens.tv();
  const Tensor table = Tensor::from_i32({0, 1});
  Tensor paged_k(DType::f16, {2, 16, 2, d});
  in.k_cache = paged_k.tv();
  in.v_cache = paged_k.tv();
  in.block_table = table.view(0, {2, 1}, {1, 1}).tv();
  expect_refused(in, "cache_leftpad: cannot be combined with a paged cache");
}

}  // namespace
}  // namespace fa_test
