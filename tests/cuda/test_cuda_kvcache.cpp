// tests/cuda/test_cuda_kvcache.cpp — flashattn::forward_kvcache on CUDA tensors with k_new/v_new
// appended in place (contiguous, paged with shuffled pages, cache_batch_idx) and rotary embedding
// (interleaved or not, q at per-row positions under a causal or windowed mask): afterwards the
// cache is bit for bit what the CPU backend makes of the same inputs, and out/lse pass SPEC §7
// against the fp64 reference of attention over that cache, per sequence — once per kernel family
// this GPU runs (sm90 with paged caches only where built with -DFLASHATTN_SM90_FWD_PAGED=1). A workspace that is too
// small (or misaligned) throws and leaves cache and outputs untouched. Without a GPU every test
// that needs one skips and says it was not run.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "common/rotary.h"
#include "cuda/kvcache_append.h"
#include "cuda_test_util.h"
#include "kvcache_test_util.h"

namespace fa_test::cuda {
namespace {

namespace c = flashattn::common;
using flashattn::DType;

enum class MaskKind { none, causal, window };

struct AppendCase {
  DType dtype;
  int d, dv;
  int heads, heads_k;
  CacheKind kind;
  int page;        // rows per page (paged only)
  int sq, sk_new;  // sk_new 0: no k_new/v_new
  int rotary_dim;  // 0: no rotary
  bool interleaved;
  MaskKind mask;
};

std::string case_name(const testing::TestParamInfo<AppendCase>& info) {
  const AppendCase& a = info.param;
  std::string name = std::string(flashattn::dtype_name(a.dtype)) + "_d" + std::to_string(a.d) + "_dv" +
                     std::to_string(a.dv) + "_h" + std::to_string(a.heads) + "hk" + std::to_string(a.heads_k) + "_" +
                     kind_name(a.kind) + (a.kind == CacheKind::paged ? std::to_string(a.page) : "") + "_sq" +
                     std::to_string(a.sq) + "_new" + std::to_string(a.sk_new);
  name += a.rotary_dim == 0 ? "_norotary" : "_rd" + std::to_string(a.rotary_dim) + (a.interleaved ? "i" : "h");
  name += a.mask == MaskKind::causal ? "_causal" : a.mask == MaskKind::window ? "_window" : "_full";
  return name;
}

// One forward_kvcache call on host tensors: a pre-filled, otherwise poisoned cache of 3 sequences
// holding different numbers of keys, the new rows, the rotary tables and the options.
struct KvcacheCall {
  AppendCase ac;
  std::vector<int> cached = {37, 5, 150};  // keys in the cache before the call
  Cache cache;
  Tensor q, k_new, v_new, seqlens, cos, sin;
  flashattn::Options opt;

  explicit KvcacheCall(const AppendCase& a) : ac(a) {
    const int b = int(cached.size());
    const int longest = *std::max_element(cached.begin(), cached.end()) + std::max(a.sq, a.sk_new);
    const int rows = a.kind == CacheKind::paged ? a.page : 1;
    const int capacity = (longest + 9 + rows - 1) / rows * rows;  // a few spare positions
    cache = make_cache(a.kind, a.dtype, b, capacity, a.heads_k, a.d, a.dv, a.page, test_seed(1));
    prefill_cache(cache, cached, test_seed(2), test_seed(3));
    q = Tensor(a.dtype, {b, a.sq, a.heads, a.d});
    q.fill_random(test_seed(4));
    if (a.sk_new > 0) {
      k_new = Tensor(a.dtype, {b, a.sk_new, a.heads_k, a.d});
      v_new = Tensor(a.dtype, {b, a.sk_new, a.heads_k, a.dv});
      k_new.fill_random(test_seed(5));
      v_new.fill_random(test_seed(6));
    }
    if (a.rotary_dim > 0) make_tables(a.dtype, capacity + a.sq, a.rotary_dim, cos, sin);
    seqlens = Tensor::from_i32(std::vector<std::int32_t>(cached.begin(), cached.end()));
    opt.causal = a.mask == MaskKind::causal;
    if (a.mask == MaskKind::window) {
      opt.window_left = 40;
      opt.window_right = 3;
    }
  }
  int batch() const { return int(cached.size()); }

