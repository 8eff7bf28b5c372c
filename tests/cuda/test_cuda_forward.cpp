// tests/cuda/test_cuda_forward.cpp — the sm80 forward kernel against the fp64 reference by the
// accuracy rule of SPEC §7 (check_forward), over the shape grid and every feature: masks, softcap,
// ALiBi, dropout (its mask compared bit for bit with src/common's definition), varlen with empty
// sequences, paged K/V, cache_batch_idx, strided layouts. Outputs are poisoned before each call.
// Without a GPU every test skips and says it was not run.
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/philox.h"
#include "cuda/sm80/sm80_fwd.h"
#include "cuda/sm80/sm80_registry.h"
#include "cuda_grid.h"
#include "cuda_test_util.h"

namespace fa_test::cuda {
namespace {

namespace c = flashattn::common;
using flashattn::DType;

// --- the shape grid (tests/cuda/cuda_grid.h) ---------------------------------------------------

class CudaForwardGrid : public testing::TestWithParam<GridCase> {};

TEST_P(CudaForwardGrid, MatchesReference) {
  FA_SKIP_WITHOUT_GPU();
  const AttnConfig cfg = grid_config(GetParam());
  const AttnProblem p = make_problem(cfg);
  SCOPED_TRACE(describe(p.cfg));
  const ForwardResult r = run_cuda_forward(p);
  EXPECT_TRUE(check_forward(p, r));
}

INSTANTIATE_TEST_SUITE_P(Grid, CudaForwardGrid,
                         testing::ValuesIn(grid_cases({{1, 1}, {113, 203}, {239, 1}, {799, 3}, {1023, 1024}})),
                         grid_name);

// --- features, per dtype ------------------------------------------------------------------------

class CudaForward : public testing::TestWithParam<DType> {
 protected:
  AttnConfig base(int d, int sq, int sk) const { return feature_config(GetParam(), d, sq, sk); }
  void expect_matches(const AttnConfig& cfg, const ParamsHook& hook = {}) {
    const AttnProblem p = make_problem(cfg);
    SCOPED_TRACE(describe(p.cfg));
    const ForwardResult r = run_cuda_forward(p, hook);
    EXPECT_TRUE(check_forward(p, r));
  }
};

TEST_P(CudaForward, SlidingWindow) {
  FA_SKIP_WITHOUT_GPU();
  for (const AttnConfig& cfg : window_configs(GetParam())) expect_matches(cfg);
}

TEST_P(CudaForward, Softcap) {
  FA_SKIP_WITHOUT_GPU();
  for (const AttnConfig& cfg : softcap_configs(GetParam())) expect_matches(cfg);
}

TEST_P(CudaForward, Alibi) {
  FA_SKIP_WITHOUT_GPU();
  for (int d : {64, 128}) {
    for (Alibi a : {Alibi::per_head, Alibi::per_batch_head}) {
      for (bool causal : {false, true}) {
        AttnConfig cfg = base(d, 300, 129);
        cfg.alibi = a;
        cfg.opt.causal = causal;
        expect_matches(cfg);
      }
    }
  }
  AttnConfig cfg = base(256, 65, 257);
  cfg.alibi = Alibi::per_head;
  cfg.opt.softcap = 5.0f;
  cfg.opt.window_left = 40;
  expect_matches(cfg);
  // A softmax scale too small to divide the slope by: the kernel keeps it on the dot product
  // (TileScoreMod's unfolded path); the scores are then ALiBi's alone.
  cfg = base(64, 100, 140);
  cfg.alibi = Alibi::per_batch_head;
  cfg.opt.softmax_scale = 1e-30f;
  expect_matches(cfg);
}

TEST_P(CudaForward, DropoutMatchesReference) {
  FA_SKIP_WITHOUT_GPU();
  for (const AttnConfig& cfg : dropout_configs(GetParam())) expect_matches(cfg);
}

// With v the identity (sk == dv), out[i, j] = keep_ij · p_ij / (1 − p): the kept set is exactly
// the non-zero outputs, compared bit for bit with src/common's dropout_keep — the function the
// CPU backends use. Also: seed/offset read from device memory give the same result. Once per
// kernel family this GPU runs.
TEST_P(CudaForward, DropoutMaskIsBitExact) {
  FA_SKIP_WITHOUT_GPU();
  for (const char* family : families_here()) {
    SCOPED_TRACE(std::string("FLASHATTN_CUDA_FAMILY=") + family);
    const FamilyOverride forced(family);
    for (int n : {64, 128, 256}) {
      AttnConfig cfg = base(n, 100, n);
      cfg.heads = 4;
      cfg.heads_k = 1;
      cfg.qk_amplitude = 0.5f;  // p_ij ≈ 1/n: far from underflow in either dtype
      cfg.opt.dropout_p = 0.3f;
      cfg.opt.dropout_seed = 0xfeedface12345678ull;
      cfg.opt.dropout_offset = 1000;
      AttnProblem p = make_problem(cfg);
      p.v.for_each_index([&](const Index& ix) { p.v.set(ix, ix[1] == ix[3] ? 1.0f : 0.0f); });
      SCOPED_TRACE(describe(p.cfg));
      const ForwardResult r = run_cuda_forward(p);
      EXPECT_TRUE(check_forward(p, r));
      if (r.not_run) continue;  // a restricted build (skip recorded)

      c::DropoutParams dp;
      dp.seed = cfg.opt.dropout_seed;
      dp.offset = cfg.opt.dropout_offset;
      dp.keep_threshold = c::dropout_keep_threshold(cfg.opt.dropout_p);
      std::int64_t mismatches = 0, kept = 0, total = 0;
      for (int b = 0; b < cfg.batch; ++b) {
        for (int h = 0; h < cfg.heads; ++h) {
          const std::uint64_t stream = std::uint64_t(b) * cfg.heads + h;
          for (int i = 0; i < cfg.seqlen_q; ++i) {
            for (int j = 0; j < n; ++j) {
              const bool gpu_kept = r.out.get({b, i, h, j}) != 0.0f;
              const bool keep = c::dropout_keep(dp, stream, i, j);
              mismatches += gpu_kept != keep;
              kept += keep;
              ++total;
            }
          }
        }
      }
      EXPECT_EQ(mismatches, 0) << "of " << total << " elements";
      EXPECT_NEAR(double(kept) / double(total), 0.7, 0.02);

      // The same seed and offset from device memory (CUDA-graph capture), the values in the
      // options zeroed: bit-identical output.
      const std::uint64_t rng_state[2] = {cfg.opt.dropout_seed, cfg.opt.dropout_offset};
      AttnProblem p2 = p;
      p2.opt.dropout_seed = 0;
      p2.opt.dropout_offset = 0;
      const ForwardResult r2 = run_cuda_forward(p2, {}, rng_state);
      EXPECT_TRUE(bitwise_equal(r.out, r2.out));
      EXPECT_TRUE(bitwise_equal(r.lse, r2.lse));
    }
  }
}

TEST_P(CudaForward, VarlenWithEmptySequences) {
  FA_SKIP_WITHOUT_GPU();
  for (const AttnConfig& cfg : varlen_configs(GetParam())) expect_matches(cfg);
}

TEST_P(CudaForward, StridedLayouts) {
  FA_SKIP_WITHOUT_GPU();
  for (const AttnConfig& cfg : strided_configs(GetParam())) expect_matches(cfg);
  AttnConfig cfg = base(64, 0, 0);
  cfg.varlen_q = {31, 0, 77};
  cfg.varlen_k = {31, 0, 77};
  cfg.heads_k = cfg.heads;
  cfg.layout = Layout::packed_qkv;
  expect_matches(cfg);
}

TEST_P(CudaForward, SpecialCases) {
  FA_SKIP_WITHOUT_GPU();
  {  // no keys at all: out 0, lse +inf
    AttnConfig cfg = base(64, 37, 0);
    expect_matches(cfg);
  }
  {  // lse not asked for
    AttnConfig cfg = base(128, 129, 65);
    cfg.opt.return_lse = false;
    expect_matches(cfg);
  }
  {  // peaky softmax: large scores stress the running max and its rescaling
    AttnConfig cfg = base(128, 257, 513);
    cfg.qk_amplitude = 6.0f;
    expect_matches(cfg);
  }
  {  // explicit scale, d = 8 and d = 200 (predicated head dims), dv != d
    AttnConfig cfg = base(8, 70, 90);
    cfg.opt.softmax_scale = 0.7f;
    expect_matches(cfg);
    cfg.head_dim = 200;
    cfg.head_dim_v = 40;
    expect_matches(cfg);
  }
}

// Paged K/V: pages of `page` rows, shuffled, a poisoned spare page; a key tile spans pages and
// the last page of each sequence is partly filled (the rest poisoned, never to be read).
// sq, heads, heads_k: the query shape (GQA packing runs for short queries); extra: a further hook.
void expect_paged_matches(DType dtype, int page, bool causal, int d, int sq = 113, int heads = 4, int heads_k = 2,
                          const ParamsHook& extra = {}) {
  AttnConfig cfg;
  cfg.dtype = dtype;
  cfg.head_dim = d;
  cfg.batch = 3;
  cfg.seqlen_q = sq;
  cfg.seqlen_k = 203;
  cfg.heads = heads;
  cfg.heads_k = heads_k;
  cfg.opt.causal = causal;
  const AttnProblem p = make_problem(cfg);
  SCOPED_TRACE(describe(p.cfg) + " page " + std::to_string(page));
  const int hk = cfg.heads_k, sk = cfg.seqlen_k;
  const int pages_per_seq = (sk + page - 1) / page;
  const int num_pages = cfg.batch * pages_per_seq + 1;
  std::vector<std::int32_t> table(std::size_t(cfg.batch) * pages_per_seq);
  std::vector<std::int32_t> perm(static_cast<std::size_t>(num_pages));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937_64(test_seed(std::uint64_t(page))));
  std::copy(perm.begin(), perm.begin() + std::ptrdiff_t(table.size()), table.begin());

