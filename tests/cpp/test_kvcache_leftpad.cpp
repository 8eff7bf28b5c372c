// tests/cpp/test_kvcache_leftpad.cpp — forward_kvcache with cache_leftpad (left-padded cache
// rows): sequence i attends to rows [cache_leftpad[i], cache_seqlens[i] + sk_new) of its cache row,
// with mask and ALiBi positions counted from the first of them. The oracle is the varlen problem
// whose keys are exactly those rows (SPEC §7 against its fp64 reference); the rows before the
// padding hold poison, so reading one fails. k_new lands at rows cache_seqlens[i] + t. Bad values
// are refused naming cache_leftpad, with nothing written.
#include <cmath>
#include <string>
#include <vector>

#include "leftpad_test_util.h"
#include "test_util.h"

namespace fa_test {
namespace {

void run_leftpad(const LeftpadCase& lc, Backend backend) {
  LeftpadCall c = make_leftpad_call(lc);
  SCOPED_TRACE(describe(c.p.cfg) + " sk_new=" + std::to_string(lc.sk_new));
  flashattn::Options opt = c.p.opt;
  opt.backend = backend;
  flashattn::forward_kvcache(c.inputs(), {c.out.tv(), c.lse.tv()}, opt);
  EXPECT_TRUE(check_forward(c.p, c.varlen_result()));
  EXPECT_TRUE(c.appended_at_cache_seqlens());
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
