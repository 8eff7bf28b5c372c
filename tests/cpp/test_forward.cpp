// tests/cpp/test_forward.cpp — flashattn::forward through the public API, on the tiled CPU backend
// (Backend::cpu) and on the reference's API path (Backend::cpu_reference), each checked against
// the fp64 oracle with the accuracy rule of SPEC §7 (fa_test::check_forward). Plus the special
// cases of SPEC §2.5 / §5 asserted exactly: empty sequences and fully masked rows.
//
// Heavy cases carry "Large" in their name so a sanitizer run can filter them out.
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "test_util.h"

namespace fa_test {
namespace {

struct Case {
  std::string name;
  AttnConfig cfg;
};

// The feature grid shared by the forward tests. Every case runs on both backends.
std::vector<Case> forward_cases() {
  std::vector<Case> cases;
  auto add = [&](std::string name, AttnConfig cfg) { cases.push_back({std::move(name), cfg}); };

  // --- the odd and the tiny shapes of STYLE.md, plain and causal --------------------------------
  struct Shape2 { int sq, sk, b, h, d; const char* tag; };
  const Shape2 shapes[] = {{1, 1, 2, 2, 64, "S1x1"},      {113, 203, 2, 2, 64, "S113x203"},
                           {239, 1, 1, 2, 32, "S239x1"},   {799, 3, 1, 2, 32, "S799x3"},
                           {1023, 1024, 1, 1, 32, "Large_S1023x1024"}};
  const DType dtypes[] = {DType::f16, DType::bf16, DType::f32};
  int k = 0;
  for (const auto& s : shapes) {
    for (bool causal : {false, true}) {
      AttnConfig c = dense_config(dtypes[k++ % 3], s.b, s.sq, s.sk, s.h, s.h, s.d);
      c.opt.causal = causal;
      add(std::string(s.tag) + (causal ? "_causal" : "") + "_" + flashattn::dtype_name(c.dtype), c);
    }
  }
  // Causal with sq > sk: the first sq − sk rows see nothing (out 0, lse +inf).
  {
    AttnConfig c = dense_config(DType::f16, 2, 203, 113, 2, 2, 64);
    c.opt.causal = true;
    add("S203x113_causal_masked_rows", c);
  }

  // --- dtypes on one mid shape -------------------------------------------------------------------
  for (DType dt : dtypes) {
    add(std::string("dtype_") + flashattn::dtype_name(dt), dense_config(dt, 2, 77, 129, 3, 3, 64));
  }

  // --- sliding windows ---------------------------------------------------------------------------
  {
    AttnConfig c = dense_config(DType::f16, 2, 113, 203, 2, 2, 64);
    c.opt.window_left = 32;
    add("window_left", c);
    c.opt.window_left = -1;
    c.opt.window_right = 16;
    add("window_right", c);
    c.opt.window_left = 40;
    c.opt.window_right = 7;
    add("window_both", c);
    c.opt.window_left = 0;
    c.opt.window_right = 0;
    add("window_diagonal_only", c);
    c.opt.window_left = 13;
    c.opt.causal = true;  // causal forces window_right = 0
    c.opt.window_right = -1;
    add("window_left_causal", c);
    // A window that excludes every key for the first rows (r + window_right < 0).
    AttnConfig m = dense_config(DType::bf16, 1, 64, 20, 2, 2, 32);
    m.opt.window_left = 4;
    m.opt.window_right = 8;
    add("window_masked_rows", m);
    // Windows at least as long as the keys are unbounded (normalised to −1).
    AttnConfig w = dense_config(DType::f16, 1, 50, 60, 2, 2, 32);
    w.opt.window_left = 60;
    w.opt.window_right = 1000;
    add("window_wider_than_keys", w);
  }

  // --- softcap, ALiBi, dropout -------------------------------------------------------------------
  {
    AttnConfig c = dense_config(DType::f16, 2, 113, 203, 2, 2, 64);
    c.opt.softcap = 1.5f;
    c.qk_amplitude = 2.0f;  // scores of several units so that tanh saturates
    add("softcap", c);
    c.dtype = DType::bf16;
    c.opt.causal = true;
    add("softcap_causal_bf16", c);
  }
  {
    AttnConfig c = dense_config(DType::f16, 2, 113, 203, 4, 4, 64);
    c.alibi = Alibi::per_head;
    add("alibi_h", c);
    c.alibi = Alibi::per_batch_head;
    add("alibi_bh", c);
    c.opt.causal = true;
    c.dtype = DType::bf16;
    add("alibi_bh_causal_bf16", c);
  }
  {
    AttnConfig c = dense_config(DType::f16, 2, 113, 203, 2, 2, 64);
    c.opt.dropout_p = 0.17f;
    c.opt.dropout_seed = 0x1234567890abcdefull;
    c.opt.dropout_offset = 12;
    add("dropout", c);
    c.opt.causal = true;
    c.opt.dropout_p = 0.5f;
    c.dtype = DType::f32;
    add("dropout_causal_f32", c);
  }
  {
    AttnConfig c = dense_config(DType::f16, 1, 64, 80, 2, 2, 32);
    c.opt.dropout_p = 0.9f;  // keep_scale = 10: large kept values
    c.opt.dropout_seed = 3;
    add("dropout_p09", c);
    AttnConfig a = dense_config(DType::bf16, 2, 150, 60, 2, 2, 32);
    a.alibi = Alibi::per_batch_head;  // sq > sk, non-causal: the distance is an absolute value
    add("alibi_sq_gt_sk", a);
    AttnConfig m = dense_config(DType::f16, 17, 3, 5, 2, 1, 16);
    m.opt.causal = true;
    add("many_batches", m);
  }
  {  // everything at once
    AttnConfig c = dense_config(DType::bf16, 2, 97, 131, 8, 2, 64, 32);
    c.opt.causal = true;
    c.opt.window_left = 50;
    c.opt.softcap = 3.0f;
    c.alibi = Alibi::per_batch_head;
    c.opt.dropout_p = 0.1f;
    c.opt.dropout_seed = 77;
    c.layout = Layout::padded;
    c.padded_outputs = true;
    add("all_features", c);
  }

  // --- GQA / MQA ---------------------------------------------------------------------------------
  for (int ratio : {1, 2, 8}) {
    AttnConfig c = dense_config(DType::f16, 2, 65, 97, 8, 8 / ratio, 64);
    add("gqa_ratio" + std::to_string(ratio), c);
  }
  {
    AttnConfig c = dense_config(DType::bf16, 2, 65, 97, 6, 1, 64);
    c.opt.causal = true;
    add("mqa_causal", c);
  }

  // --- head dims ---------------------------------------------------------------------------------
  for (int d : {8, 16, 24, 32, 40, 64, 80, 96, 128, 160, 192, 224, 256}) {
    add("head_dim" + std::to_string(d), dense_config(DType::f16, 1, 37, 45, 2, 2, d));
  }
  for (int d : {8, 128, 256}) {  // several key tiles and row blocks at the extreme head dims
    AttnConfig c = dense_config(d == 128 ? DType::bf16 : DType::f16, 1, 200, 333, 1, 1, d);
    c.opt.causal = d != 128;
    add("head_dim" + std::to_string(d) + "_long", c);
  }
  add("d192_dv128", dense_config(DType::bf16, 1, 57, 83, 2, 1, 192, 128));
  add("d64_dv32", dense_config(DType::f16, 2, 57, 83, 2, 2, 64, 32));
  add("d32_dv64", dense_config(DType::f32, 1, 57, 83, 2, 2, 32, 64));
  add("d8_dv256", dense_config(DType::f16, 1, 33, 40, 1, 1, 8, 256));

  // --- varlen ------------------------------------------------------------------------------------
  {
    AttnConfig c = dense_config(DType::f16, 0, 0, 0, 4, 2, 64);
    c.varlen_q = {0, 1, 17, 64, 5, 30, 1};
    c.varlen_k = {3, 1, 0, 70, 5, 13, 1};
    add("varlen", c);
    c.opt.causal = true;
    add("varlen_causal", c);
    c.opt.causal = false;
    c.seqused_k = {2, 1, 0, 41, 5, 0, 1};
    add("varlen_seqused_k", c);
    c.opt.causal = true;
    c.opt.window_left = 9;
    c.alibi = Alibi::per_batch_head;
    c.dtype = DType::bf16;
    add("varlen_seqused_k_window_alibi", c);
    AttnConfig p = dense_config(DType::f16, 0, 0, 0, 2, 2, 32);
    p.varlen_q = {5, 0, 33, 1};
    p.varlen_k = {5, 0, 33, 1};
    p.layout = Layout::packed_qkv;
    p.opt.causal = true;
    add("varlen_packed_qkv", p);
    AttnConfig d = dense_config(DType::f32, 0, 0, 0, 2, 1, 32);
    d.varlen_q = {19, 0, 7};
    d.varlen_k = {3, 40, 0};
    d.opt.dropout_p = 0.3f;
    d.opt.dropout_seed = 5;
    d.layout = Layout::padded;
    d.padded_outputs = true;
    add("varlen_dropout_padded", d);
  }

  // --- layouts -----------------------------------------------------------------------------------
  {
    AttnConfig c = dense_config(DType::f16, 2, 70, 70, 3, 3, 64);
    c.layout = Layout::packed_qkv;
    add("packed_qkv", c);
    c.opt.causal = true;
    c.dtype = DType::bf16;
    add("packed_qkv_causal", c);
    AttnConfig t = dense_config(DType::f16, 2, 70, 90, 4, 2, 32);
    t.layout = Layout::bhsd;
    add("layout_bhsd", t);
    t.layout = Layout::padded;
    t.padded_outputs = true;
    add("layout_padded", t);
  }

  // --- empty sequences ---------------------------------------------------------------------------
  add("seqlen_q0", dense_config(DType::f16, 2, 0, 17, 2, 2, 32));
  add("seqlen_k0", dense_config(DType::f16, 2, 17, 0, 2, 2, 32));
  {
    AttnConfig c = dense_config(DType::bf16, 1, 9, 0, 2, 1, 32);
    c.opt.causal = true;
    add("seqlen_k0_causal", c);
  }

  // --- peaky softmax (large scores): exercises the running max of the online softmax -----------
  {
    AttnConfig c = dense_config(DType::f16, 1, 100, 300, 2, 2, 64);
    c.qk_amplitude = 4.0f;
    add("peaky_scores", c);
    c.opt.softmax_scale = 0.5f;
    c.dtype = DType::f32;
    add("peaky_scores_scale_f32", c);
  }
  return cases;
}

struct Param {
  Case c;
  Backend backend;
};

std::string param_name(const testing::TestParamInfo<Param>& info) {
  return info.param.c.name + (info.param.backend == Backend::cpu ? "_cpu" : "_cpuref");
}

std::vector<Param> params() {
  std::vector<Param> ps;
  for (const Case& c : forward_cases())
    for (Backend b : {Backend::cpu, Backend::cpu_reference}) ps.push_back({c, b});
  return ps;
}

class Forward : public testing::TestWithParam<Param> {};

TEST_P(Forward, MatchesReference) {
  const Param& prm = GetParam();
  const AttnProblem p = make_problem(prm.c.cfg);
  SCOPED_TRACE(describe(p.cfg));
  const ForwardResult fwd = run_forward(p, prm.backend, 2);
  EXPECT_TRUE(check_forward(p, fwd));
}

INSTANTIATE_TEST_SUITE_P(Grid, Forward, testing::ValuesIn(params()), param_name);

// --- exact special cases -----------------------------------------------------------------------

const float kInf = std::numeric_limits<float>::infinity();

class ForwardSpecial : public testing::TestWithParam<Backend> {};

// Rows with no visible key: out exactly 0, lse exactly +inf; the other rows finite.
TEST_P(ForwardSpecial, FullyMaskedRowsAreZeroWithInfiniteLse) {
  struct Masked {
    AttnConfig cfg;
    int masked_rows;  // rows 0 .. masked_rows − 1 see nothing
  };
  std::vector<Masked> configs;
  {
    AttnConfig c = dense_config(DType::f16, 2, 50, 20, 2, 1, 32);
    c.opt.causal = true;  // r = i − 30 < 0 for i < 30
    configs.push_back({c, 30});
    c.opt.causal = false;
    c.opt.window_left = 3;
    c.opt.window_right = 5;  // r + 5 < 0 for i < 25
    c.dtype = DType::bf16;
    c.alibi = Alibi::per_head;
    c.opt.softcap = 2.0f;
    configs.push_back({c, 25});
    c.opt.dropout_p = 0.25f;
    c.dtype = DType::f32;
    configs.push_back({c, 25});
  }
  for (const Masked& m : configs) {
    const AttnProblem p = make_problem(m.cfg);
    SCOPED_TRACE(describe(p.cfg));
    const ForwardResult r = run_forward(p, GetParam(), 3);
    for (int b = 0; b < p.cfg.batch; ++b)
      for (int i = 0; i < p.cfg.seqlen_q; ++i)
        for (int hh = 0; hh < p.cfg.heads; ++hh) {
          const float lse = r.lse.get({b, hh, i});
          if (i < m.masked_rows) {
            ASSERT_EQ(lse, kInf) << "b=" << b << " i=" << i << " h=" << hh;
            for (int c = 0; c < p.head_dim_v; ++c)
              ASSERT_EQ(r.out.get({b, i, hh, c}), 0.0f) << "b=" << b << " i=" << i << " c=" << c;
          } else {
            ASSERT_TRUE(std::isfinite(lse)) << "b=" << b << " i=" << i << " lse=" << lse;
          }
        }
    EXPECT_TRUE(check_forward(p, r));
  }
}

// seqlen_k == 0: out = 0 and lse = +inf everywhere (SPEC §5); seqlen_q == 0 writes nothing and
// does not fail.
TEST_P(ForwardSpecial, EmptySequences) {
  {
    const AttnProblem p = make_problem(dense_config(DType::f16, 2, 7, 0, 3, 1, 16));
    const ForwardResult r = run_forward(p, GetParam(), 2);
    r.out.for_each_index([&](const Index& idx) { ASSERT_EQ(r.out.get(idx), 0.0f); });
    r.lse.for_each_index([&](const Index& idx) { ASSERT_EQ(r.lse.get(idx), kInf); });
  }
  {
    const AttnProblem p = make_problem(dense_config(DType::f16, 2, 0, 9, 3, 1, 16));
    const ForwardResult r = run_forward(p, GetParam(), 2);
    EXPECT_EQ(r.out.numel(), 0);
    EXPECT_EQ(r.out.count_written_outside_view(), 0);
  }
  {  // varlen where every sequence is empty on one side
    AttnConfig c = dense_config(DType::bf16, 0, 0, 0, 2, 2, 16);
    c.varlen_q = {3, 0, 2};
    c.varlen_k = {0, 4, 0};
    const AttnProblem p = make_problem(c);
    const ForwardResult r = run_forward(p, GetParam(), 2);
    r.out.for_each_index([&](const Index& idx) { ASSERT_EQ(r.out.get(idx), 0.0f); });
    r.lse.for_each_index([&](const Index& idx) { ASSERT_EQ(r.lse.get(idx), kInf); });
  }
}

// One key: p = 1 exactly, so out is v (rounded once) and lse is the single score.
TEST_P(ForwardSpecial, SingleKeyGivesValueRow) {
  const AttnProblem p = make_problem(dense_config(DType::f32, 2, 31, 1, 2, 1, 32));
  const ForwardResult r = run_forward(p, GetParam(), 2);
  const double scale = 1.0 / std::sqrt(32.0);
  for (int b = 0; b < 2; ++b)
    for (int i = 0; i < 31; ++i)
      for (int hh = 0; hh < 2; ++hh) {
        for (int c = 0; c < 32; ++c)
          ASSERT_NEAR(r.out.get({b, i, hh, c}), p.v.get({b, 0, 0, c}), 1e-6) << b << " " << i;
        double dot = 0;
        for (int c = 0; c < 32; ++c) dot += double(p.q.get({b, i, hh, c})) * p.k.get({b, 0, 0, c});
        ASSERT_NEAR(r.lse.get({b, hh, i}), dot * scale, 1e-5);
      }
}

// return_lse = false: lse may be left undefined and out is still right.
TEST_P(ForwardSpecial, WithoutLse) {
  const AttnProblem p = make_problem(dense_config(DType::f16, 1, 40, 50, 2, 2, 32));
  ForwardResult r = make_forward_outputs(p);
  flashattn::Options opt = p.opt;
  opt.backend = GetParam();
  opt.return_lse = false;
  flashattn::forward(p.forward_inputs(), {r.out.tv(), {}}, opt);
  AttnProblem q = p;
  q.opt.return_lse = false;
  EXPECT_TRUE(check_forward(q, r));
}

// Scores that rise (or fall) steadily along the keys: the running row max of an online softmax
// changes in every key tile (rising) or is set by the first tile while later tiles underflow
// (falling). Eight dims of q are fixed at +2 and the same dims of k ramp over ±2, which adds a
// ramp of ±4 to every score. Forward and backward, both backends.
TEST_P(ForwardSpecial, MonotoneScoresAcrossTiles) {
  for (bool rising : {true, false}) {
    for (DType dt : {DType::f16, DType::f32}) {
      AttnConfig c = dense_config(dt, 1, 70, 700, 2, 1, 64);
      AttnProblem p = make_problem(c);
      const int sk = 700;
      for (int j = 0; j < sk; ++j)
        for (int x = 0; x < 8; ++x) {
          const float ramp = -2.0f + 4.0f * float(j) / float(sk - 1);
          p.k.set({0, j, 0, x}, round_to(dt, rising ? ramp : -ramp));
        }
      for (int i = 0; i < 70; ++i)
        for (int hh = 0; hh < 2; ++hh)
          for (int x = 0; x < 8; ++x) p.q.set({0, i, hh, x}, 2.0f);
      SCOPED_TRACE(std::string(rising ? "rising " : "falling ") + describe(p.cfg));
      const ForwardResult f = run_forward(p, GetParam(), 2);
      EXPECT_TRUE(check_forward(p, f));
      const BackwardResult b = run_backward(p, f, GetParam(), 2);
      EXPECT_TRUE(check_backward(p, f, b));
    }
  }
}

// Backend::automatic serves host tensors with the CPU flash backend (bitwise the same result).
TEST(ForwardAutomatic, PicksCpuBackend) {
  AttnConfig c = dense_config(DType::f16, 2, 33, 47, 4, 2, 32);
  c.opt.causal = true;
  const AttnProblem p = make_problem(c);
  const ForwardResult a = run_forward(p, Backend::automatic, 2);
  const ForwardResult b = run_forward(p, Backend::cpu, 2);
  EXPECT_TRUE(bitwise_equal(a.out, b.out));
  EXPECT_TRUE(bitwise_equal(a.lse, b.lse));
  EXPECT_TRUE(check_forward(p, a));
  const flashattn::Support s = flashattn::can_implement(p.forward_inputs(), {a.out.tv(), a.lse.tv()}, p.opt);
  EXPECT_TRUE(s.ok) << s.reason;
  EXPECT_EQ(s.backend, Backend::cpu);
}

// Workspace::grow is asked only for a need beyond the workspace: host calls need none, so neither
// the forward nor the backward asks, and both compute what they compute without it.
TEST(WorkspaceGrow, HostCallsNeverAsk) {
  AttnConfig c = dense_config(DType::bf16, 2, 33, 47, 4, 2, 32);
  c.opt.causal = true;
  const AttnProblem p = make_problem(c);
  struct Recorder {
    int asked = 0;
    static flashattn::Workspace grow(void* self, std::size_t) {
      ++static_cast<Recorder*>(self)->asked;
      return {};
    }
  } recorder;
  const flashattn::Workspace ws{nullptr, 0, &Recorder::grow, &recorder};
  const ForwardResult plain = run_forward(p, Backend::cpu, 2);
  ForwardResult f = make_forward_outputs(p);
  flashattn::forward(p.forward_inputs(), {f.out.tv(), f.lse.tv()}, p.opt, ws);
  EXPECT_TRUE(bitwise_equal(f.out, plain.out) && bitwise_equal(f.lse, plain.lse));
  const BackwardResult plain_b = run_backward(p, f, Backend::cpu, 2);
  BackwardResult b = make_backward_outputs(p);
  flashattn::backward(p.backward_inputs(f), {b.dq.tv(), b.dk.tv(), b.dv.tv(), b.softmax_d.tv()}, p.opt, ws);
  EXPECT_TRUE(bitwise_equal(b.dq, plain_b.dq) && bitwise_equal(b.dk, plain_b.dk) && bitwise_equal(b.dv, plain_b.dv));
  EXPECT_EQ(recorder.asked, 0);
}

INSTANTIATE_TEST_SUITE_P(Backends, ForwardSpecial,
                         testing::Values(Backend::cpu, Backend::cpu_reference),
                         [](const testing::TestParamInfo<Backend>& info) {
                           return std::string(info.param == Backend::cpu ? "cpu" : "cpuref");
                         });

}  // namespace
}  // namespace fa_test