  // The host inputs (CPU backend), with the cache tensors given.
  flashattn::KVCacheInputs host_inputs(const Cache& c) const {
    flashattn::KVCacheInputs in = cache_inputs(c);
    in.q = q.tv();
    if (k_new.defined()) {
      in.k_new = k_new.tv();
      in.v_new = v_new.tv();
    }
    in.cache_seqlens = seqlens.tv();
    if (cos.defined()) {
      in.rotary_cos = cos.tv();
      in.rotary_sin = sin.tv();
    }
    in.rotary_interleaved = ac.interleaved;
    return in;
  }
  ForwardResult make_outputs() const {
    return {Tensor(ac.dtype, {batch(), ac.sq, ac.heads, ac.dv}), Tensor(DType::f32, {batch(), ac.heads, ac.sq})};
  }
};

// The same call on device copies of every tensor, through the public API on a stream of its own.
struct DeviceCall {
  DeviceArena dev;
  flashattn::KVCacheInputs in;
  flashattn::ForwardOutputs outs;
  const KvcacheCall& call;
  const ForwardResult& host_outputs;

  DeviceCall(const KvcacheCall& c, const ForwardResult& outputs) : call(c), host_outputs(outputs) {
    for (auto [dst, src] : {std::pair{&in.q, &c.q}, std::pair{&in.k_cache, &c.cache.k}, std::pair{&in.v_cache, &c.cache.v},
                            std::pair{&in.k_new, &c.k_new}, std::pair{&in.v_new, &c.v_new},
                            std::pair{&in.cache_seqlens, &c.seqlens}, std::pair{&in.rotary_cos, &c.cos},
                            std::pair{&in.rotary_sin, &c.sin}}) {
      *dst = dev.mirror_view(*src);
    }
    if (c.cache.kind == CacheKind::paged) in.block_table = dev.mirror_view(c.cache.block_table);
    if (c.cache.kind == CacheKind::batch_idx) in.cache_batch_idx = dev.mirror_view(c.cache.cache_batch_idx);
    in.rotary_interleaved = c.ac.interleaved;
    outs = {dev.mirror_view(outputs.out), dev.mirror_view(outputs.lse)};
  }
  std::size_t workspace_bytes() const { return flashattn::forward_kvcache_workspace_size(in, call.opt); }
  // forward_kvcache with the given workspace, on a stream of its own; then everything it may have
  // written is copied back into the host call's cache and outputs.
  void run(flashattn::Workspace workspace) {
    cudaStream_t stream = nullptr;
    FA_CUDA_CHECK(cudaStreamCreate(&stream));
    try {
      flashattn::forward_kvcache(in, outs, call.opt, workspace, {stream});
    } catch (...) {
      download();
      cudaStreamDestroy(stream);
      throw;
    }
    FA_CUDA_CHECK(cudaStreamSynchronize(stream));
    FA_CUDA_CHECK(cudaStreamDestroy(stream));
    download();
  }
  void download() {
    FA_CUDA_CHECK(cudaDeviceSynchronize());
    DeviceArena::download(call.cache.k, in.k_cache.data);
    DeviceArena::download(call.cache.v, in.v_cache.data);
    DeviceArena::download(host_outputs.out, outs.out.data);
    DeviceArena::download(host_outputs.lse, outs.lse.data);
  }
};

// Head vector (b, i, hh) of q rotated as every backend does it (common::rotate in fp32, rounded
// to the dtype on the way out), into row (0, i, hh) of dst.
struct QRow {
  const Tensor* src;
  Tensor* dst;
  Index from, to;
  float get(int x) {
    from.back() = x;
    return src->get(from);
  }
  void set(int x, float v) {
    to.back() = x;
    dst->set(to, v);
  }
};
struct TableRow {
  const Tensor* table;
  int position;
  float operator()(int i) const { return table->get({position, i}); }
};

class CudaKvcacheAppend : public testing::TestWithParam<AppendCase> {};

TEST_P(CudaKvcacheAppend, CacheMatchesCpuAndOutputMatchesReference) {
  FA_SKIP_WITHOUT_GPU();
  const AppendCase& ac = GetParam();
  const auto storage = ac.dtype == DType::f16 ? flashattn::common::Storage::f16 : flashattn::common::Storage::bf16;
  if (!kernel_built(flashattn::cuda::sm80::Family::fwd, storage, ac.d, ac.dv)) return;  // skip recorded
  for (const char* family : families_here()) {
    SCOPED_TRACE(std::string("FLASHATTN_CUDA_FAMILY=") + family);
    const FamilyOverride forced(family);
    if (std::string(family) == "sm90" && ac.kind == CacheKind::paged && !sm90_takes_pages(ac.page)) continue;
    const KvcacheCall call(ac);

    // The CPU backend on a deep copy of the cache.
    Cache cpu_cache = call.cache;
    cpu_cache.k = call.cache.k.clone();
    cpu_cache.v = call.cache.v.clone();
    const ForwardResult cpu = call.make_outputs();
    flashattn::Options cpu_opt = call.opt;
    cpu_opt.backend = Backend::cpu;
    flashattn::forward_kvcache(call.host_inputs(cpu_cache), {cpu.out.tv(), cpu.lse.tv()}, cpu_opt);

    const ForwardResult gpu = call.make_outputs();
    DeviceCall dc(call, gpu);
    const std::size_t bytes = dc.workspace_bytes();
    if (ac.sk_new > 0 || ac.rotary_dim > 0) {
      EXPECT_GT(bytes, 0u);
    }
    dc.run({dc.dev.alloc(bytes), bytes});

    // Every element of both caches (poisoned gaps and spare pages included) equals the CPU's.
    EXPECT_TRUE(bitwise_equal(call.cache.k, cpu_cache.k)) << "k cache";
    EXPECT_TRUE(bitwise_equal(call.cache.v, cpu_cache.v)) << "v cache";

    const bool per_row = ac.mask != MaskKind::none;
    for (int b = 0; b < call.batch(); ++b) {
      SCOPED_TRACE("sequence " + std::to_string(b));
      const int cs = call.cached[std::size_t(b)];
      AttnProblem p = sequence_problem(call.cache, b, cs + ac.sk_new, ac.sq, ac.heads, call.opt);
      if (ac.rotary_dim > 0) {
        for (int i = 0; i < ac.sq; ++i) {
          const int position = cs + (per_row ? i : 0);
          for (int hh = 0; hh < ac.heads; ++hh) {
            QRow row{&call.q, &p.q, {b, i, hh, 0}, {0, i, hh, 0}};
            c::rotate(row, TableRow{&call.cos, position}, TableRow{&call.sin, position}, ac.rotary_dim, ac.interleaved);
            for (int x = ac.rotary_dim; x < ac.d; ++x) row.set(x, row.get(x));
          }
        }
      } else {
        call.q.for_each_index([&](const Index& ix) {
          if (ix[0] == b) p.q.set({0, ix[1], ix[2], ix[3]}, call.q.get(ix));
        });
      }
      EXPECT_TRUE(check_forward(p, sequence_outputs(p, gpu.out, gpu.lse, b)));
    }
  }
}

// The grid: every cache layout (contiguous, pages of 16, 256, 48, 1 and 10 rows, cache_batch_idx), rotary
// halves / interleaved / none, q positions shared (no mask) or per row (causal, window), MHA / GQA
// / MQA, f16 and bf16, d 64, 96, 128 (d ≠ dv once), decoding (sq = 1) and chunks crossing pages.
const AppendCase kCases[] = {
    {DType::f16, 64, 64, 4, 4, CacheKind::contiguous, 0, 1, 1, 64, false, MaskKind::causal},
    {DType::bf16, 64, 64, 8, 2, CacheKind::paged, 16, 20, 20, 32, true, MaskKind::causal},
    {DType::f16, 128, 128, 8, 1, CacheKind::paged, 256, 1, 1, 128, false, MaskKind::none},
    {DType::bf16, 96, 96, 6, 2, CacheKind::paged, 48, 7, 3, 32, true, MaskKind::window},
    {DType::f16, 128, 64, 4, 2, CacheKind::batch_idx, 0, 130, 130, 64, false, MaskKind::causal},
    {DType::bf16, 128, 128, 4, 2, CacheKind::contiguous, 0, 5, 0, 128, true, MaskKind::window},
    {DType::f16, 96, 96, 4, 4, CacheKind::batch_idx, 0, 3, 17, 0, false, MaskKind::causal},
    {DType::bf16, 64, 64, 2, 1, CacheKind::paged, 48, 33, 33, 0, false, MaskKind::none},
    {DType::f16, 96, 96, 8, 2, CacheKind::contiguous, 0, 16, 16, 96, true, MaskKind::causal},
    {DType::bf16, 128, 128, 16, 2, CacheKind::paged, 16, 1, 1, 64, false, MaskKind::window},
    {DType::bf16, 64, 64, 4, 2, CacheKind::batch_idx, 0, 9, 9, 48, true, MaskKind::none},
    {DType::f16, 128, 128, 4, 1, CacheKind::paged, 256, 64, 64, 128, true, MaskKind::causal},
    // Pages of fewer than 16 rows (the sm80 kernels read their entries row by row), decoding and a
    // chunk that crosses many pages.
    {DType::bf16, 128, 128, 8, 2, CacheKind::paged, 1, 1, 1, 64, false, MaskKind::causal},
    {DType::f16, 64, 64, 4, 4, CacheKind::paged, 10, 21, 21, 32, true, MaskKind::causal},
};

INSTANTIATE_TEST_SUITE_P(Grid, CudaKvcacheAppend, testing::ValuesIn(kCases), case_name);

// SPEC §4/§5: a workspace that is missing, one byte short of the KV-cache region or misaligned is
// refused before anything is written: cache and outputs keep their bits. (The split-KV part that
// forward_kvcache_workspace_size adds after the region is optional: with less, the attention runs
// unsplit.)
TEST(CudaKvcacheWorkspace, TooSmallThrowsAndWritesNothing) {
  FA_SKIP_WITHOUT_GPU();
  const KvcacheCall call({DType::bf16, 64, 64, 4, 2, CacheKind::paged, 16, 4, 4, 32, false, MaskKind::causal});
  const Tensor k_before = call.cache.k.clone(), v_before = call.cache.v.clone();
  const ForwardResult outputs = call.make_outputs();
  const ForwardResult poisoned = call.make_outputs();
  DeviceCall dc(call, outputs);
  const std::size_t need = dc.workspace_bytes();
  ASSERT_GT(need, 0u);
  auto* ws = static_cast<std::uint8_t*>(dc.dev.alloc(need + 256));
  const std::size_t region = flashattn::cuda::kvcache_workspace(call.batch(), call.q.numel(), 2, true, true).bytes;
  ASSERT_GE(need, region);
  const flashattn::Workspace bad[] = {{nullptr, 0}, {ws, region - 1}, {ws + 16, need}};
  for (const flashattn::Workspace& w : bad) {
    SCOPED_TRACE("workspace bytes " + std::to_string(w.bytes));
    EXPECT_THROW(dc.run(w), flashattn::Error);
    EXPECT_TRUE(bitwise_equal(call.cache.k, k_before));
    EXPECT_TRUE(bitwise_equal(call.cache.v, v_before));
    EXPECT_TRUE(bitwise_equal(outputs.out, poisoned.out));
    EXPECT_TRUE(bitwise_equal(outputs.lse, poisoned.lse));
  }
}

// Workspace::grow: a call with no workspace asks it once, after validation, for at least the
// KV-cache region, and then computes what a call with the public size computes — caches and
// outputs bit for bit; a call whose workspace holds the need never asks; a short answer is
// refused with caches and outputs untouched.
TEST(CudaKvcacheWorkspace, GrowGivesTheWorkspace) {
  FA_SKIP_WITHOUT_GPU();
  const AppendCase ac{DType::bf16, 64, 64, 4, 2, CacheKind::paged, 16, 4, 4, 32, false, MaskKind::causal};
  if (!kernel_built(flashattn::cuda::sm80::Family::fwd, flashattn::common::Storage::bf16, 64, 64)) return;
  const KvcacheCall sized(ac), grown(ac);
  const ForwardResult sized_out = sized.make_outputs(), grown_out = grown.make_outputs();
  DeviceCall by_size(sized, sized_out), by_grow(grown, grown_out);
  const std::size_t bytes = by_size.workspace_bytes();
  const std::size_t region = flashattn::cuda::kvcache_workspace(sized.batch(), sized.q.numel(), 2, true, true).bytes;
  ASSERT_GE(bytes, region);
  ASSERT_GT(region, 0u);
  auto* ws = static_cast<std::uint8_t*>(by_grow.dev.alloc(bytes + 256));

  const Tensor k_before = grown.cache.k.clone(), v_before = grown.cache.v.clone();
  const ForwardResult poisoned = grown.make_outputs();
  GrowRecorder grower;
  grower.give = {ws, region - 1};
  EXPECT_THROW(by_grow.run(grower.on({})), flashattn::Error);
  ASSERT_EQ(grower.asked.size(), 1u);
  const std::size_t need = grower.asked[0];
  EXPECT_GE(need, region);
  EXPECT_TRUE(bitwise_equal(grown.cache.k, k_before) && bitwise_equal(grown.cache.v, v_before));
  EXPECT_TRUE(bitwise_equal(grown_out.out, poisoned.out) && bitwise_equal(grown_out.lse, poisoned.lse));

  grower.asked.clear();
  grower.give = {ws, need};
  by_grow.run(grower.on({}));
  EXPECT_EQ(grower.asked, std::vector<std::size_t>({need}));
  by_size.run({by_size.dev.alloc(bytes), bytes});
  EXPECT_TRUE(bitwise_equal(grown.cache.k, sized.cache.k) && bitwise_equal(grown.cache.v, sized.cache.v));
  EXPECT_TRUE(bitwise_equal(grown_out.out, sized_out.out) && bitwise_equal(grown_out.lse, sized_out.lse));

  // Holding the need, the workspace is used as it is (this call appends again: nothing compared).
  grower.asked.clear();
  by_grow.run(grower.on({ws, need}));
  EXPECT_TRUE(grower.asked.empty());
}

// Shapes only (runs without a GPU). The KV-cache region: 256-byte aligned parts for the lengths
// after the append and the rotated q, nothing without append and rotary. The public size: 0 for
// host tensors; for CUDA tensors at least the region more than the same call without append and
// rotary (whatever the attention itself may use comes on top).
TEST(CudaKvcacheWorkspace, SizeCoversTheRegion) {
  const KvcacheCall call({DType::f16, 128, 128, 8, 2, CacheKind::contiguous, 0, 5, 5, 64, false, MaskKind::none});
  const std::size_t q_bytes = std::size_t(call.q.numel()) * 2, seqlens_bytes = call.batch() * sizeof(std::int32_t);
  const auto region = flashattn::cuda::kvcache_workspace(call.batch(), call.q.numel(), 2, true, true);
  for (std::size_t offset : {region.seqlens_after, region.q_rotated, region.bytes}) EXPECT_EQ(offset % 256, 0u);
  EXPECT_GE(region.q_rotated, region.seqlens_after + seqlens_bytes);
  EXPECT_GE(region.bytes, region.q_rotated + q_bytes);
  EXPECT_EQ(flashattn::cuda::kvcache_workspace(call.batch(), call.q.numel(), 2, false, false).bytes, 0u);

  flashattn::KVCacheInputs in = call.host_inputs(call.cache);
  EXPECT_EQ(flashattn::forward_kvcache_workspace_size(in, call.opt), 0u);
  for (flashattn::TensorView* t : {&in.q, &in.k_cache, &in.v_cache, &in.k_new, &in.v_new, &in.cache_seqlens,
                                   &in.rotary_cos, &in.rotary_sin}) {
    t->device = {flashattn::DeviceType::cuda, 0};
  }
  auto size_without = [&](bool append, bool rotary) {
    flashattn::KVCacheInputs v = in;
    if (!append) v.k_new = v.v_new = {};
    if (!rotary) v.rotary_cos = v.rotary_sin = {};
    return flashattn::forward_kvcache_workspace_size(v, call.opt);
  };
  const std::size_t plain = size_without(false, false);
  EXPECT_GE(size_without(true, true), plain + q_bytes + seqlens_bytes);
  EXPECT_GE(size_without(false, true), plain + q_bytes);
  EXPECT_GE(size_without(true, false), plain + seqlens_bytes);
}

}  // namespace
}  // namespace fa_test::cuda
