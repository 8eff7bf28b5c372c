// tests/cpp/test_fp8.cpp — FP8 (float8_e4m3) forward calls on the CPU backends.
//
//   * SPEC §7 accuracy: a bf16 problem is quantised to e4m3 after dividing each (sequence, K/V
//     head) by power-of-two descale factors, and its bf16 inputs are set to the dequantised values
//     (exact in bf16); the FP8 call with those descales must then pass the bf16 problem's check —
//     the fp64 reference of the very values the FP8 call means — over masks, GQA, varlen with
//     empty sequences, a paged K/V, softcap, ALiBi, sinks, dropout, dv ≠ d, an f16 output, both
//     CPU backends;
//   * descales that are not powers of two: the call equals, bit for bit, the fp32 call on inputs
//     widened as the documented rule says (q · q_descale · k_descale, k and v exact, out ·
//     v_descale), for dense and varlen batches;
//   * the e4m3 conversion: every code round trips, ties go to even, magnitudes past 464 give NaN;
//   * validation: FP8 in the backward, the KV-cache call, on CUDA, mixed dtypes, an fp32 out,
//     descales with bf16 inputs or of the wrong shape or dtype — each refused with the argument
//     named and nothing written.
#include <cmath>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

#include "common/numeric.h"
#include "paged_test_util.h"
#include "test_util.h"

