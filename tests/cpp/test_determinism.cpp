// tests/cpp/test_determinism.cpp — the tiled CPU backend gives bitwise identical results for any
// Options::num_threads (src/cpu/cpu.h promises it for forward and backward; SPEC §4 promises
// bitwise reproducible backward under `deterministic`), and from run to run.
#include <string>
#include <vector>

#include "test_util.h"

namespace fa_test {
namespace {

struct Case {
  std::string name;
  AttnConfig cfg;
};

std::vector<Case> cases() {
  std::vector<Case> cs;
  {
    AttnConfig c;
    c.dtype = DType::f16;
    c.batch = 2;
    c.seqlen_q = 131;
    c.seqlen_k = 257;
    c.heads = 4;
    c.heads_k = 2;
    c.head_dim = 64;
    cs.push_back({"gqa", c});
    c.opt.causal = true;
    c.opt.dropout_p = 0.2f;
    c.opt.dropout_seed = 11;
    c.dtype = DType::bf16;
    cs.push_back({"causal_dropout_bf16", c});
  }
  {
    AttnConfig c;
    c.dtype = DType::f32;
    c.heads = 8;
    c.heads_k = 1;
    c.head_dim = 32;
    c.head_dim_v = 64;
    c.varlen_q = {70, 0, 1, 133};
    c.varlen_k = {90, 5, 0, 133};
    c.opt.window_left = 30;
    c.opt.window_right = 10;
    c.opt.softcap = 5.0f;
    c.alibi = Alibi::per_head;
    cs.push_back({"varlen_mqa_window_softcap_alibi", c});
  }
  return cs;
}

class Determinism : public testing::TestWithParam<Case> {};

TEST_P(Determinism, ForwardIdenticalForAnyThreadCount) {
  const AttnProblem p = make_problem(GetParam().cfg);
  const ForwardResult one = run_forward(p, Backend::cpu, 1);
  for (int threads : {1, 2, 3, 5, 17}) {
    const ForwardResult r = run_forward(p, Backend::cpu, threads);
    EXPECT_TRUE(bitwise_equal(one.out, r.out)) << threads << " threads";
    EXPECT_TRUE(bitwise_equal(one.lse, r.lse)) << threads << " threads";
  }
  EXPECT_TRUE(check_forward(p, one));
}

// With Options::deterministic (the SPEC's promise).
TEST_P(Determinism, BackwardDeterministicIdenticalForAnyThreadCount) {
  AttnProblem p = make_problem(GetParam().cfg);
  p.opt.deterministic = true;
  const ForwardResult fwd = run_forward(p, Backend::cpu, 2);
  const BackwardResult one = run_backward(p, fwd, Backend::cpu, 1);
  for (int threads : {1, 2, 3, 5, 17}) {
    const BackwardResult r = run_backward(p, fwd, Backend::cpu, threads);
    EXPECT_TRUE(bitwise_equal(one.dq, r.dq)) << "dq, " << threads << " threads";
    EXPECT_TRUE(bitwise_equal(one.dk, r.dk)) << "dk, " << threads << " threads";
    EXPECT_TRUE(bitwise_equal(one.dv, r.dv)) << "dv, " << threads << " threads";
    EXPECT_TRUE(bitwise_equal(one.softmax_d, r.softmax_d)) << "softmax_d, " << threads << " threads";
  }
  EXPECT_TRUE(check_backward(p, fwd, one));
}

// Without the flag (src/cpu/cpu.h: the CPU backend is deterministic for any num_threads anyway).
TEST_P(Determinism, BackwardDefaultIdenticalForAnyThreadCount) {
  const AttnProblem p = make_problem(GetParam().cfg);
  const ForwardResult fwd = run_forward(p, Backend::cpu, 2);
  const BackwardResult one = run_backward(p, fwd, Backend::cpu, 1);
  for (int threads : {2, 3, 5}) {
    const BackwardResult r = run_backward(p, fwd, Backend::cpu, threads);
    EXPECT_TRUE(bitwise_equal(one.dq, r.dq)) << "dq, " << threads << " threads";
    EXPECT_TRUE(bitwise_equal(one.dk, r.dk)) << "dk, " << threads << " threads";
    EXPECT_TRUE(bitwise_equal(one.dv, r.dv)) << "dv, " << threads << " threads";
    EXPECT_TRUE(bitwise_equal(one.softmax_d, r.softmax_d)) << "softmax_d, " << threads << " threads";
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, Determinism, testing::ValuesIn(cases()),
                         [](const testing::TestParamInfo<Case>& info) { return info.param.name; });

}  // namespace
}  // namespace fa_test
