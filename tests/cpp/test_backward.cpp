// tests/cpp/test_backward.cpp — flashattn::backward through the public API on the tiled CPU
// backend (Backend::cpu) and on the reference's API path (Backend::cpu_reference). The backward
// takes the out/lse its own backend's forward wrote (as a framework would) and dq, dk, dv and
// softmax_d are checked against the fp64 oracle with SPEC §7 (fa_test::check_backward). Plus the
// special cases asserted exactly: empty sequences, fully masked rows (zero gradients, no NaN).
//
// Heavy cases carry "Large" in their name so a sanitizer run can filter them out.
#include <cmath>
#include <string>
#include <vector>

#include "test_util.h"

namespace fa_test {
namespace {

struct Case {
  std::string name;
  AttnConfig cfg;
};

std::vector<Case> backward_cases() {
  std::vector<Case> cases;
  auto add = [&](std::string name, AttnConfig cfg) { cases.push_back({std::move(name), cfg}); };

  struct Shape2 { int sq, sk, b, h, d; const char* tag; };
  const Shape2 shapes[] = {{1, 1, 2, 2, 64, "S1x1"},    {113, 203, 1, 2, 64, "S113x203"},
                           {239, 1, 1, 2, 32, "S239x1"}, {799, 3, 1, 1, 32, "S799x3"},
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
  {
    AttnConfig c = dense_config(DType::f16, 2, 150, 70, 2, 2, 32);
    c.opt.causal = true;  // the first 80 rows see nothing
    add("S150x70_causal_masked_rows", c);
  }
  for (DType dt : dtypes)
    add(std::string("dtype_") + flashattn::dtype_name(dt), dense_config(dt, 2, 77, 129, 2, 2, 64));

  {  // windows
    AttnConfig c = dense_config(DType::f16, 1, 113, 203, 2, 2, 64);
    c.opt.window_left = 32;
    add("window_left", c);
    c.opt.window_left = -1;
    c.opt.window_right = 16;
    add("window_right", c);
    c.opt.window_left = 40;
    c.opt.window_right = 7;
    c.dtype = DType::bf16;
    add("window_both_bf16", c);
    AttnConfig m = dense_config(DType::f16, 1, 64, 20, 2, 1, 32);
    m.opt.window_left = 4;
    m.opt.window_right = 8;  // rows i < 36 see nothing
    add("window_masked_rows", m);
  }
  {  // softcap, ALiBi, dropout
    AttnConfig c = dense_config(DType::f16, 1, 113, 203, 2, 2, 64);
    c.opt.softcap = 1.5f;
    c.qk_amplitude = 2.0f;
    add("softcap", c);
    c.opt.causal = true;
    c.dtype = DType::f32;
    add("softcap_causal_f32", c);
    AttnConfig a = dense_config(DType::f16, 2, 113, 203, 2, 2, 64);
    a.alibi = Alibi::per_head;
    add("alibi_h", a);
    a.alibi = Alibi::per_batch_head;
    a.opt.causal = true;
    a.dtype = DType::bf16;
    add("alibi_bh_causal_bf16", a);
    AttnConfig d = dense_config(DType::f16, 2, 113, 203, 2, 2, 64);
    d.opt.dropout_p = 0.17f;
    d.opt.dropout_seed = 0xfeedbeefcafeull;
    d.opt.dropout_offset = 3;
    add("dropout", d);
    d.opt.dropout_p = 0.5f;
    d.opt.causal = true;
    d.dtype = DType::f32;
    add("dropout_causal_f32", d);
  }
  {
    AttnConfig c = dense_config(DType::f16, 1, 64, 80, 2, 2, 32);
    c.opt.dropout_p = 0.9f;
    c.opt.dropout_seed = 3;
    add("dropout_p09", c);
    AttnConfig s = dense_config(DType::bf16, 1, 70, 90, 2, 1, 64);
    s.opt.softmax_scale = 0.3f;
    s.opt.softcap = 4.0f;
    s.qk_amplitude = 2.0f;
    add("explicit_scale_softcap", s);
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
  for (int ratio : {1, 2, 8}) add("gqa_ratio" + std::to_string(ratio), dense_config(DType::f16, 2, 65, 97, 8, 8 / ratio, 64));
  {
    AttnConfig c = dense_config(DType::bf16, 1, 65, 97, 6, 1, 64);
    c.opt.causal = true;
    add("mqa_causal", c);
  }
  for (int d : {8, 32, 96, 128, 256}) add("head_dim" + std::to_string(d), dense_config(DType::f16, 1, 37, 45, 2, 2, d));
  for (int d : {8, 128, 256}) {  // several key tiles and row blocks at the extreme head dims
    AttnConfig c = dense_config(d == 128 ? DType::bf16 : DType::f16, 1, 200, 333, 1, 1, d);
    c.opt.causal = d != 128;
    add("head_dim" + std::to_string(d) + "_long", c);
  }
  add("d192_dv128", dense_config(DType::bf16, 1, 57, 83, 2, 1, 192, 128));
  add("d64_dv32", dense_config(DType::f16, 2, 57, 83, 2, 2, 64, 32));
  add("d32_dv64", dense_config(DType::f32, 1, 57, 83, 2, 2, 32, 64));

  {  // varlen
    AttnConfig c = dense_config(DType::f16, 0, 0, 0, 4, 2, 64);
    c.varlen_q = {0, 1, 17, 64, 5, 30, 1};
    c.varlen_k = {3, 1, 0, 70, 5, 13, 1};
    add("varlen", c);
    c.opt.causal = true;
    add("varlen_causal", c);
    c.seqused_k = {2, 1, 0, 41, 5, 0, 1};
    add("varlen_seqused_k_causal", c);
    c.opt.causal = false;
    add("varlen_seqused_k", c);
    AttnConfig p = dense_config(DType::bf16, 0, 0, 0, 2, 2, 32);
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
    d.alibi = Alibi::per_batch_head;
    d.layout = Layout::padded;
    d.padded_outputs = true;
    add("varlen_dropout_alibi_padded", d);
  }
  {  // layouts
    AttnConfig c = dense_config(DType::f16, 2, 70, 70, 3, 3, 64);
    c.layout = Layout::packed_qkv;
    add("packed_qkv", c);
    AttnConfig t = dense_config(DType::bf16, 2, 70, 90, 4, 2, 32);
    t.layout = Layout::bhsd;
    add("layout_bhsd", t);
    t.layout = Layout::padded;
    t.padded_outputs = true;
    add("layout_padded", t);
  }
  add("seqlen_q0", dense_config(DType::f16, 2, 0, 17, 2, 2, 32));
  add("seqlen_k0", dense_config(DType::f16, 2, 17, 0, 2, 2, 32));
  {
    AttnConfig c = dense_config(DType::f16, 1, 100, 300, 2, 2, 64);
    c.qk_amplitude = 4.0f;
    add("peaky_scores", c);
  }
  return cases;
}

struct Param {
  Case c;
  Backend backend;
};

std::vector<Param> params() {
  std::vector<Param> ps;
  for (const Case& c : backward_cases())
    for (Backend b : {Backend::cpu, Backend::cpu_reference}) ps.push_back({c, b});
  return ps;
}

class Backward : public testing::TestWithParam<Param> {};

TEST_P(Backward, MatchesReference) {
  const Param& prm = GetParam();
  const AttnProblem p = make_problem(prm.c.cfg);
  SCOPED_TRACE(describe(p.cfg));
  const ForwardResult fwd = run_forward(p, prm.backend, 2);
  const BackwardResult bwd = run_backward(p, fwd, prm.backend, 2);
  EXPECT_TRUE(check_backward(p, fwd, bwd));
}

INSTANTIATE_TEST_SUITE_P(Grid, Backward, testing::ValuesIn(params()),
                         [](const testing::TestParamInfo<Param>& info) {
                           return info.param.c.name +
                                  (info.param.backend == Backend::cpu ? "_cpu" : "_cpuref");
                         });

// --- exact special cases -----------------------------------------------------------------------

class BackwardSpecial : public testing::TestWithParam<Backend> {};

int count_nonfinite(const Tensor& t) {
  int n = 0;
  t.for_each_index([&](const Index& idx) { n += !std::isfinite(t.get(idx)); });
  return n;
}

// seqlen_q == 0: dk = dv = 0 (SPEC §5). seqlen_k == 0: dq = 0 and softmax_d = 0.
TEST_P(BackwardSpecial, EmptySequences) {
  {
    const AttnProblem p = make_problem(dense_config(DType::f16, 2, 0, 9, 4, 2, 32));
    const ForwardResult f = run_forward(p, GetParam(), 2);
    const BackwardResult r = run_backward(p, f, GetParam(), 2);
    r.dk.for_each_index([&](const Index& idx) { ASSERT_EQ(r.dk.get(idx), 0.0f); });
    r.dv.for_each_index([&](const Index& idx) { ASSERT_EQ(r.dv.get(idx), 0.0f); });
  }
  {
    const AttnProblem p = make_problem(dense_config(DType::bf16, 2, 9, 0, 4, 2, 32));
    const ForwardResult f = run_forward(p, GetParam(), 2);
    const BackwardResult r = run_backward(p, f, GetParam(), 2);
    r.dq.for_each_index([&](const Index& idx) { ASSERT_EQ(r.dq.get(idx), 0.0f); });
    r.softmax_d.for_each_index([&](const Index& idx) { ASSERT_EQ(r.softmax_d.get(idx), 0.0f); });
  }
}

// Rows that see no key contribute nothing: their dq rows and softmax_d are exactly 0, and no
// gradient anywhere is NaN or infinite.
TEST_P(BackwardSpecial, FullyMaskedRowsHaveZeroGradients) {
  std::vector<std::pair<AttnConfig, int>> configs;  // config, rows 0..n−1 fully masked
  {
    AttnConfig c = dense_config(DType::f16, 2, 50, 20, 2, 1, 32);
    c.opt.causal = true;
    configs.push_back({c, 30});
    c.opt.causal = false;
    c.opt.window_left = 3;
    c.opt.window_right = 5;
    c.opt.softcap = 2.0f;
    c.alibi = Alibi::per_batch_head;
    c.opt.dropout_p = 0.2f;
    c.dtype = DType::bf16;
    configs.push_back({c, 25});
  }
  for (const auto& [cfg, masked] : configs) {
    const AttnProblem p = make_problem(cfg);
    SCOPED_TRACE(describe(p.cfg));
    const ForwardResult f = run_forward(p, GetParam(), 3);
    const BackwardResult r = run_backward(p, f, GetParam(), 3);
    EXPECT_EQ(count_nonfinite(r.dq), 0);
    EXPECT_EQ(count_nonfinite(r.dk), 0);
    EXPECT_EQ(count_nonfinite(r.dv), 0);
    EXPECT_EQ(count_nonfinite(r.softmax_d), 0);
    for (int b = 0; b < p.cfg.batch; ++b)
      for (int i = 0; i < masked; ++i)
        for (int hh = 0; hh < p.cfg.heads; ++hh) {
          ASSERT_EQ(r.softmax_d.get({b, hh, i}), 0.0f) << b << " " << i << " " << hh;
          for (int c = 0; c < p.cfg.head_dim; ++c) ASSERT_EQ(r.dq.get({b, i, hh, c}), 0.0f);
        }
    EXPECT_TRUE(check_backward(p, f, r));
  }
}

// GQA sums dk/dv over the group: a group of 4 heads whose q and
// dout are identical gives 4× the dk/dv of one head.
TEST_P(BackwardSpecial, GqaSumsOverGroup) {
  AttnConfig c = dense_config(DType::f32, 1, 24, 24, 4, 1, 16);
  AttnProblem p = make_problem(c);
  // Same q and dout for all four heads: each head's contribution is identical.
  for (int i = 0; i < 24; ++i)
    for (int hh = 1; hh < 4; ++hh)
      for (int col = 0; col < 16; ++col) {
        p.q.set({0, i, hh, col}, p.q.get({0, i, 0, col}));
        p.dout.set({0, i, hh, col}, p.dout.get({0, i, 0, col}));
      }
  const ForwardResult f = run_forward(p, GetParam(), 2);
  const BackwardResult r = run_backward(p, f, GetParam(), 2);
  AttnConfig c1 = c;
  c1.heads = 1;
  AttnProblem p1 = make_problem(c1);
  for (int i = 0; i < 24; ++i)
    for (int col = 0; col < 16; ++col) {
      p1.q.set({0, i, 0, col}, p.q.get({0, i, 0, col}));
      p1.k.set({0, i, 0, col}, p.k.get({0, i, 0, col}));
      p1.v.set({0, i, 0, col}, p.v.get({0, i, 0, col}));
      p1.dout.set({0, i, 0, col}, p.dout.get({0, i, 0, col}));
    }
  const ForwardResult f1 = run_forward(p1, GetParam(), 2);
  const BackwardResult r1 = run_backward(p1, f1, GetParam(), 2);
  for (int j = 0; j < 24; ++j)
    for (int col = 0; col < 16; ++col) {
      EXPECT_NEAR(r.dv.get({0, j, 0, col}), 4.0f * r1.dv.get({0, j, 0, col}), 1e-5) << j;
      EXPECT_NEAR(r.dk.get({0, j, 0, col}), 4.0f * r1.dk.get({0, j, 0, col}), 1e-5) << j;
    }
  EXPECT_TRUE(check_backward(p, f, r));
}

// dq, dk, dv written as views into one packed (b, s, 3, h, d) gradient buffer (what a qkv-packed
// autograd function hands over): each lands in its own slot, nothing overlaps.
TEST_P(BackwardSpecial, GradientsIntoPackedBuffer) {
  AttnConfig c = dense_config(DType::bf16, 2, 45, 45, 3, 3, 32);
  c.layout = Layout::packed_qkv;
  c.opt.causal = true;
  const AttnProblem p = make_problem(c);
  const ForwardResult f = run_forward(p, GetParam(), 2);
  Tensor dqkv(DType::bf16, {2, 45, 3, 3, 32});
  const Strides st{45 * 3 * 3 * 32, 3 * 3 * 32, 32, 1};
  BackwardResult r;
  r.dq = dqkv.view(0, {2, 45, 3, 32}, st);
  r.dk = dqkv.view(3 * 32, {2, 45, 3, 32}, st);
  r.dv = dqkv.view(2 * 3 * 32, {2, 45, 3, 32}, st);
  r.softmax_d = Tensor(DType::f32, {2, 3, 45});
  flashattn::Options opt = p.opt;
  opt.backend = GetParam();
  opt.num_threads = 3;
  flashattn::backward(p.backward_inputs(f), {r.dq.tv(), r.dk.tv(), r.dv.tv(), r.softmax_d.tv()}, opt);
  EXPECT_TRUE(check_backward(p, f, r));
  // The three views tile the buffer completely, so nothing of it may still be poisoned.
  std::int64_t poisoned = 0;
  dqkv.for_each_index([&](const Index& idx) { poisoned += std::isnan(dqkv.get(idx)); });
  EXPECT_EQ(poisoned, 0);
}

INSTANTIATE_TEST_SUITE_P(Backends, BackwardSpecial,
                         testing::Values(Backend::cpu, Backend::cpu_reference),
                         [](const testing::TestParamInfo<Backend>& info) {
                           return std::string(info.param == Backend::cpu ? "cpu" : "cpuref");
                         });

}  // namespace
}  // namespace fa_test
