// tests/cpp/test_sinks.cpp — attention sinks (docs/sinks.md) on the CPU backends.
//
//   * SPEC §7 accuracy of the tiled CPU backend against the fp64 reference, forward and backward
//     (dsinks included), over masks, GQA, varlen with empty sequences, softcap, ALiBi, dropout;
//   * the sink's effect by an identity that needs no reference: with the sink, out_i is the
//     sink-free out_i times exp(lse_i − lse'_i), and lse'_i = log(exp(lse_i) + exp(s_h));
//   * rows without a visible key (out = 0, lse = s_h exactly), a sink of −∞ (bitwise no sink), a
//     NaN sink (NaN where the head's rows see keys), a sink far above every score (no overflow);
//   * dsinks bitwise the same for any thread count; forward_kvcache with sinks;
//   * validation: shape, dtype, layout, device of sinks and dsinks, named in the message, and
//     nothing written by a refused call.
// The finite-difference check of dsinks and the transcription of the formula are in
// test_reference_fd.cpp (the "sinks_*" cases).
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "test_util.h"

namespace fa_test {
namespace {

namespace fa = flashattn;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

struct SinkCase {
  std::string name;
  AttnConfig cfg;
};

std::vector<SinkCase> sink_cases() {
  std::vector<SinkCase> cs;
  auto with_sinks = [](AttnConfig c) {
    c.sinks = true;
    return c;
  };
  cs.push_back({"f16_plain", with_sinks(dense_config(DType::f16, 2, 37, 53, 4, 2, 64))});
  AttnConfig c = with_sinks(dense_config(DType::bf16, 2, 70, 33, 4, 4, 64));
  c.opt.causal = true;  // sq > sk: rows 0..36 see no key
  cs.push_back({"bf16_causal_rows_without_keys", c});
  c = with_sinks(dense_config(DType::f16, 1, 1, 300, 8, 1, 128));
  cs.push_back({"f16_decode_mqa", c});
  c = with_sinks(dense_config(DType::f32, 1, 65, 129, 2, 1, 128, 64));
  c.opt.window_left = 20;
  c.opt.window_right = 3;
  cs.push_back({"f32_window_d128_dv64", c});
  c = with_sinks(dense_config(DType::bf16, 2, 48, 80, 4, 2, 64));
  c.opt.softcap = 5.0f;
  c.alibi = Alibi::per_batch_head;
  c.qk_amplitude = 2.0f;
  cs.push_back({"bf16_softcap_alibi", c});
  c = with_sinks(dense_config(DType::f16, 1, 64, 64, 2, 2, 32));
  c.opt.dropout_p = 0.2f;
  c.opt.dropout_seed = 77;
  cs.push_back({"f16_dropout", c});
  c = with_sinks(dense_config(DType::bf16, 0, 0, 0, 4, 2, 64));
  c.varlen_q = {17, 0, 40, 5};
  c.varlen_k = {30, 9, 12, 0};
  c.opt.causal = true;
  cs.push_back({"bf16_varlen_empty_sequences", c});
  return cs;
}

class SinksCpu : public testing::TestWithParam<SinkCase> {};

TEST_P(SinksCpu, FlashMatchesReference) {
  const AttnProblem p = make_problem(GetParam().cfg);
  SCOPED_TRACE(describe(p.cfg));
  const ForwardResult fwd = run_forward(p, Backend::cpu);
  EXPECT_TRUE(check_forward(p, fwd));
  const BackwardResult bwd = run_backward(p, fwd, Backend::cpu);
  EXPECT_TRUE(check_backward(p, fwd, bwd));
  // dsinks is not vacuous: the sinks weigh in every one of these problems.
  double largest = 0;
  for (int hh = 0; hh < p.cfg.heads; ++hh) largest = std::max(largest, double(std::fabs(bwd.dsinks.load(hh))));
  EXPECT_GT(largest, 1e-4);
}

TEST_P(SinksCpu, ReferenceBackendPassesItsOwnCheck) {
  const AttnProblem p = make_problem(GetParam().cfg);
  SCOPED_TRACE(describe(p.cfg));
  const ForwardResult fwd = run_forward(p, Backend::cpu_reference);
  EXPECT_TRUE(check_forward(p, fwd));
  EXPECT_TRUE(check_backward(p, fwd, run_backward(p, fwd, Backend::cpu_reference)));
}

INSTANTIATE_TEST_SUITE_P(Grid, SinksCpu, testing::ValuesIn(sink_cases()),
                         [](const testing::TestParamInfo<SinkCase>& info) { return info.param.name; });

// The problem without its sinks (same q, k, v, dout).
AttnProblem without_sinks(const AttnProblem& p) {
  AttnProblem q = p;
  q.cfg.sinks = false;
  q.sinks = Tensor();
  return q;
}

// With and without a sink, the row's unnormalised weights are the same: out' = out · exp(lse −
// lse') and lse' = log(exp(lse) + exp(s_h)). Checked in fp32 on both CPU backends.
TEST(Sinks, ScaleTheSinkFreeResultByTheExtraDenominatorTerm) {
  for (Backend backend : {Backend::cpu, Backend::cpu_reference}) {
    AttnConfig cfg = dense_config(DType::f32, 2, 23, 41, 3, 3, 32);
    cfg.sinks = true;
    cfg.opt.causal = true;
    const AttnProblem p = make_problem(cfg);
    const ForwardResult with = run_forward(p, backend);
    const ForwardResult plain = run_forward(without_sinks(p), backend);
    double worst_out = 0, worst_lse = 0, smallest_shift = kInf;
    for (int b = 0; b < cfg.batch; ++b)
      for (int hh = 0; hh < cfg.heads; ++hh)
        for (int i = 0; i < cfg.seqlen_q; ++i) {
          const double lse = plain.lse.get({b, hh, i}), sink = p.sinks.get({hh});
          const double want_lse = std::max(lse, sink) + std::log(std::exp(lse - std::max(lse, sink)) +
                                                                  std::exp(sink - std::max(lse, sink)));
          worst_lse = std::max(worst_lse, std::fabs(with.lse.get({b, hh, i}) - want_lse));
          smallest_shift = std::min(smallest_shift, want_lse - lse);
          const double factor = std::exp(lse - want_lse);
          for (int e = 0; e < cfg.head_dim; ++e) {
            const double want = plain.out.get({b, i, hh, e}) * factor;
            worst_out = std::max(worst_out, std::fabs(with.out.get({b, i, hh, e}) - want));
          }
        }
    EXPECT_LE(worst_lse, 2e-5) << fa::backend_name(backend);
    EXPECT_LE(worst_out, 2e-6) << fa::backend_name(backend);
    EXPECT_GT(smallest_shift, 1e-4) << "every row's lse moves with the sink";
  }
}

// Causal with sq > sk: query rows [0, sq − sk) see no key. There out = 0 and lse = s_h exactly;
// the sink's gradient gets nothing from them (D = 0 there).
TEST(Sinks, RowsWithoutKeysHaveZeroOutAndTheSinkAsLse) {
  AttnConfig cfg = dense_config(DType::bf16, 1, 12, 5, 2, 1, 64);
  cfg.sinks = true;
  cfg.opt.causal = true;
  const AttnProblem p = make_problem(cfg);
  for (Backend backend : {Backend::cpu, Backend::cpu_reference}) {
    const ForwardResult fwd = run_forward(p, backend);
    for (int hh = 0; hh < cfg.heads; ++hh)
      for (int i = 0; i < 7; ++i) {
        EXPECT_EQ(fwd.lse.get({0, hh, i}), p.sinks.get({hh})) << fa::backend_name(backend) << " row " << i;
        for (int e = 0; e < cfg.head_dim; ++e) ASSERT_EQ(fwd.out.get({0, i, hh, e}), 0.0f);
      }
    EXPECT_TRUE(check_forward(p, fwd));
    EXPECT_TRUE(check_backward(p, fwd, run_backward(p, fwd, backend)));
  }
}

// seqlen_k = 0: every row is empty; lse is the sink everywhere and dsinks is 0.
TEST(Sinks, NoKeysAtAll) {
  AttnConfig cfg = dense_config(DType::f16, 2, 3, 0, 2, 2, 64);
  cfg.sinks = true;
  const AttnProblem p = make_problem(cfg);
  for (Backend backend : {Backend::cpu, Backend::cpu_reference}) {
    const ForwardResult fwd = run_forward(p, backend);
    for (int b = 0; b < 2; ++b)
      for (int hh = 0; hh < 2; ++hh)
        for (int i = 0; i < 3; ++i) EXPECT_EQ(fwd.lse.get({b, hh, i}), p.sinks.get({hh}));
    const BackwardResult bwd = run_backward(p, fwd, backend);
    for (int hh = 0; hh < 2; ++hh) EXPECT_EQ(bwd.dsinks.get({hh}), 0.0f);
  }
}

// No query rows: dsinks is written, and is 0.
TEST(Sinks, NoQueryRowsGiveZeroGradient) {
  AttnConfig cfg = dense_config(DType::f16, 1, 0, 9, 3, 1, 64);
  cfg.sinks = true;
  const AttnProblem p = make_problem(cfg);
  for (Backend backend : {Backend::cpu, Backend::cpu_reference}) {
    const ForwardResult fwd = run_forward(p, backend);
    const BackwardResult bwd = run_backward(p, fwd, backend);
    for (int hh = 0; hh < 3; ++hh) EXPECT_EQ(bwd.dsinks.get({hh}), 0.0f) << fa::backend_name(backend);
  }
}

// A sink of −∞ is no sink: the same bits as the call without sinks (lse = +∞ on empty rows), and
// a zero gradient.
TEST(Sinks, MinusInfinityIsNoSink) {
  AttnConfig cfg = dense_config(DType::f16, 2, 30, 20, 4, 2, 64);
  cfg.sinks = true;
  cfg.opt.causal = true;
  AttnProblem p = make_problem(cfg);
  p.sinks.fill(-kInf);
  const AttnProblem plain = without_sinks(p);
  for (Backend backend : {Backend::cpu, Backend::cpu_reference}) {
    SCOPED_TRACE(fa::backend_name(backend));
    const ForwardResult a = run_forward(p, backend), b = run_forward(plain, backend);
    EXPECT_TRUE(bitwise_equal(a.out, b.out));
    EXPECT_TRUE(bitwise_equal(a.lse, b.lse));
    EXPECT_EQ(a.lse.get({0, 0, 0}), kInf);  // row 0 sees no key
    const BackwardResult ga = run_backward(p, a, backend), gb = run_backward(plain, b, backend);
    EXPECT_TRUE(bitwise_equal(ga.dq, gb.dq));
    EXPECT_TRUE(bitwise_equal(ga.dk, gb.dk));
    EXPECT_TRUE(bitwise_equal(ga.dv, gb.dv));
    for (int hh = 0; hh < cfg.heads; ++hh) EXPECT_EQ(ga.dsinks.get({hh}), 0.0f);
  }
}

// A NaN sink makes its head's lse NaN in every row, and out NaN in the rows that see a key (those
// without keep out = 0: an empty sum); the other heads are untouched, and its dsinks is NaN.
TEST(Sinks, NanSinkPropagatesInItsHeadOnly) {
  AttnConfig cfg = dense_config(DType::f32, 1, 10, 6, 2, 2, 32);
  cfg.sinks = true;
  cfg.opt.causal = true;  // rows 0..3 see no key
  AttnProblem p = make_problem(cfg);
  p.sinks.set({0}, kNaN);
  for (Backend backend : {Backend::cpu, Backend::cpu_reference}) {
    SCOPED_TRACE(fa::backend_name(backend));
    const ForwardResult fwd = run_forward(p, backend);
    for (int i = 0; i < cfg.seqlen_q; ++i) {
      EXPECT_TRUE(std::isnan(fwd.lse.get({0, 0, i}))) << "row " << i;
      EXPECT_TRUE(std::isfinite(fwd.lse.get({0, 1, i}))) << "row " << i;
      for (int e = 0; e < cfg.head_dim; ++e) {
        const float o = fwd.out.get({0, i, 0, e});
        if (i < 4) {
          ASSERT_EQ(o, 0.0f) << "row " << i;
        } else {
          ASSERT_TRUE(std::isnan(o)) << "row " << i;
        }
        ASSERT_TRUE(std::isfinite(fwd.out.get({0, i, 1, e})));
      }
    }
    const BackwardResult bwd = run_backward(p, fwd, backend);
    EXPECT_TRUE(std::isnan(bwd.dsinks.get({0})));
    EXPECT_TRUE(std::isfinite(bwd.dsinks.get({1})));
  }
}

// A sink far above every score: exp(s_h) overflows fp32 on its own, but the fold measures from the
// larger of the sink and the row max, so out ≈ 0 and lse ≈ s_h, finite, and dsinks ≈ −Σ D.
TEST(Sinks, LargeSinkDoesNotOverflow) {
  AttnConfig cfg = dense_config(DType::bf16, 1, 20, 40, 2, 2, 64);
  cfg.sinks = true;
  AttnProblem p = make_problem(cfg);
  p.sinks.fill(200.0f);
  for (Backend backend : {Backend::cpu, Backend::cpu_reference}) {
    SCOPED_TRACE(fa::backend_name(backend));
    const ForwardResult fwd = run_forward(p, backend);
    for (int hh = 0; hh < 2; ++hh)
      for (int i = 0; i < cfg.seqlen_q; ++i) EXPECT_NEAR(fwd.lse.get({0, hh, i}), 200.0f, 1e-4f);
    EXPECT_TRUE(check_forward(p, fwd));
    EXPECT_TRUE(check_backward(p, fwd, run_backward(p, fwd, backend)));
  }
}

// dsinks is a fixed-order sum: the same bits for any number of threads.
TEST(Sinks, GradientIsDeterministicAcrossThreadCounts) {
  AttnConfig cfg = dense_config(DType::bf16, 3, 150, 170, 4, 2, 64);
  cfg.sinks = true;
  cfg.opt.causal = true;
  const AttnProblem p = make_problem(cfg);
  const ForwardResult fwd = run_forward(p, Backend::cpu, 1);
  const BackwardResult one = run_backward(p, fwd, Backend::cpu, 1);
  for (int threads : {2, 3, 5}) {
    const BackwardResult many = run_backward(p, fwd, Backend::cpu, threads);
    EXPECT_TRUE(bitwise_equal(one.dsinks, many.dsinks)) << threads << " threads";
    EXPECT_TRUE(bitwise_equal(one.dq, many.dq)) << threads << " threads";
  }
}

// forward_kvcache takes sinks too: over a whole cache without appends it is the plain forward.
TEST(Sinks, KVCacheForwardMatchesForward) {
  AttnConfig cfg = dense_config(DType::f16, 2, 3, 50, 8, 2, 64);
  cfg.sinks = true;
  cfg.opt.causal = true;
  const AttnProblem p = make_problem(cfg);
  for (Backend backend : {Backend::cpu, Backend::cpu_reference}) {
    SCOPED_TRACE(fa::backend_name(backend));
    const ForwardResult want = run_forward(p, backend);
    EXPECT_TRUE(check_forward(p, want));
    ForwardResult got = make_forward_outputs(p);
    fa::KVCacheInputs in;
    in.q = p.q.tv();
    in.k_cache = p.k.tv();
    in.v_cache = p.v.tv();
    in.sinks = p.sinks.tv();
    fa::Options opt = p.opt;
    opt.backend = backend;
    fa::forward_kvcache(in, {got.out.tv(), got.lse.tv()}, opt);
    EXPECT_TRUE(bitwise_equal(got.out, want.out));
    EXPECT_TRUE(bitwise_equal(got.lse, want.lse));
  }
}

// --- validation ---------------------------------------------------------------------------------

// The call throws flashattn::Error whose message contains every one of `parts`.
template <class Call>
testing::AssertionResult throws_with(Call&& call, const std::vector<std::string>& parts) {
  try {
    call();
  } catch (const fa::Error& e) {
    const std::string what = e.what();
    for (const std::string& part : parts) {
      if (what.find(part) == std::string::npos) {
        return testing::AssertionFailure() << "message lacks \"" << part << "\": " << what;
      }
    }
    return testing::AssertionSuccess() << what;
  }
  return testing::AssertionFailure() << "no flashattn::Error thrown";
}

bool still_poisoned(const Tensor& t) {
  for (float x : t.to_vector())
    if (!std::isnan(x)) return false;
  return true;
}

TEST(SinksValidation, ForwardRejectsBadSinksAndWritesNothing) {
  AttnConfig cfg = dense_config(DType::f16, 1, 8, 8, 4, 2, 64);
  const AttnProblem p = make_problem(cfg);
  ForwardResult r = make_forward_outputs(p);
  const fa::ForwardOutputs outs{r.out.tv(), r.lse.tv()};
  struct Bad {
    const char* what;
    Tensor sinks;
    std::vector<std::string> message;
  };
  Tensor f32_5(DType::f32, {5}), f16_4(DType::f16, {4}), f32_1x4(DType::f32, {1, 4});
  Tensor strided = Tensor::with_strides(DType::f32, {4}, {2});
  for (Tensor* t : {&f32_5, &f16_4, &f32_1x4, &strided}) t->fill(0.5f);
  const Bad bad[] = {
      {"shape", f32_5, {"flashattn::forward", "sinks", "wrong shape", "(4)", "(5)"}},
      {"rank", f32_1x4, {"sinks", "wrong shape", "(4)", "(1, 4)"}},
      {"dtype", f16_4, {"sinks", "fp32", "f16"}},
      {"stride", strided, {"sinks", "contiguous"}},
  };
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.what);
    fa::ForwardInputs in = p.forward_inputs();
    in.sinks = b.sinks.tv();
    EXPECT_TRUE(throws_with([&] { fa::forward(in, outs, p.opt); }, b.message));
    const fa::Support s = fa::can_implement(in, outs, p.opt);
    EXPECT_FALSE(s.ok);
    EXPECT_NE(s.reason.find("sinks"), std::string::npos) << s.reason;
    EXPECT_TRUE(still_poisoned(r.out));
    EXPECT_TRUE(still_poisoned(r.lse));
  }
}