  auto paged_copy = [&](const Tensor& src, int width) {
    Tensor cache(dtype, {num_pages, page, hk, width});  // poisoned
    for (int b = 0; b < cfg.batch; ++b)
      for (int j = 0; j < sk; ++j)
        for (int h = 0; h < hk; ++h)
          for (int x = 0; x < width; ++x) {
            const int pg = table[std::size_t(b) * pages_per_seq + j / page];
            cache.set({pg, j % page, h, x}, src.get({b, j, h, x}));
          }
    return cache;
  };
  const Tensor k_cache = paged_copy(p.k, d), v_cache = paged_copy(p.v, d);
  const ForwardResult r = run_cuda_forward(p, [&](c::AttentionParams& dp, DeviceArena& dev) {
    dp.k.data = dev.mirror(k_cache);
    dp.v.data = dev.mirror(v_cache);
    for (auto [t, tensor] : {std::pair{&dp.k, &k_cache}, std::pair{&dp.v, &v_cache}}) {
      t->batch_stride = tensor->stride()[0];
      t->row_stride = tensor->stride()[1];
      t->head_stride = tensor->stride()[2];
    }
    dp.block_table = dev.upload_vector(table);
    dp.block_table_batch_stride = pages_per_seq;
    dp.page_size = page;
    if (extra) extra(dp, dev);
  });
  EXPECT_TRUE(check_forward(p, r));
}

TEST_P(CudaForward, PagedKV) {
  FA_SKIP_WITHOUT_GPU();
  for (int page : {16, 64})
    for (bool causal : {false, true})
      for (int d : {64, 128}) expect_paged_matches(GetParam(), page, causal, d);
  expect_paged_matches(GetParam(), 16, true, 256);
}

// cache_batch_idx: sequence b reads K/V row idx[b] of a larger, otherwise poisoned cache.
TEST_P(CudaForward, CacheBatchIdx) {
  FA_SKIP_WITHOUT_GPU();
  AttnConfig cfg = base(128, 57, 190);
  cfg.batch = 3;
  cfg.opt.causal = true;
  const AttnProblem p = make_problem(cfg);
  SCOPED_TRACE(describe(p.cfg));
  const std::vector<std::int32_t> idx = {4, 0, 2};
  const int cache_rows = 5;
  auto scatter = [&](const Tensor& src) {
    Tensor cache(cfg.dtype, {cache_rows, cfg.seqlen_k, cfg.heads_k, cfg.head_dim});  // poisoned
    src.for_each_index([&](const Index& ix) { cache.set({idx[std::size_t(ix[0])], ix[1], ix[2], ix[3]}, src.get(ix)); });
    return cache;
  };
  const Tensor k_cache = scatter(p.k), v_cache = scatter(p.v);
  const ForwardResult r = run_cuda_forward(p, [&](c::AttentionParams& dp, DeviceArena& dev) {
    dp.k.data = dev.mirror(k_cache);
    dp.v.data = dev.mirror(v_cache);
    for (auto [t, tensor] : {std::pair{&dp.k, &k_cache}, std::pair{&dp.v, &v_cache}}) {
      t->batch_stride = tensor->stride()[0];
      t->row_stride = tensor->stride()[1];
      t->head_stride = tensor->stride()[2];
    }
    dp.cache_batch_idx = dev.upload_vector(idx);
  });
  EXPECT_TRUE(check_forward(p, r));
}

// GQA packing (sm80::fwd_pack): the heads of a group share a row block whose rows are (query row,
// head) pairs when the query is short. Decoding shapes (sq = 1) and short queries whose rows see
// different keys (causal, window), g = 8 and MQA, varlen, paged, and split-KV; the hook checks that
// the packed kernel is what runs.
TEST_P(CudaForward, PackedGqa) {
  FA_SKIP_WITHOUT_GPU();
  const FamilyOverride family("sm80");  // GQA packing is the sm80 family's
  const ParamsHook packed = [](c::AttentionParams& dp, DeviceArena&) {
    EXPECT_EQ(flashattn::cuda::sm80::fwd_pack(dp, 128), dp.heads / dp.heads_k);
  };
  for (int d : {64, 128, 256}) {
    for (int sq : {1, 5, 40}) {
      for (int masking = 0; masking < 3; ++masking) {  // none, causal, causal + left window
        AttnConfig cfg = base(d, sq, 333);
        cfg.heads = 16;
        cfg.heads_k = 2;
        cfg.opt.causal = masking >= 1;
        if (masking == 2) cfg.opt.window_left = 50;
        expect_matches(cfg, packed);
      }
    }
  }
  AttnConfig mqa = base(128, 3, 200);
  mqa.heads = 8;
  mqa.heads_k = 1;
  mqa.opt.causal = true;
  expect_matches(mqa, packed);

  AttnConfig varlen = base(128, 0, 0);
  varlen.heads = 8;
  varlen.heads_k = 2;
  varlen.varlen_q = {1, 0, 7, 33};
  varlen.varlen_k = {100, 5, 0, 250};
  varlen.opt.causal = true;
  expect_matches(varlen, packed);
  varlen.seqused_k = {60, 5, 0, 249};
  expect_matches(varlen, packed);

  expect_paged_matches(GetParam(), 16, false, 128, 1, 8, 2, packed);
  expect_paged_matches(GetParam(), 64, true, 64, 4, 8, 2, packed);

  // Split-KV: the partials of packed rows land at their (query row, head).
  for (int splits : {2, 5}) {
    AttnConfig cfg = base(128, 2, 1000);
    cfg.heads = 8;
    cfg.heads_k = 2;
    cfg.opt.causal = true;
    const AttnProblem p = make_problem(cfg);
    SCOPED_TRACE(describe(p.cfg) + " splits " + std::to_string(splits));
    const ForwardResult r = run_cuda_forward(
        p,
        [&](c::AttentionParams& dp, DeviceArena& dev) {
          dp.num_splits = splits;
          packed(dp, dev);
        },
        nullptr, /*with_workspace=*/true);
    EXPECT_TRUE(check_forward(p, r));
  }
}

// The tiles of GPUs with 99 KiB of shared memory per block (sm86/sm89), run here under a cap: d 256
// takes the full variant's halved key tile (plain, causal, windowed, split-KV), and a GQA-packed
// decoding launch keeps its packed tile; d 64 and d 128 run their usual tiles, which fit.
TEST_P(CudaForward, SmallSharedMemoryTiles) {
  FA_SKIP_WITHOUT_GPU();
  SmemLimitCap cap(kSmemSm86);
  for (int d : {64, 128, 256}) {
    const ParamsHook chosen = [d](c::AttentionParams& dp, DeviceArena&) {
      EXPECT_EQ(flashattn::cuda::sm80::fwd_runs_full(dp, d, flashattn::cuda::sm80::smem_per_block_limit()),
                d == 256 && dp.heads == dp.heads_k);
    };
    for (int masking = 0; masking < 3; ++masking) {  // none, causal, sliding window
      AttnConfig cfg = base(d, 177, 301);
      cfg.heads_k = cfg.heads;
      cfg.opt.causal = masking == 1;
      if (masking == 2) {
        cfg.opt.window_left = 40;
        cfg.opt.window_right = 9;
      }
      expect_matches(cfg, chosen);
    }
    AttnConfig decode = base(d, 1, 700);
    decode.heads = 8;
    decode.heads_k = 2;
    expect_matches(decode, chosen);
  }
  AttnConfig cfg = base(256, 3, 1500);
  cfg.heads_k = cfg.heads;
  cfg.opt.causal = true;
  const AttnProblem p = make_problem(cfg);
  SCOPED_TRACE(describe(p.cfg) + " split-KV");
  const ForwardResult r = run_cuda_forward(
      p, [](c::AttentionParams& dp, DeviceArena&) { dp.num_splits = 3; }, nullptr, /*with_workspace=*/true);
  EXPECT_TRUE(check_forward(p, r));
}

// Rows that see few keys take the short-sequence tile of their head dim where the build has it
// (fwd_tuning's short_keys, sm80_tuning.h), the others the plain tile — both
// against the reference, dense and causal, on either side of the threshold.
TEST_P(CudaForward, ShortSequenceTile) {
  FA_SKIP_WITHOUT_GPU();
  const FamilyOverride family("sm80");  // the sm80 family's tile choice
  namespace sm80 = flashattn::cuda::sm80;
  for (int d : {64, 128, 256}) {
    SCOPED_TRACE("d " + std::to_string(d));
    // Where the build leaves the tile out, the same lengths check that the plain tile serves them.
    const int threshold = sm80::fwd_has_short_tile(d) ? sm80::fwd_short_keys(d) : 2048;
    std::vector<bool> took_short;
    for (bool causal : {false, true}) {
      for (int keys : {threshold / 3, 2 * threshold + 200}) {
        AttnConfig cfg = base(d, 70, keys);
        cfg.heads_k = cfg.heads;
        cfg.opt.causal = causal;
        const ParamsHook chosen = [&took_short, threshold, d](c::AttentionParams& dp, DeviceArena&) {
          const bool short_tile = sm80::fwd_runs_short(dp, d);
          EXPECT_EQ(short_tile, sm80::fwd_has_short_tile(d) && sm80::fwd_keys_per_row(dp) <= threshold);
          took_short.push_back(short_tile);
        };
        expect_matches(cfg, chosen);
      }
    }
    ASSERT_EQ(took_short.size(), 4u);
    // The first case of each mask is short, the second long: with the tile compiled in, both ran.
    for (int i : {0, 2}) EXPECT_EQ(took_short[i], sm80::fwd_has_short_tile(d));
    for (int i : {1, 3}) EXPECT_FALSE(took_short[i]);
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaForward, testing::Values(DType::f16, DType::bf16),
                         [](const testing::TestParamInfo<DType>& info) { return std::string(dtype_tag(info.param)); });

// --- through the public API ---------------------------------------------------------------------

// flashattn::forward with CUDA tensors reaches the CUDA backend (Backend::automatic and ::cuda).
TEST(CudaPublicApi, ForwardDispatchesToCuda) {
  FA_SKIP_WITHOUT_GPU();
  const auto backends = flashattn::compiled_backends();
  if (std::find(backends.begin(), backends.end(), Backend::cuda) == backends.end()) {
    GTEST_SKIP() << "NOT RUN: the API layer of this build does not dispatch to the CUDA backend";
  }
  DType dtype;
  if (!built_dtype(flashattn::cuda::sm80::Family::fwd, 64, &dtype)) return;
  for (Backend backend : {Backend::automatic, Backend::cuda}) {
    AttnConfig cfg;
    cfg.dtype = dtype;
    cfg.batch = 2;
    cfg.seqlen_q = 100;
    cfg.seqlen_k = 150;
    cfg.heads = 4;
    cfg.heads_k = 2;
    cfg.head_dim = 64;
    cfg.opt.causal = true;
    const AttnProblem p = make_problem(cfg);
    SCOPED_TRACE(describe(p.cfg));
    ForwardResult r = make_forward_outputs(p);
    DeviceArena dev;
    auto on_device = [&](const Tensor& t, void* data) {
      flashattn::TensorView v = t.tv();
      v.data = data;
      v.device = {flashattn::DeviceType::cuda, 0};
      return v;
    };
    void* d_out = dev.mirror(r.out);
    void* d_lse = dev.mirror(r.lse);
    flashattn::ForwardInputs in;
    in.q = on_device(p.q, dev.mirror(p.q));
    in.k = on_device(p.k, dev.mirror(p.k));
    in.v = on_device(p.v, dev.mirror(p.v));
    flashattn::Options opt = p.opt;  // check_forward validates the host views with p.opt
    opt.backend = backend;
    flashattn::forward(in, {on_device(r.out, d_out), on_device(r.lse, d_lse)}, opt);
    FA_CUDA_CHECK(cudaDeviceSynchronize());
    DeviceArena::download(r.out, d_out);
    DeviceArena::download(r.lse, d_lse);
    EXPECT_TRUE(check_forward(p, r));
  }
}

// --- what the backend accepts (host only: runs without a GPU) ----------------------------------

TEST(CudaCanServe, ReasonsForRefusal) {
  if (flashattn::cuda::sm80::compiled_head_dim(flashattn::cuda::sm80::Family::fwd, c::Storage::f16, 128) != 128 ||
      flashattn::cuda::sm80::compiled_head_dim(flashattn::cuda::sm80::Family::fwd, c::Storage::f16, 256) != 256) {
    GTEST_SKIP() << "NOT RUN: this build leaves out the f16 forward kernels of d 128 / 256 "
                    "(FLASHATTN_CUDA_HEAD_DIMS, FLASHATTN_CUDA_DTYPES); CudaRegistry tests the refusals";
  }
  c::AttentionParams p;
  p.storage = c::Storage::f16;
  p.batch = 1;
  p.heads = p.heads_k = 1;
  p.head_dim = p.head_dim_v = 128;
  alignas(16) static std::uint16_t buf[64];
  for (c::RowHeadTensor* t : {&p.q, &p.k, &p.v, &p.out}) {
    t->data = buf;
    t->row_stride = 128;
    t->head_stride = 128;
  }
  std::string why;
  EXPECT_TRUE(flashattn::cuda::can_serve_forward(p, &why)) << why;
  p.head_dim = 96;
  p.head_dim_v = 256;
  EXPECT_TRUE(flashattn::cuda::can_serve_forward(p, &why)) << why;
  p.k.row_stride = 132;
  EXPECT_FALSE(flashattn::cuda::can_serve_forward(p, &why));
  EXPECT_NE(why.find("k:"), std::string::npos) << why;
  p.k.row_stride = 128;
  p.storage = c::Storage::f32;
  EXPECT_FALSE(flashattn::cuda::can_serve_forward(p, &why));
  EXPECT_NE(why.find("fp16 or bf16"), std::string::npos) << why;
}

}  // namespace
}  // namespace fa_test::cuda
