// tests/cuda/test_cuda_sinks.cpp — attention sinks (docs/sinks.md) in the CUDA backend: the sm80
// forward folds the sink into each row's sum in its epilogue (unsplit) or the combine kernel adds
// it (split-KV: once, never per split); the backward's dS needs nothing new (the forward's lse has
// the sink) and dsinks comes from one small kernel (src/cuda/sinks.cu). Everything is checked
// against the fp64 reference under SPEC §7 (check_forward / check_backward, dsinks included):
// plain, GQA-packed, full (softcap, ALiBi, dropout) and varlen kernels, rows without keys, forced
// splits, special sink values, determinism of dsinks, and the public API on CUDA tensors. The
// sm90 family declines sinks (host-only check). Without a GPU the device tests skip and say so.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "cuda/sm80/sm80_fwd.h"
#include "cuda/sm90/sm90_fwd.h"
#include "cuda_test_util.h"

namespace fa_test::cuda {
namespace {

namespace c = flashattn::common;
using flashattn::DType;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

const char* dtype_tag(DType t) { return t == DType::f16 ? "f16" : "bf16"; }

AttnConfig sink_config(DType dtype, int b, int sq, int sk, int h, int hk, int d) {
  AttnConfig cfg = dense_config(dtype, b, sq, sk, h, hk, d);
  cfg.sinks = true;
  return cfg;
}

ParamsHook force_splits(int num_splits) {
  return [num_splits](c::AttentionParams& dp, DeviceArena&) { dp.num_splits = num_splits; };
}

// Forward (unsplit) and backward on the device, both checked against the reference.
void expect_matches(const AttnProblem& p, const ParamsHook& hook = {}) {
  SCOPED_TRACE(describe(p.cfg));
  const ForwardResult fwd = run_cuda_forward(p, hook);
  EXPECT_TRUE(check_forward(p, fwd));
  const BackwardResult bwd = run_cuda_backward(p, fwd);
  EXPECT_TRUE(check_backward(p, fwd, bwd));
}
void expect_matches(const AttnConfig& cfg, const ParamsHook& hook = {}) { expect_matches(make_problem(cfg), hook); }

// The problem without its sinks (same q, k, v, dout).
AttnProblem without_sinks(const AttnProblem& p) {
  AttnProblem q = p;
  q.cfg.sinks = false;
  q.sinks = Tensor();
  return q;
}

class CudaSinks : public testing::TestWithParam<DType> {};

// The plain kernels of every compiled head dim, causal or not, GQA, d ≠ dv.
TEST_P(CudaSinks, PlainKernels) {
  FA_SKIP_WITHOUT_GPU();
  for (int d : {64, 128, 256}) {
    for (bool causal : {false, true}) {
      AttnConfig cfg = sink_config(GetParam(), 2, 131, 257, 4, 2, d);
      cfg.opt.causal = causal;
      expect_matches(cfg);
    }
  }
  AttnConfig dv = sink_config(GetParam(), 1, 64, 96, 2, 1, 128);
  dv.head_dim_v = 64;
  expect_matches(dv);
}

// Causal with sq > sk: the first sq − sk rows see no key; there out = 0 and lse = s_h exactly.
TEST_P(CudaSinks, RowsWithoutKeys) {
  FA_SKIP_WITHOUT_GPU();
  AttnConfig cfg = sink_config(GetParam(), 2, 200, 70, 4, 4, 64);
  cfg.opt.causal = true;
  const AttnProblem p = make_problem(cfg);
  expect_matches(p);
  const ForwardResult fwd = run_cuda_forward(p);
  if (fwd.not_run) return;
  for (int b = 0; b < 2; ++b)
    for (int hh = 0; hh < 4; ++hh)
      for (int i = 0; i < 130; ++i) {
        ASSERT_EQ(fwd.lse.get({b, hh, i}), p.sinks.get({hh})) << "b " << b << " head " << hh << " row " << i;
        ASSERT_EQ(fwd.out.get({b, i, hh, 0}), 0.0f);
      }
  // No keys at all: every row is such a row.
  expect_matches(sink_config(GetParam(), 2, 33, 0, 2, 2, 64));
}

// Decoding shapes take the GQA-packed kernel, whose rows belong to different heads: each row must
// read its own head's sink.
TEST_P(CudaSinks, PackedGqa) {
  FA_SKIP_WITHOUT_GPU();
  const FamilyOverride family("sm80");
  const ParamsHook packed = [](c::AttentionParams& dp, DeviceArena&) {
    EXPECT_EQ(flashattn::cuda::sm80::fwd_pack(dp, 128), dp.heads / dp.heads_k);
  };
  for (int sq : {1, 5}) {
    AttnConfig cfg = sink_config(GetParam(), 2, sq, 333, 16, 2, 128);
    cfg.opt.causal = sq > 1;
    expect_matches(cfg, packed);
  }
}

// The full variant (softcap, ALiBi, dropout compiled in) and varlen batches with empty sequences.
TEST_P(CudaSinks, FullVariantAndVarlen) {
  FA_SKIP_WITHOUT_GPU();
  AttnConfig cfg = sink_config(GetParam(), 2, 96, 160, 4, 2, 128);
  cfg.opt.softcap = 20.0f;
  cfg.alibi = Alibi::per_batch_head;
  cfg.opt.causal = true;
  expect_matches(cfg);
  cfg = sink_config(GetParam(), 1, 128, 128, 2, 2, 64);
  cfg.opt.dropout_p = 0.15f;
  cfg.opt.dropout_seed = 42;
  expect_matches(cfg);
  cfg = sink_config(GetParam(), 0, 0, 0, 4, 2, 64);
  cfg.varlen_q = {70, 0, 1, 130};
  cfg.varlen_k = {90, 33, 0, 100};
  cfg.opt.causal = true;
  expect_matches(cfg);
}

// Split-KV: the partials are sink-free and the combine adds the sink once. 128 splits leave most
// shares empty; sq > sk leaves rows that no split sees (lse = the sink from the combine).
TEST_P(CudaSinks, SplitKvAddsTheSinkOnce) {
  FA_SKIP_WITHOUT_GPU();
  const FamilyOverride family("sm80");
  for (int splits : {3, 128}) {
    for (auto [sq, sk] : {std::pair<int, int>{1, 4000}, {6, 2000}, {300, 200}}) {
      AttnConfig cfg = sink_config(GetParam(), 2, sq, sk, 8, 2, 128);
      cfg.opt.causal = sq > 1;
      const AttnProblem p = make_problem(cfg);
      SCOPED_TRACE(describe(p.cfg) + " splits " + std::to_string(splits));
      const ForwardResult split = run_cuda_forward(p, force_splits(splits), nullptr, /*with_workspace=*/true);
      EXPECT_TRUE(check_forward(p, split));
      EXPECT_TRUE(check_backward(p, split, run_cuda_backward(p, split)));
    }
  }
}

// A sink of −∞ is no sink: bit for bit the sink-free results, unsplit and split, and dsinks = 0.
TEST_P(CudaSinks, MinusInfinityIsNoSink) {
  FA_SKIP_WITHOUT_GPU();
  const FamilyOverride family("sm80");
  AttnConfig cfg = sink_config(GetParam(), 2, 50, 700, 4, 2, 64);
  cfg.opt.causal = true;
  AttnProblem p = make_problem(cfg);
  p.sinks.fill(-kInf);
  const AttnProblem plain = without_sinks(p);
  for (int splits : {1, 4}) {
    SCOPED_TRACE("splits " + std::to_string(splits));
    const ForwardResult a = run_cuda_forward(p, force_splits(splits), nullptr, true);
    const ForwardResult b = run_cuda_forward(plain, force_splits(splits), nullptr, true);
    if (a.not_run || b.not_run) return;
    EXPECT_TRUE(bitwise_equal(a.out, b.out));
    EXPECT_TRUE(bitwise_equal(a.lse, b.lse));
    const BackwardResult ga = run_cuda_backward(p, a);
    if (ga.not_run) return;
    for (int hh = 0; hh < cfg.heads; ++hh) EXPECT_EQ(ga.dsinks.get({hh}), 0.0f);
  }
}

// A NaN sink: its head's lse NaN in every row, out NaN where the row sees keys and 0 where not;
// the other heads finite; its dsinks NaN. Unsplit and split.
TEST_P(CudaSinks, NanSinkStaysInItsHead) {
  FA_SKIP_WITHOUT_GPU();
  const FamilyOverride family("sm80");
  AttnConfig cfg = sink_config(GetParam(), 1, 80, 40, 2, 2, 64);
  cfg.opt.causal = true;  // rows 0..39 see no key
  AttnProblem p = make_problem(cfg);
  p.sinks.set({0}, kNaN);
  for (int splits : {1, 3}) {
    SCOPED_TRACE("splits " + std::to_string(splits));
    const ForwardResult fwd = run_cuda_forward(p, force_splits(splits), nullptr, true);
    if (fwd.not_run) return;
    for (int i = 0; i < 80; ++i) {
      EXPECT_TRUE(std::isnan(fwd.lse.get({0, 0, i}))) << "row " << i;
      EXPECT_FALSE(std::isnan(fwd.lse.get({0, 1, i}))) << "row " << i;
      const float o = fwd.out.get({0, i, 0, 5});
      if (i < 40) {
        EXPECT_EQ(o, 0.0f) << "row " << i;
      } else {
        EXPECT_TRUE(std::isnan(o)) << "row " << i;
      }
      EXPECT_TRUE(std::isfinite(fwd.out.get({0, i, 1, 5}))) << "row " << i;
    }
    const BackwardResult bwd = run_cuda_backward(p, fwd);
    if (bwd.not_run) return;
    EXPECT_TRUE(std::isnan(bwd.dsinks.get({0})));
    EXPECT_TRUE(std::isfinite(bwd.dsinks.get({1})));
  }
}

// A sink far above every score (exp(s_h) alone overflows fp32): finite results, lse ≈ s_h.
TEST_P(CudaSinks, LargeSinkDoesNotOverflow) {
  FA_SKIP_WITHOUT_GPU();
  const FamilyOverride family("sm80");
  AttnProblem p = make_problem(sink_config(GetParam(), 1, 64, 300, 2, 2, 64));
  p.sinks.fill(200.0f);
  for (int splits : {1, 3}) {
    SCOPED_TRACE("splits " + std::to_string(splits));
    const ForwardResult fwd = run_cuda_forward(p, force_splits(splits), nullptr, true);
    EXPECT_TRUE(check_forward(p, fwd));
    if (fwd.not_run) return;
    EXPECT_NEAR(fwd.lse.get({0, 1, 7}), 200.0f, 1e-3f);
    EXPECT_TRUE(check_backward(p, fwd, run_cuda_backward(p, fwd)));
  }
}

// dsinks is a fixed-order reduction: the same bits on every run (deterministic flag or not).
TEST_P(CudaSinks, GradientIsReproducible) {
  FA_SKIP_WITHOUT_GPU();
  AttnConfig cfg = sink_config(GetParam(), 3, 700, 900, 4, 1, 64);
  cfg.opt.causal = true;
  const AttnProblem p = make_problem(cfg);
  const ForwardResult fwd = run_cuda_forward(p);
  const BackwardResult first = run_cuda_backward(p, fwd);
  if (first.not_run) return;
  EXPECT_TRUE(check_backward(p, fwd, first));
  for (int run = 0; run < 3; ++run) {
    EXPECT_TRUE(bitwise_equal(first.dsinks, run_cuda_backward(p, fwd).dsinks)) << "run " << run;
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaSinks, testing::Values(DType::f16, DType::bf16),
                         [](const testing::TestParamInfo<DType>& info) { return std::string(dtype_tag(info.param)); });

// flashattn::forward and ::backward with CUDA tensors, sinks and dsinks included (the ordered
// family choice: sm90 declines sinks, sm80 serves them).
TEST(CudaSinksPublicApi, ForwardAndBackwardOnCudaTensors) {
  FA_SKIP_WITHOUT_GPU();
  const auto backends = flashattn::compiled_backends();
  if (std::find(backends.begin(), backends.end(), Backend::cuda) == backends.end()) {
    GTEST_SKIP() << "NOT RUN: the API layer of this build does not dispatch to the CUDA backend";
  }
  AttnConfig cfg = sink_config(DType::bf16, 2, 100, 150, 4, 2, 128);
  cfg.opt.causal = true;
  const AttnProblem p = make_problem(cfg);
  if (!kernel_built(flashattn::cuda::sm80::Family::fwd, c::Storage::bf16, 128, 128) ||
      !kernel_built(flashattn::cuda::sm80::Family::bwd, c::Storage::bf16, 128, 128)) {
    return;
  }
  DeviceArena dev;
  ForwardResult fwd = make_forward_outputs(p);
  flashattn::ForwardInputs fin;
  fin.q = dev.mirror_view(p.q);
  fin.k = dev.mirror_view(p.k);
  fin.v = dev.mirror_view(p.v);
  fin.sinks = dev.mirror_view(p.sinks);
  const flashattn::ForwardOutputs fout{dev.mirror_view(fwd.out), dev.mirror_view(fwd.lse)};
  flashattn::forward(fin, fout, p.opt);
  FA_CUDA_CHECK(cudaDeviceSynchronize());
  DeviceArena::download(fwd.out, fout.out.data);
  DeviceArena::download(fwd.lse, fout.lse.data);
  EXPECT_TRUE(check_forward(p, fwd));

  BackwardResult bwd = make_backward_outputs(p);
  flashattn::BackwardInputs bin;
  bin.dout = dev.mirror_view(p.dout);
  bin.q = fin.q;
  bin.k = fin.k;
  bin.v = fin.v;
  bin.out = fout.out;
  bin.lse = fout.lse;
  bin.sinks = fin.sinks;
  flashattn::BackwardOutputs bout{dev.mirror_view(bwd.dq), dev.mirror_view(bwd.dk), dev.mirror_view(bwd.dv),
                                  dev.mirror_view(bwd.softmax_d)};
  bout.dsinks = dev.mirror_view(bwd.dsinks);
  const std::size_t need = flashattn::backward_workspace_size(bin, p.opt);
  flashattn::backward(bin, bout, p.opt, {dev.alloc(need), need});
  FA_CUDA_CHECK(cudaDeviceSynchronize());
  DeviceArena::download(bwd.dq, bout.dq.data);
  DeviceArena::download(bwd.dk, bout.dk.data);
  DeviceArena::download(bwd.dv, bout.dv.data);
  DeviceArena::download(bwd.softmax_d, bout.softmax_d.data);
  DeviceArena::download(bwd.dsinks, bout.dsinks.data);
  EXPECT_TRUE(check_backward(p, fwd, bwd));
}

// Host only: the sm90 family names sinks among what it declines, so the ordered choice sends
// such calls to sm80.
TEST(CudaSinksHost, Sm90DeclinesSinks) {
  AttnProblem p = make_problem(sink_config(DType::bf16, 2, 256, 256, 4, 4, 128));
  ForwardResult r = make_forward_outputs(p);
  const flashattn::ForwardOutputs outs{r.out.tv(), r.lse.tv()};
  c::AttentionParams dp = flashattn::detail::validate_forward(p.forward_inputs(), outs, p.opt).params;
  ASSERT_NE(dp.sinks, nullptr);
  const std::string why = flashattn::cuda::sm90::fwd_unsupported(dp, 128);
  EXPECT_NE(why.find("attention sinks"), std::string::npos) << why;
  dp.sinks = nullptr;
  EXPECT_EQ(flashattn::cuda::sm90::fwd_unsupported(dp, 128), "");
}

}  // namespace
}  // namespace fa_test::cuda
