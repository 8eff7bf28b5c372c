// tests/cuda/test_cuda_backward.cpp — the CUDA backward against the fp64 reference by the accuracy
// rule of SPEC §7 (check_backward): the shape grid with the sm80 family forced (so that it stays
// tested on Hopper GPUs; the sm90 family's grid is in test_cuda_sm90_backward.cpp), and, with the
// ordered family choice, every feature: masks, softcap, ALiBi, dropout (the forward's mask, seed
// and offset also from device memory), GQA/MQA, d ≠ dv, varlen with empty sequences, strided
// layouts, fully masked rows, zero lengths, and deterministic mode (bitwise identical runs). Gradients are poisoned before each call and the workspace is
// filled with NaN bytes. The forward that produces out and lse is the CPU flash backend's.
// Without a GPU every test skips and says it was not run.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "cuda_grid.h"
#include "cuda/sm80/sm80_registry.h"
#include "cuda_test_util.h"

namespace fa_test::cuda {
namespace {

using flashattn::DType;

// The CPU forward, then the CUDA backward, checked.
BackwardResult expect_backward_matches(const AttnProblem& p, const std::uint64_t* rng_state = nullptr) {
  const ForwardResult fwd = run_forward(p, Backend::cpu);
  const BackwardResult bwd = run_cuda_backward(p, fwd, rng_state);
  EXPECT_TRUE(check_backward(p, fwd, bwd));
  return bwd;
}

// --- the shape grid (tests/cuda/cuda_grid.h) ---------------------------------------------------

class CudaBackwardGrid : public testing::TestWithParam<GridCase> {};

TEST_P(CudaBackwardGrid, MatchesReference) {
  FA_SKIP_WITHOUT_GPU();
  const AttnConfig cfg = grid_config(GetParam());
  const AttnProblem p = make_problem(cfg);
  SCOPED_TRACE(describe(p.cfg));
  const FamilyOverride family("sm80");  // the sm90 family's grid: test_cuda_sm90_backward.cpp
  expect_backward_matches(p);
}

// The backward's fp64 reference costs more: the largest case is 517 × 517.
INSTANTIATE_TEST_SUITE_P(Grid, CudaBackwardGrid,
                         testing::ValuesIn(grid_cases({{1, 1}, {113, 203}, {239, 1}, {3, 799}, {517, 517}})),
                         grid_name);

// --- features, per dtype ------------------------------------------------------------------------

class CudaBackward : public testing::TestWithParam<DType> {
 protected:
  AttnConfig base(int d, int sq, int sk) const { return feature_config(GetParam(), d, sq, sk); }
  BackwardResult expect_matches(const AttnConfig& cfg) {
    const AttnProblem p = make_problem(cfg);
    SCOPED_TRACE(describe(p.cfg));
    return expect_backward_matches(p);
  }
};

TEST_P(CudaBackward, SlidingWindow) {
  FA_SKIP_WITHOUT_GPU();
  for (const AttnConfig& cfg : window_configs(GetParam())) expect_matches(cfg);
}

TEST_P(CudaBackward, SoftcapAndAlibi) {
  FA_SKIP_WITHOUT_GPU();
  for (int d : {64, 128, 256}) {
    for (bool causal : {false, true}) {
      AttnConfig cfg = base(d, 150, 333);
      cfg.opt.causal = causal;
      cfg.opt.softcap = 3.0f;
      expect_matches(cfg);
      cfg.opt.softcap = 0.0f;
      cfg.alibi = Alibi::per_head;
      expect_matches(cfg);
      cfg.alibi = Alibi::per_batch_head;
      cfg.opt.softcap = 5.0f;
      cfg.opt.window_left = 40;
      expect_matches(cfg);
    }
  }
  // A softmax scale too small to divide the slope by (TileScoreMod's unfolded path).
  AttnConfig cfg = base(64, 100, 140);
  cfg.alibi = Alibi::per_head;
  cfg.opt.softmax_scale = 1e-30f;
  expect_matches(cfg);
}

TEST_P(CudaBackward, Dropout) {
  FA_SKIP_WITHOUT_GPU();
  for (const char* family : families_here()) {  // each family's mask against the reference's
    const FamilyOverride forced(family);
    for (AttnConfig cfg : dropout_configs(GetParam())) {
      // A forced family computes only what it serves: the sm90 backward has d ≤ 128.
      if (std::string(family) == "sm90" && cfg.head_dim > 128) continue;
      expect_matches(cfg);
    }
  }
  // Seed and offset read from device memory (CUDA-graph capture): bit-identical gradients. The
  // comparison is bitwise, so dQ is accumulated in key-block order (deterministic); otherwise the
  // fp32 atomics may add in a different order from run to run.
  AttnConfig cfg = base(128, 97, 130);
  cfg.opt.deterministic = true;
  cfg.opt.dropout_p = 0.3f;
  cfg.opt.dropout_seed = 77;
  cfg.opt.dropout_offset = 12;
  const AttnProblem p = make_problem(cfg);
  const ForwardResult fwd = run_forward(p, Backend::cpu);
  const BackwardResult a = run_cuda_backward(p, fwd);
  AttnProblem p2 = p;
  p2.opt.dropout_seed = 0;
  p2.opt.dropout_offset = 0;
  const std::uint64_t rng_state[2] = {77, 12};
  const BackwardResult b = run_cuda_backward(p2, fwd, rng_state);
  if (a.not_run || b.not_run) return;  // a restricted build (skip recorded)
  EXPECT_TRUE(bitwise_equal(a.dq, b.dq));
  EXPECT_TRUE(bitwise_equal(a.dk, b.dk));
  EXPECT_TRUE(bitwise_equal(a.dv, b.dv));
}

TEST_P(CudaBackward, GqaAndMqa) {
  FA_SKIP_WITHOUT_GPU();
  for (int hk : {1, 2, 8}) {
    AttnConfig cfg = base(128, 200, 260);
    cfg.heads = 16;
    cfg.heads_k = hk;
    cfg.opt.causal = hk == 2;
    expect_matches(cfg);
  }
}

TEST_P(CudaBackward, VarlenWithEmptySequences) {
  FA_SKIP_WITHOUT_GPU();
  for (const AttnConfig& cfg : varlen_configs(GetParam())) expect_matches(cfg);
}

TEST_P(CudaBackward, StridedLayouts) {
  FA_SKIP_WITHOUT_GPU();
  for (const AttnConfig& cfg : strided_configs(GetParam())) expect_matches(cfg);
}

TEST_P(CudaBackward, SpecialCases) {
  FA_SKIP_WITHOUT_GPU();
  {  // no keys: dq = 0, softmax_d = 0
    const BackwardResult r = expect_matches(base(64, 37, 0));
    if (!r.not_run) r.dq.for_each_index([&](const Index& ix) { ASSERT_EQ(r.dq.get(ix), 0.0f); });
  }
  {  // no queries: dk = dv = 0
    const BackwardResult r = expect_matches(base(64, 0, 45));
    if (!r.not_run) r.dk.for_each_index([&](const Index& ix) { ASSERT_EQ(r.dk.get(ix), 0.0f); });
    if (!r.not_run) r.dv.for_each_index([&](const Index& ix) { ASSERT_EQ(r.dv.get(ix), 0.0f); });
  }
  {  // peaky softmax
    AttnConfig cfg = base(128, 257, 513);
    cfg.qk_amplitude = 6.0f;
    expect_matches(cfg);
  }
  {  // explicit scale, d = 8 and d = 200 with dv = 40 (predicated head dims)
    AttnConfig cfg = base(8, 70, 90);
    cfg.opt.softmax_scale = 0.7f;
    expect_matches(cfg);
    cfg.head_dim = 200;
    cfg.head_dim_v = 40;
    expect_matches(cfg);
  }
  {  // causal with sq > sk: rows that see no key have zero gradients, nothing is NaN
    AttnConfig cfg = base(64, 150, 40);
    cfg.opt.causal = true;
    const BackwardResult r = expect_matches(cfg);
    // (A build without the kernel records the case as not run; its outputs are then the poison.)
    for (int b = 0; b < (r.not_run ? 0 : cfg.batch); ++b)
      for (int i = 0; i < 110; ++i)
        for (int h = 0; h < cfg.heads; ++h) {
          ASSERT_EQ(r.softmax_d.get({b, h, i}), 0.0f);
          for (int c = 0; c < cfg.head_dim; ++c) ASSERT_EQ(r.dq.get({b, i, h, c}), 0.0f);
        }
  }
}

// deterministic: runs give bitwise identical gradients (dQ added in key-block order) — again on
// the default stream, on another stream, and two at once on two streams (the CTAs of both
// kernels interleaved) — and they match the reference; also with GQA, where several query heads
// add to the same dK/dV. The
// dense cases in every family this GPU runs (sm90 and sm80 on Hopper), the varlen one in the
// ordered choice. (500 × 700: the fp64 reference of each family's check is most of the time.)
TEST_P(CudaBackward, DeterministicIsBitwiseReproducible) {
  FA_SKIP_WITHOUT_GPU();
  struct Streams {  // non-blocking: the default stream's copies do not wait for them
    cudaStream_t a = nullptr, b = nullptr;
    Streams() {
      FA_CUDA_CHECK(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
      FA_CUDA_CHECK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
    }
    ~Streams() {
      cudaStreamDestroy(a);
      cudaStreamDestroy(b);
    }
  } streams;
  for (const char* family : families_here()) {
    const FamilyOverride forced(family);
    for (bool causal : {false, true}) {
      for (int d : {64, 128, 256}) {
        AttnConfig cfg = base(d, 500, 700);
        cfg.heads = 8;
        cfg.heads_k = 2;
        cfg.opt.causal = causal;
        cfg.opt.deterministic = true;
        const AttnProblem p = make_problem(cfg);
        SCOPED_TRACE(describe(p.cfg) + ", FLASHATTN_CUDA_FAMILY=" + family);
        const ForwardResult fwd = run_forward(p, Backend::cpu);
        const BackwardResult a = run_cuda_backward(p, fwd);
        EXPECT_TRUE(check_backward(p, fwd, a));
        if (a.not_run) continue;  // a restricted build (skip recorded)
        BackwardResult beside;
        const BackwardResult runs[] = {
            run_cuda_backward(p, fwd), run_cuda_backward(p, fwd, nullptr, streams.a),
            run_cuda_backward(p, fwd, nullptr, streams.a, [&] { beside = run_cuda_backward(p, fwd, nullptr, streams.b); }),
            beside};
        for (int run = 0; run < 4; ++run) {
          const BackwardResult& b = runs[run];
          ASSERT_TRUE(bitwise_equal(a.dq, b.dq)) << "run " << run;
          ASSERT_TRUE(bitwise_equal(a.dk, b.dk)) << "run " << run;
          ASSERT_TRUE(bitwise_equal(a.dv, b.dv)) << "run " << run;
        }
      }
    }
  }
  AttnConfig cfg = base(128, 0, 0);  // varlen, window
  cfg.varlen_q = {300, 0, 129};
  cfg.varlen_k = {257, 64, 400};
  cfg.opt.window_left = 70;
  cfg.opt.window_right = 30;
  cfg.opt.deterministic = true;
  expect_matches(cfg);
}

// The configurations of GPUs with less shared memory per block, run here under a cap
// (sm80_bwd.h): on an A100 (163 KiB) d 256 with one stage; on the 99 KiB GPUs (sm86/sm89) d 64 in
// the full variant's 64 × 64 tile and d 128 in it with one stage (also with dropout); d 256 is
// refused there (tests/cuda/test_cuda_registry.cpp).
TEST_P(CudaBackward, SmallSharedMemoryTiles) {
  FA_SKIP_WITHOUT_GPU();
  for (int limit : {kSmemA100, kSmemSm86}) {
    SmemLimitCap cap(limit);
    for (int d : {64, 128, 256}) {
      if (limit == kSmemSm86 && d == 256) continue;
      for (bool causal : {false, true}) {
        AttnConfig cfg = base(d, 177, 301);
        cfg.opt.causal = causal;
        SCOPED_TRACE("shared memory per block capped at " + std::to_string(limit));
        expect_matches(cfg);
      }
    }
    AttnConfig cfg = base(128, 97, 130);
    cfg.opt.dropout_p = 0.2f;
    cfg.opt.dropout_seed = 5;
    expect_matches(cfg);
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaBackward, testing::Values(DType::f16, DType::bf16),
                         [](const testing::TestParamInfo<DType>& info) { return std::string(dtype_tag(info.param)); });

// --- through the public API ---------------------------------------------------------------------

// flashattn::backward with CUDA tensors reaches the CUDA backend with the caller's workspace; a
// workspace smaller than the serving family's need is refused before anything is written.
TEST(CudaPublicApi, BackwardDispatchesToCudaWithWorkspace) {
  FA_SKIP_WITHOUT_GPU();
  const auto backends = flashattn::compiled_backends();
  if (std::find(backends.begin(), backends.end(), Backend::cuda) == backends.end()) {
    GTEST_SKIP() << "NOT RUN: the API layer of this build does not dispatch to the CUDA backend";
  }
  AttnConfig cfg;
  if (!built_dtype(flashattn::cuda::sm80::Family::bwd, 64, &cfg.dtype)) return;
  cfg.batch = 2;
  cfg.seqlen_q = 100;
  cfg.seqlen_k = 150;
  cfg.heads = 4;
  cfg.heads_k = 2;
  cfg.head_dim = 64;
  cfg.opt.causal = true;
  const AttnProblem p = make_problem(cfg);
  const ForwardResult fwd = run_forward(p, Backend::cpu);
  BackwardResult r = make_backward_outputs(p);
  const BackwardResult poisoned = make_backward_outputs(p);
  DeviceArena dev;
  flashattn::BackwardInputs in;
  in.dout = dev.mirror_view(p.dout);
  in.q = dev.mirror_view(p.q);
  in.k = dev.mirror_view(p.k);
  in.v = dev.mirror_view(p.v);
  in.out = dev.mirror_view(fwd.out);
  in.lse = dev.mirror_view(fwd.lse);
  const flashattn::BackwardOutputs out{dev.mirror_view(r.dq), dev.mirror_view(r.dk), dev.mirror_view(r.dv),
                                       dev.mirror_view(r.softmax_d)};
  // The public size covers every family that might serve the call; the one the call takes needs
  // `need` bytes exactly, and one byte fewer is refused before anything is written.
  const std::size_t bound = flashattn::backward_workspace_size(in, p.opt);
  const flashattn::detail::Problem pr = flashattn::detail::validate_backward(in, out, p.opt);
  const std::size_t need = flashattn::cuda::backward_workspace_size(pr.params, std::int64_t(cfg.batch) * p.total_q);
  ASSERT_GT(need, 0u);
  ASSERT_GE(bound, need);
  void* ws = dev.alloc(bound);

  try {
    flashattn::backward(in, out, p.opt, {ws, need - 1});
    ADD_FAILURE() << "a workspace one byte short was accepted";
  } catch (const flashattn::Error& e) {
    EXPECT_NE(std::string(e.what()).find("workspace: too small"), std::string::npos) << e.what();
  }
  FA_CUDA_CHECK(cudaDeviceSynchronize());
  DeviceArena::download(r.dq, out.dq.data);
  DeviceArena::download(r.dk, out.dk.data);
  EXPECT_TRUE(bitwise_equal(r.dq, poisoned.dq)) << "dq was written by a refused call";
  EXPECT_TRUE(bitwise_equal(r.dk, poisoned.dk)) << "dk was written by a refused call";

  // Workspace::grow: asked for that need once when the workspace holds less (a short or
  // misaligned answer refused before anything is written), never when it holds enough.
  GrowRecorder grower;
  grower.give = {ws, need - 1};
  EXPECT_THROW(flashattn::backward(in, out, p.opt, grower.on({})), flashattn::Error);
  grower.give = {static_cast<char*>(ws) + 16, need};
  try {
    flashattn::backward(in, out, p.opt, grower.on({ws, need / 2}));
    ADD_FAILURE() << "a misaligned workspace from grow was accepted";
  } catch (const flashattn::Error& e) {
    EXPECT_NE(std::string(e.what()).find("workspace: grow must return at least " + std::to_string(need)),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(grower.asked, std::vector<std::size_t>({need, need}));
  FA_CUDA_CHECK(cudaDeviceSynchronize());
  DeviceArena::download(r.dq, out.dq.data);
  EXPECT_TRUE(bitwise_equal(r.dq, poisoned.dq)) << "dq was written when grow's workspace was refused";

  flashattn::Options opt = p.opt;
  opt.backend = Backend::cuda;
  Tensor dk_by_size, dv_by_size;
  for (const bool grown : {false, true}) {
    SCOPED_TRACE(grown ? "workspace from grow" : "workspace of the public size");
    grower.asked.clear();
    grower.give = {ws, need};
    flashattn::backward(in, out, opt, grown ? grower.on({}) : grower.on({ws, bound}));
    EXPECT_EQ(grower.asked, grown ? std::vector<std::size_t>({need}) : std::vector<std::size_t>());
    FA_CUDA_CHECK(cudaDeviceSynchronize());
    DeviceArena::download(r.dq, out.dq.data);
    DeviceArena::download(r.dk, out.dk.data);
    DeviceArena::download(r.dv, out.dv.data);
    DeviceArena::download(r.softmax_d, out.softmax_d.data);
    EXPECT_TRUE(check_backward(p, fwd, r));
    if (!grown) {
      dk_by_size = r.dk.clone();
      dv_by_size = r.dv.clone();
    } else {  // (dK and dV have one writer per element: the same bits)
      EXPECT_TRUE(bitwise_equal(r.dk, dk_by_size) && bitwise_equal(r.dv, dv_by_size));
    }
  }
}

// Host only: the public size (shapes, dtype and options of CUDA views) covers what the backend
// asks of the validated call — the largest need of the families with a kernel for it, since
// which one serves depends on layouts the size query does not see — for both dtypes, dense and
// varlen, with and without deterministic counters: a caller who allocates
// backward_workspace_size bytes is never refused.
// The second shape is one varlen sequence of whole row blocks, where the sm90 family's rows (one
// spare row block per sequence and one more) outnumber batch · max_seqlen_q; with the sm90
// family forced its need alone is the bound (unforced, the sm80 family's is mostly larger).
TEST(CudaBackwardWorkspace, PublicSizeCoversTheBackend) {
  struct Shape {
    int d, dv, sq;
    std::vector<int> varlen_q, varlen_k;
  };
  const Shape shapes[] = {{48, 64, 130, {130, 0, 77}, {70, 9, 1}}, {128, 128, 128, {128}, {70}}};
  auto check = [](DType dtype, const Shape& shape, bool varlen, bool deterministic, bool forced) {
    AttnConfig cfg = feature_config(dtype, shape.d, shape.sq, 70);
    cfg.head_dim_v = shape.dv;  // the instantiated head dim follows max(d, dv)
    if (varlen) {
      cfg.varlen_q = shape.varlen_q;
      cfg.varlen_k = shape.varlen_k;
    }
    cfg.opt.deterministic = deterministic;
    const AttnProblem p = make_problem(cfg);
    SCOPED_TRACE(describe(p.cfg));
    const ForwardResult fwd = make_forward_outputs(p);
    const BackwardResult r = make_backward_outputs(p);
    const flashattn::BackwardOutputs outs{r.dq.tv(), r.dk.tv(), r.dv.tv(), r.softmax_d.tv()};
    const flashattn::detail::Problem pr = flashattn::detail::validate_backward(p.backward_inputs(fwd), outs, p.opt);
    const std::int64_t rows = p.is_varlen() ? p.total_q : std::int64_t(cfg.batch) * p.total_q;
    const std::size_t expected = flashattn::cuda::backward_workspace_size(pr.params, rows);
    flashattn::BackwardInputs in = p.backward_inputs(fwd);
    in.q.device = {flashattn::DeviceType::cuda, 0};
    const std::size_t bound = flashattn::backward_workspace_size(in, p.opt);
    EXPECT_GE(bound, expected);
    EXPECT_EQ(bound, flashattn::cuda::backward_workspace_bound(pr.params, rows));
    // (A build that compiles no backward kernel for the dtype and head dim refuses the call
    // anyway, as the forced sm90 family does without an sm90 GPU: then the size is 0.)
    if (!forced && flashattn::cuda::sm80::compiled_head_dim(flashattn::cuda::sm80::Family::bwd, pr.params.storage,
                                                            std::max(shape.d, shape.dv)) != 0) {
      EXPECT_GT(expected, 0u);
    }
  };
  for (bool forced : {false, true}) {  // forced, the bound is the sm90 family's alone
    const FamilyOverride family(forced ? "sm90" : "auto");
    for (DType dtype : {DType::f16, DType::bf16}) {
      for (const Shape& shape : shapes) {
        for (bool varlen : {false, true}) {
          for (bool deterministic : {false, true}) check(dtype, shape, varlen, deterministic, forced);
        }
      }
    }
  }
}

}  // namespace
}  // namespace fa_test::cuda