TEST(SinksValidation, SinksOnAnotherDevice) {
  const AttnProblem p = make_problem(dense_config(DType::f16, 1, 8, 8, 2, 2, 64));
  ForwardResult r = make_forward_outputs(p);
  Tensor sinks(DType::f32, {2});
  sinks.fill(0.0f);
  fa::ForwardInputs in = p.forward_inputs();
  in.sinks = sinks.tv();
  in.sinks.device = {fa::DeviceType::cuda, 0};
  EXPECT_TRUE(throws_with([&] { fa::forward(in, {r.out.tv(), r.lse.tv()}, p.opt); },
                          {"sinks", "one device", "cpu", "cuda:0"}));
}

TEST(SinksValidation, BackwardRejectsBadDsinks) {
  AttnConfig cfg = dense_config(DType::f16, 1, 8, 8, 3, 1, 64);
  cfg.sinks = true;
  const AttnProblem p = make_problem(cfg);
  const ForwardResult fwd = run_forward(p, Backend::cpu);
  BackwardResult r = make_backward_outputs(p);
  fa::BackwardOutputs outs{r.dq.tv(), r.dk.tv(), r.dv.tv(), r.softmax_d.tv()};

  // dsinks without sinks
  outs.dsinks = r.dsinks.tv();
  fa::BackwardInputs no_sinks = p.backward_inputs(fwd);
  no_sinks.sinks = {};
  EXPECT_TRUE(throws_with([&] { fa::backward(no_sinks, outs, p.opt); },
                          {"flashattn::backward", "dsinks", "gradient of the sinks", "sinks"}));
  // dsinks of the wrong shape / dtype
  Tensor wrong(DType::f32, {2}), wrong_type(DType::bf16, {3});
  outs.dsinks = wrong.tv();
  EXPECT_TRUE(throws_with([&] { fa::backward(p.backward_inputs(fwd), outs, p.opt); },
                          {"dsinks", "wrong shape", "(3)", "(2)"}));
  outs.dsinks = wrong_type.tv();
  EXPECT_TRUE(throws_with([&] { fa::backward(p.backward_inputs(fwd), outs, p.opt); }, {"dsinks", "fp32"}));
  // sinks of the wrong shape in the backward inputs
  Tensor short_sinks(DType::f32, {1});
  short_sinks.fill(0.0f);
  fa::BackwardInputs bad_in = p.backward_inputs(fwd);
  bad_in.sinks = short_sinks.tv();
  outs.dsinks = r.dsinks.tv();
  EXPECT_TRUE(throws_with([&] { fa::backward(bad_in, outs, p.opt); }, {"sinks", "wrong shape", "(3)", "(1)"}));
  EXPECT_TRUE(still_poisoned(r.dq));
  EXPECT_TRUE(still_poisoned(r.dsinks));

  // Without dsinks the backward still runs with the sinks (its dq, dk, dv use the forward's lse).
  outs.dsinks = {};
  fa::backward(p.backward_inputs(fwd), outs, p.opt);
  EXPECT_TRUE(still_poisoned(r.dsinks));
  EXPECT_FALSE(still_poisoned(r.dq));
}

TEST(SinksValidation, KVCacheRejectsBadSinks) {
  const AttnProblem p = make_problem(dense_config(DType::f16, 1, 2, 16, 4, 2, 64));
  ForwardResult r = make_forward_outputs(p);
  Tensor sinks(DType::f32, {2});
  sinks.fill(0.0f);
  fa::KVCacheInputs in;
  in.q = p.q.tv();
  in.k_cache = p.k.tv();
  in.v_cache = p.v.tv();
  in.sinks = sinks.tv();
  EXPECT_TRUE(throws_with([&] { fa::forward_kvcache(in, {r.out.tv(), r.lse.tv()}, p.opt); },
                          {"flashattn::forward_kvcache", "sinks", "wrong shape", "(4)", "(2)"}));
  EXPECT_TRUE(still_poisoned(r.out));
}

}  // namespace
}  // namespace fa_test