namespace fa_test {
namespace {

namespace fa = flashattn;
namespace c = flashattn::common;

// The FP8 inputs of a problem: e4m3 q, k, v and (b, hk) fp32 descales.
struct Fp8Inputs {
  Tensor q, k, v;
  Tensor q_descale, k_descale, v_descale;
  fa::ForwardInputs inputs(const AttnProblem& p, bool with_descales = true) const {
    fa::ForwardInputs in = p.forward_inputs();
    in.q = q.tv();
    in.k = k.tv();
    in.v = v.tv();
    if (with_descales) {
      in.q_descale = q_descale.tv();
      in.k_descale = k_descale.tv();
      in.v_descale = v_descale.tv();
    }
    return in;
  }
};

// The sequence of every packed row of a varlen problem (lengths from cfg), or of the batch index.
std::int64_t sequence_of(const AttnProblem& p, const std::vector<int>& lengths, std::int64_t row) {
  std::int64_t end = 0;
  for (std::size_t b = 0; b < lengths.size(); ++b) {
    end += lengths[b];
    if (row < end) return std::int64_t(b);
  }
  (void)p;
  return -1;
}

// Quantises x (a q-, k- or v-like tensor of p) to e4m3 after dividing by descale[b][head / group];
// with `write_back`, x is set to the dequantised values (exact when the descales are powers of two
// and x's dtype is bf16, f16 or f32).
Tensor quantise(const AttnProblem& p, Tensor& x, const std::vector<int>& lengths, int group,
                const Tensor& descale, bool write_back) {
  Tensor q8(DType::f8e4m3, x.shape());
  const bool varlen = p.is_varlen();
  x.for_each_index([&](const Index& idx) {
    const std::int64_t b = varlen ? sequence_of(p, lengths, idx[0]) : idx[0];
    const std::int64_t head = idx[varlen ? 1 : 2];
    const float d = b < 0 ? 1.0f : descale.get({b, head / group});
    q8.set(idx, x.get(idx) / d);
    if (write_back) x.set(idx, q8.get(idx) * d);
  });
  return q8;
}

// Descales of (b, hk): powers of two from {1/4, …, 4}, or (pow2 false) arbitrary values in [0.3, 3].
Tensor make_descales(int b, int hk, std::uint64_t seed, bool pow2) {
  Tensor d(DType::f32, {b, hk});
  std::uint64_t s = seed;
  d.for_each_index([&](const Index& idx) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    const double u = double(s >> 11) * std::ldexp(1.0, -53);
    d.set(idx, pow2 ? std::ldexp(1.0f, int(u * 5.0) - 2) : float(0.3 + 2.7 * u));
  });
  return d;
}

// The FP8 form of p (whose q, k, v it rewrites to the dequantised values when pow2).
Fp8Inputs make_fp8(AttnProblem& p, bool pow2) {
  const int b = p.cfg.batch, hk = p.cfg.heads_k, group = p.cfg.heads / p.cfg.heads_k;
  Fp8Inputs f;
  f.q_descale = make_descales(b, hk, test_seed(11), pow2);
  f.k_descale = make_descales(b, hk, test_seed(12), pow2);
  f.v_descale = make_descales(b, hk, test_seed(13), pow2);
  f.q = quantise(p, p.q, p.cfg.varlen_q, group, f.q_descale, pow2);
  f.k = quantise(p, p.k, p.cfg.varlen_k, 1, f.k_descale, pow2);
  f.v = quantise(p, p.v, p.cfg.varlen_k, 1, f.v_descale, pow2);
  return f;
}

ForwardResult run_fp8(const AttnProblem& p, const Fp8Inputs& f, Backend backend, DType out_dtype = DType::bf16) {
  ForwardResult r = make_forward_outputs(p);
  if (out_dtype != r.out.dtype()) r.out = Tensor(out_dtype, r.out.shape());
  fa::Options opt = p.opt;
  opt.backend = backend;
  opt.num_threads = 2;
  fa::forward(f.inputs(p), {r.out.tv(), r.lse.tv()}, opt);
  return r;
}

struct Fp8Case {
  std::string name;
  AttnConfig cfg;
};

void PrintTo(const Fp8Case& c, std::ostream* os) { *os << c.name; }

std::vector<Fp8Case> fp8_cases() {
  std::vector<Fp8Case> cs;
  AttnConfig causal_gqa = dense_config(DType::bf16, 2, 45, 70, 4, 2, 64);
  causal_gqa.opt.causal = true;
  cs.push_back({"causal_gqa", causal_gqa});
  AttnConfig window = dense_config(DType::bf16, 1, 33, 33, 3, 1, 32, 64);
  window.opt.window_left = 9;
  window.opt.window_right = 2;
  window.opt.softcap = 3.0f;
  cs.push_back({"window_softcap_mqa_dv64", window});
  AttnConfig varlen = dense_config(DType::bf16, 3, 0, 0, 4, 2, 64);
  varlen.varlen_q = {17, 0, 40};
  varlen.varlen_k = {30, 5, 40};
  varlen.opt.causal = true;
  varlen.alibi = Alibi::per_head;
  cs.push_back({"varlen_causal_alibi", varlen});
  AttnConfig sinks = dense_config(DType::bf16, 2, 20, 52, 2, 2, 48);
  sinks.sinks = true;
  sinks.opt.dropout_p = 0.2f;
  sinks.opt.dropout_seed = 7;
  cs.push_back({"sinks_dropout", sinks});
  AttnConfig peaky = dense_config(DType::bf16, 1, 64, 96, 2, 1, 128);
  peaky.qk_amplitude = 3.0f;
  cs.push_back({"peaky_d128", peaky});
  return cs;
}

class Fp8Cpu : public testing::TestWithParam<Fp8Case> {};

TEST_P(Fp8Cpu, MatchesTheReferenceOfTheDescaledValues) {
  for (Backend backend : {Backend::cpu, Backend::cpu_reference}) {
    SCOPED_TRACE(backend == Backend::cpu ? "cpu" : "cpu_reference");
    AttnProblem p = make_problem(GetParam().cfg);
    SCOPED_TRACE(describe(p.cfg));
    const Fp8Inputs f = make_fp8(p, true);
    EXPECT_TRUE(check_forward(p, run_fp8(p, f, backend)));
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, Fp8Cpu, testing::ValuesIn(fp8_cases()),
                         [](const testing::TestParamInfo<Fp8Case>& info) { return info.param.name; });

// A paged K/V (paged prefill: varlen queries, pages of 16 rows shuffled over a poisoned e4m3
// cache): the same check.
TEST(Fp8, PagedKV) {
  AttnConfig cfg = varlen_config(DType::bf16, {9, 1, 30}, {40, 17, 33}, 4, 2, 64);
  cfg.opt.causal = true;
  AttnProblem p = make_problem(cfg);
  const Fp8Inputs f = make_fp8(p, true);
  AttnProblem packed8 = p;  // the e4m3 keys and values, to scatter into pages
  packed8.k = f.k;
  packed8.v = f.v;
  const PagedCache cache = make_paged_cache(packed8, DType::f8e4m3, 16, test_seed(3));
  fa::ForwardInputs in = paged_inputs(p, cache, PagedLengths::seqused_k);
  in.q = f.q.tv();
  in.q_descale = f.q_descale.tv();
  in.k_descale = f.k_descale.tv();
  in.v_descale = f.v_descale.tv();
  for (Backend backend : {Backend::cpu, Backend::cpu_reference}) {
    ForwardResult r = make_forward_outputs(p);
    fa::Options opt = p.opt;
    opt.backend = backend;
    fa::forward(in, {r.out.tv(), r.lse.tv()}, opt);
    EXPECT_TRUE(check_forward(p, r));
  }
}

// An f16 output: the same check with the f16 problem's rule (its inputs are the same e4m3 values).
TEST(Fp8, F16Output) {
  AttnConfig cfg = dense_config(DType::f16, 2, 31, 40, 4, 1, 64);
  cfg.opt.causal = true;
  AttnProblem p = make_problem(cfg);
  const Fp8Inputs f = make_fp8(p, true);
  EXPECT_TRUE(check_forward(p, run_fp8(p, f, Backend::cpu, DType::f16)));
}

// Descales that are not powers of two: bit for bit the fp32 call on inputs widened by the rule.
TEST(Fp8, DescalesFollowTheWideningRule) {
  AttnConfig dense = dense_config(DType::bf16, 2, 19, 37, 6, 2, 32);
  dense.opt.causal = true;
  AttnConfig varlen = dense_config(DType::bf16, 3, 0, 0, 4, 2, 32);
  varlen.varlen_q = {5, 12, 0};
  varlen.varlen_k = {9, 12, 7};
  for (const AttnConfig& cfg : {dense, varlen}) {
    AttnProblem p = make_problem(cfg);
    SCOPED_TRACE(describe(p.cfg));
    const Fp8Inputs f = make_fp8(p, false);
    const ForwardResult r = run_fp8(p, f, Backend::cpu);

    // The rule by hand: fp32 inputs, then out · v_descale rounded to bf16.
    const int group = cfg.heads / cfg.heads_k;
    const bool is_varlen = p.is_varlen();
    auto scale_of = [&](const Index& idx, const std::vector<int>& lengths, int g) -> std::pair<std::int64_t, std::int64_t> {
      const std::int64_t b = is_varlen ? sequence_of(p, lengths, idx[0]) : idx[0];
      return {b, idx[is_varlen ? 1 : 2] / g};
    };
    Tensor q32(DType::f32, f.q.shape()), k32(DType::f32, f.k.shape()), v32(DType::f32, f.v.shape());
    f.q.for_each_index([&](const Index& idx) {
      const auto [b, g] = scale_of(idx, cfg.varlen_q, group);
      q32.set(idx, f.q_descale.get({b, g}) * f.k_descale.get({b, g}) * f.q.get(idx));
    });
    f.k.for_each_index([&](const Index& idx) { k32.set(idx, f.k.get(idx)); });
    f.v.for_each_index([&](const Index& idx) { v32.set(idx, f.v.get(idx)); });
    fa::ForwardInputs in = p.forward_inputs();
    in.q = q32.tv();
    in.k = k32.tv();
    in.v = v32.tv();
    Tensor out32(DType::f32, r.out.shape());
    Tensor lse32 = Tensor::empty_like(r.lse);
    fa::Options opt = p.opt;
    opt.backend = Backend::cpu;
    opt.num_threads = 2;
    fa::forward(in, {out32.tv(), lse32.tv()}, opt);
    Tensor expected = Tensor::empty_like(r.out);
    out32.for_each_index([&](const Index& idx) {
      const auto [b, g] = scale_of(idx, cfg.varlen_q, group);
      expected.set(idx, out32.get(idx) * (b < 0 ? 1.0f : f.v_descale.get({b, g})));
    });
    EXPECT_TRUE(bitwise_equal(r.out, expected));
    EXPECT_TRUE(bitwise_equal(r.lse, lse32));
  }
}

// Every e4m3 code converts to fp32 and back to itself (NaN to NaN); ties round to even; past
// 464 (the midpoint above 448) and at infinity the result is NaN.
TEST(Fp8, E4m3Conversion) {
  for (int bits = 0; bits < 256; ++bits) {
    const float f = c::to_float(c::e4m3_t{std::uint8_t(bits)});
    const c::e4m3_t back = c::to_e4m3(f);
    if ((bits & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(f)) << bits;
      EXPECT_EQ(back.bits & 0x7f, 0x7f) << bits;
    } else {
      EXPECT_EQ(int(back.bits), bits) << f;
    }
  }
  EXPECT_EQ(c::to_float(c::e4m3_t{0x7e}), 448.0f);
  EXPECT_EQ(c::to_float(c::e4m3_t{0x01}), std::ldexp(1.0f, -9));
  const std::pair<float, float> ties[] = {{1.0625f, 1.0f},          {1.1875f, 1.25f},     {464.0f, 448.0f},
                                          {std::ldexp(1.0f, -10), 0.0f}, {std::ldexp(3.0f, -10), std::ldexp(1.0f, -8)},
                                          {-3.3f, -3.25f}};
  for (const auto& [x, want] : ties) EXPECT_EQ(c::to_float(c::to_e4m3(x)), want) << x;
  for (float x : {465.0f, 1e6f, std::numeric_limits<float>::infinity()}) {
    EXPECT_TRUE(std::isnan(c::to_float(c::to_e4m3(x)))) << x;
    EXPECT_TRUE(std::isnan(c::to_float(c::to_e4m3(-x)))) << -x;
  }
}

// Refusals name the argument and write nothing.
TEST(Fp8, Validation) {
  AttnProblem p = make_problem(dense_config(DType::bf16, 2, 9, 11, 4, 2, 32));
  const Fp8Inputs f = make_fp8(p, true);
  auto expect_refused = [&](const fa::ForwardInputs& in, const Tensor& out, const std::string& needle) {
    ForwardResult r = make_forward_outputs(p);
    Tensor o = out.defined() ? out : r.out;
    const Tensor before = o.clone();
    try {
      fa::forward(in, {o.tv(), r.lse.tv()}, p.opt);
      ADD_FAILURE() << "accepted; expected an error containing: " << needle;
    } catch (const fa::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_TRUE(bitwise_equal(o, before));
  };
  const Tensor none;
  fa::ForwardInputs in = f.inputs(p);
  expect_refused(in, Tensor(DType::f32, make_forward_outputs(p).out.shape()),
                 "out: FP8 inputs give a bf16 or f16 output; expected bf16 or f16, got f32");
  fa::ForwardInputs mixed = in;
  mixed.k = p.k.tv();
  expect_refused(mixed, none, "k: must have q's dtype; expected f8e4m3, got bf16");
  fa::ForwardInputs bf16 = p.forward_inputs();
  bf16.v_descale = f.v_descale.tv();
  expect_refused(bf16, none, "v_descale: descale factors go with float8_e4m3 inputs");
  fa::ForwardInputs shape = in;
  const Tensor wide(DType::f32, {2, 4});
  shape.k_descale = wide.tv();
  expect_refused(shape, none, "k_descale: wrong shape; expected (2, 2), got (2, 4)");
  fa::ForwardInputs dtype = in;
  const Tensor half(DType::f16, {2, 2});
  dtype.q_descale = half.tv();
  expect_refused(dtype, none, "q_descale: descale factors are fp32");
  fa::ForwardInputs on_gpu = in;
  for (fa::TensorView* t : {&on_gpu.q, &on_gpu.k, &on_gpu.v}) t->device = {fa::DeviceType::cuda, 0};
  expect_refused(on_gpu, none, "q: FP8 attention runs on the CPU backends only");

  // The backward and the KV-cache call take no FP8 inputs.
  const ForwardResult fwd = run_fp8(p, f, Backend::cpu);
  BackwardResult g = make_backward_outputs(p);
  fa::BackwardInputs bin = p.backward_inputs(fwd);
  bin.q = f.q.tv();
  bin.k = f.k.tv();
  bin.v = f.v.tv();
  try {
    fa::backward(bin, {g.dq.tv(), g.dk.tv(), g.dv.tv(), g.softmax_d.tv()}, p.opt);
    ADD_FAILURE() << "an FP8 backward was accepted";
  } catch (const fa::Error& e) {
    EXPECT_NE(std::string(e.what()).find("q: float8_e4m3 inputs are for the forwards only"), std::string::npos)
        << e.what();
  }
}

// The KV-cache call with e4m3 q, caches and new rows, contiguous (with cache_batch_idx) and paged:
// out equals, bit for bit, the fp32 call on inputs widened by the rule (q · q_descale · k_descale,
// the rest exact, out · v_descale rounded to bf16); the caches afterwards hold the new rows' e4m3
// bytes at cache_seqlens and every other byte as before; each sequence's rows match the FP8
// forward over its keys (the same values by another path, to fp32 summation order); rotary is
// refused with nothing written.
TEST(Fp8, KVCacheAppendsAndAttends) {
  const int b = 2, sq = 3, h = 4, hk = 2, d = 64, sk_new = 4, capacity = 48, page = 16;
  const std::vector<int> cached = {10, 25};
  for (const bool paged : {false, true}) {
    SCOPED_TRACE(paged ? "paged" : "contiguous, cache_batch_idx");
    const int pages = b * capacity / page + 1;
    const Tensor k_cache(DType::f8e4m3, paged ? Shape{pages, page, hk, d} : Shape{3, capacity, hk, d});
    const Tensor v_cache = Tensor::empty_like(k_cache);
    Tensor q(DType::f8e4m3, {b, sq, h, d}), k_new(DType::f8e4m3, {b, sk_new, hk, d}), v_new = Tensor::empty_like(k_new);
    Tensor(k_cache).fill_random(test_seed(1), -4, 4);
    Tensor(v_cache).fill_random(test_seed(2), -4, 4);
    q.fill_random(test_seed(3), -4, 4);
    k_new.fill_random(test_seed(4), -4, 4);
    v_new.fill_random(test_seed(5), -4, 4);
    const Tensor seqlens = Tensor::from_i32({cached[0], cached[1]});
    const Tensor batch_idx = Tensor::from_i32({2, 0});
    std::vector<std::int32_t> table_values;  // sequence i: pages i, i + 2, i + 4, … (interleaved)
    for (int i = 0; i < b; ++i) {
      for (int j = 0; j < capacity / page; ++j) table_values.push_back(i + b * j);
    }
    Tensor table = Tensor::from_i32(table_values);
    table = table.view(0, {b, capacity / page}, {capacity / page, 1});
    const Tensor qd = make_descales(b, hk, test_seed(6), false), kd = make_descales(b, hk, test_seed(7), false),
                 vd = make_descales(b, hk, test_seed(8), false);
    auto inputs = [&](const Tensor& qq, const Tensor& kc, const Tensor& vc, const Tensor& kn, const Tensor& vn) {
      fa::KVCacheInputs in;
      in.q = qq.tv();
      in.k_cache = kc.tv();
      in.v_cache = vc.tv();
      in.k_new = kn.tv();
      in.v_new = vn.tv();
      in.cache_seqlens = seqlens.tv();
      if (paged) {
        in.block_table = table.tv();
      } else {
        in.cache_batch_idx = batch_idx.tv();
      }
      return in;
    };
    fa::Options opt;
    opt.causal = true;
    opt.backend = Backend::cpu;

    // The fp32 call on widened inputs, as the rule says.
    auto widened = [](const Tensor& x, auto&& scale) {
      Tensor w(DType::f32, x.shape());
      x.for_each_index([&](const Index& idx) { w.set(idx, scale(idx) * x.get(idx)); });
      return w;
    };
    const auto one = [](const Index&) { return 1.0f; };
    const Tensor q32 = widened(q, [&](const Index& i) { return qd.get({i[0], i[2] / (h / hk)}) * kd.get({i[0], i[2] / (h / hk)}); });
    const Tensor k32 = widened(k_cache, one), v32 = widened(v_cache, one);
    const Tensor kn32 = widened(k_new, one), vn32 = widened(v_new, one);
    Tensor out32(DType::f32, {b, sq, h, d}), lse32(DType::f32, {b, h, sq});
    fa::forward_kvcache(inputs(q32, k32, v32, kn32, vn32), {out32.tv(), lse32.tv()}, opt);
    Tensor expected(DType::bf16, {b, sq, h, d});
    out32.for_each_index([&](const Index& i) { expected.set(i, out32.get(i) * vd.get({i[0], i[2] / (h / hk)})); });

    const Tensor k_before = k_cache.clone();
    fa::KVCacheInputs in8 = inputs(q, k_cache, v_cache, k_new, v_new);
    in8.q_descale = qd.tv();
    in8.k_descale = kd.tv();
    in8.v_descale = vd.tv();
    Tensor out(DType::bf16, {b, sq, h, d}), lse(DType::f32, {b, h, sq});
    fa::KVCacheInputs rotary = in8;
    const Tensor cos(DType::bf16, {capacity + sq, 8});
    rotary.rotary_cos = rotary.rotary_sin = cos.tv();
    try {
      fa::forward_kvcache(rotary, {out.tv(), lse.tv()}, opt);
      ADD_FAILURE() << "rotary with FP8 inputs was accepted";
    } catch (const fa::Error& e) {
      EXPECT_NE(std::string(e.what()).find("rotary_cos: no rotary embedding with FP8 inputs"), std::string::npos)
          << e.what();
    }
    EXPECT_TRUE(bitwise_equal(k_cache, k_before)) << "a refused call wrote the cache";

    fa::forward_kvcache(in8, {out.tv(), lse.tv()}, opt);
    EXPECT_TRUE(bitwise_equal(out, expected));
    EXPECT_TRUE(bitwise_equal(lse, lse32));
    // The caches: the new rows' bytes at cache_seqlens, everything else as it was.
    k_cache.for_each_index([&](const Index& idx) {
      int seq = -1, pos = -1;  // the sequence and position that this cache element holds, if any
      for (int i = 0; i < b; ++i) {
        if (!paged && batch_idx.get({i}) == float(idx[0])) seq = i, pos = int(idx[1]);
        for (int j = 0; paged && j < capacity / page; ++j) {
          if (table_values[std::size_t(i * (capacity / page) + j)] == idx[0]) seq = i, pos = j * page + int(idx[1]);
        }
      }
      const bool appended = seq >= 0 && pos >= cached[std::size_t(seq)] && pos < cached[std::size_t(seq)] + sk_new;
      const float want = appended ? k_new.get({seq, pos - cached[std::size_t(seq)], idx[2], idx[3]}) : k_before.get(idx);
      const float got = k_cache.get(idx);
      if (!(got == want || (std::isnan(got) && std::isnan(want)))) {
        ADD_FAILURE() << "k_cache element (" << idx[0] << ", " << idx[1] << ", " << idx[2] << ", " << idx[3]
                      << "): " << got << ", expected " << want;
      }
    });

    // Sequence i against the FP8 forward over its keys (the cache rows after the append).
    for (int i = 0; i < b; ++i) {
      const int keys = cached[std::size_t(i)] + sk_new;
      Tensor ki(DType::f8e4m3, {1, keys, hk, d}), vi = Tensor::empty_like(ki), qi(DType::f8e4m3, {1, sq, h, d});
      ki.for_each_index([&](const Index& idx) {
        const int j = int(idx[1]);
        const Index at = paged ? Index{table_values[std::size_t(i * (capacity / page) + j / page)], j % page, idx[2], idx[3]}
                               : Index{std::int64_t(batch_idx.get({i})), j, idx[2], idx[3]};
        ki.set(idx, k_cache.get(at));
        vi.set(idx, v_cache.get(at));
      });
      qi.for_each_index([&](const Index& idx) { qi.set(idx, q.get({i, idx[1], idx[2], idx[3]})); });
      const Tensor qdi = Tensor::from_f32({1, hk}, {qd.get({i, 0}), qd.get({i, 1})});
      const Tensor kdi = Tensor::from_f32({1, hk}, {kd.get({i, 0}), kd.get({i, 1})});
      const Tensor vdi = Tensor::from_f32({1, hk}, {vd.get({i, 0}), vd.get({i, 1})});
      fa::ForwardInputs fin;
      fin.q = qi.tv();
      fin.k = ki.tv();
      fin.v = vi.tv();
      fin.q_descale = qdi.tv();
      fin.k_descale = kdi.tv();
      fin.v_descale = vdi.tv();
      Tensor oi(DType::bf16, {1, sq, h, d}), li(DType::f32, {1, h, sq});
      fa::forward(fin, {oi.tv(), li.tv()}, opt);
      double worst = 0, scale = 0;
      oi.for_each_index([&](const Index& idx) {
        const double want = oi.get(idx), got = out.get({i, idx[1], idx[2], idx[3]});
        worst = std::max(worst, std::abs(got - want));
        scale = std::max(scale, std::abs(want));
      });
      EXPECT_LE(worst, scale * std::ldexp(1.0, -7)) << "sequence " << i;
    }
  }
}

}  // namespace
}  // namespace fa_test
