// tests/cuda/test_cuda_fault_injection.cpp — bad index values in device memory (issue: "never
// outside the caller's buffers"), through the public API on CUDA tensors. Every output and KV
// cache is the middle of a device buffer whose guard zones hold a poison pattern. Each bad call
// must end in flashattn::Error naming the argument — at once with Options::check_indices, at the
// next CUDA call otherwise, or from flashattn::check_index_errors() — with every guarded byte
// (buffer and guards) unchanged; a valid call in the same process must then match the CPU
// reference. Also on the device: the zero outputs and gradients of varlen rows no sequence covers,
// and combine's NaN propagation. Run these under compute-sanitizer memcheck too (scripts/gpu-check).
#include <cuda_runtime.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "cuda/index_check.h"
#include "cuda_test_util.h"

namespace fa_test::cuda {
namespace {

namespace fa = flashattn;

constexpr fa::Device kCuda0{fa::DeviceType::cuda, 0};
constexpr std::size_t kGuardBytes = 256;  // poisoned bytes before and after every guarded buffer
constexpr unsigned char kPoisonByte = 0xff;
constexpr int kHeadDim = 128;  // the head dim every CUDA build compiles (the dev preset's)

// A device copy of a host tensor (contiguous) in the middle of a poisoned device buffer.
class DeviceGuarded {
 public:
  DeviceGuarded(DeviceArena& dev, const Tensor& host) : host_(host) {
    payload_ = DeviceArena::bytes_of(host);
    auto* base = static_cast<unsigned char*>(dev.alloc(payload_ + 2 * kGuardBytes));
    FA_CUDA_CHECK(cudaMemset(base, kPoisonByte, payload_ + 2 * kGuardBytes));
    FA_CUDA_CHECK(cudaMemcpy(base + kGuardBytes, host.data(), payload_, cudaMemcpyHostToDevice));
    base_ = base;
    view_ = host.tv();
    view_.data = base + kGuardBytes;
    view_.device = kCuda0;
  }
  const fa::TensorView& view() const { return view_; }
  // The whole buffer, guards included.
  std::vector<unsigned char> bytes() const {
    std::vector<unsigned char> b(payload_ + 2 * kGuardBytes);
    FA_CUDA_CHECK(cudaMemcpy(b.data(), base_, b.size(), cudaMemcpyDeviceToHost));
    return b;
  }
  bool guards_intact() const {
    const std::vector<unsigned char> b = bytes();
    for (std::size_t i = 0; i < kGuardBytes; ++i) {
      if (b[i] != kPoisonByte || b[b.size() - 1 - i] != kPoisonByte) return false;
    }
    return true;
  }
  // The device contents, into a copy of the host tensor.
  Tensor download() const {
    Tensor t = host_.clone();
    DeviceArena::download(t, view_.data);
    return t;
  }

 private:
  Tensor host_;
  unsigned char* base_ = nullptr;
  std::size_t payload_ = 0;
  fa::TensorView view_;
};

fa::TensorView device_i32(DeviceArena& dev, const std::vector<std::int32_t>& values, Shape shape) {
  const Tensor host = Tensor::from_i32(values);
  fa::TensorView v = host.tv();
  v.ndim = int(shape.size());
  std::int64_t stride = 1;
  for (int i = v.ndim - 1; i >= 0; --i) {
    v.shape[i] = shape[std::size_t(i)];
    v.stride[i] = stride;
    stride *= shape[std::size_t(i)];
  }
  v.data = dev.upload(values.data(), values.size() * sizeof(std::int32_t));
  v.device = kCuda0;
  return v;
}

// Throws flashattn::Error naming `arg`?
testing::AssertionResult throws_naming(const std::function<void()>& call, const std::string& arg) {
  try {
    call();
  } catch (const fa::Error& e) {
    if (std::string(e.what()).find(": " + arg + ": ") == std::string::npos) {
      return testing::AssertionFailure() << "the message does not name " << arg << ": " << e.what();
    }
    return testing::AssertionSuccess() << e.what();
  }
  return testing::AssertionFailure() << "no flashattn::Error naming " << arg;
}

// --- KV cache -----------------------------------------------------------------------------------

// forward_kvcache of 2 sequences, one new key each, on a bf16 cache: 3 rows of 32 keys picked by
// cache_batch_idx, or paged (6 pages of 16 keys, 2 per sequence).
struct KVCall {
  static constexpr std::int64_t kB = 2, kH = 2, kNew = 1, kRows = 3, kCap = 32, kPage = 16, kPages = 6;
  bool paged;
  DeviceArena dev;
  Tensor q{DType::bf16, {kB, 1, kH, kHeadDim}}, k_new{DType::bf16, {kB, kNew, kH, kHeadDim}};
  Tensor v_new{DType::bf16, {kB, kNew, kH, kHeadDim}};
  Tensor cos{DType::bf16, {kCap, kHeadDim / 2}}, sin{DType::bf16, {kCap, kHeadDim / 2}};  // rotary tables
  Tensor k_host, v_host, out_host{DType::bf16, {kB, 1, kH, kHeadDim}}, lse_host{DType::f32, {kB, kH, 1}};
  std::unique_ptr<DeviceGuarded> k_cache, v_cache, out, lse;
  std::vector<unsigned char> workspace_bytes;

  explicit KVCall(bool paged_cache) : paged(paged_cache) {
    const Shape cache_shape = paged ? Shape{kPages, kPage, kH, kHeadDim} : Shape{kRows, kCap, kH, kHeadDim};
    k_host = Tensor(DType::bf16, cache_shape);
    v_host = Tensor(DType::bf16, cache_shape);
    std::uint64_t salt = 0;
    for (Tensor* t : {&q, &k_new, &v_new, &k_host, &v_host, &cos, &sin}) t->fill_random(test_seed(++salt));
    k_cache = std::make_unique<DeviceGuarded>(dev, k_host);
    v_cache = std::make_unique<DeviceGuarded>(dev, v_host);
    out = std::make_unique<DeviceGuarded>(dev, out_host);
    lse = std::make_unique<DeviceGuarded>(dev, lse_host);
  }
  struct Args {
    std::vector<std::int32_t> seqlens = {3, 20};
    std::vector<std::int32_t> batch_idx = {2, 0};
    std::vector<std::int32_t> table = {4, 1, 0, 5};
    std::int64_t rotary_rows = 0;  // rows of the rotary tables given (0: no rotary embedding)
    bool new_keys = true;          // k_new / v_new given (without them and rotary, nothing is appended)
    int num_splits = 0;            // Options::num_splits (0: the heuristic's)
  };
  fa::KVCacheInputs inputs(const Args& a, bool on_device) {
    fa::KVCacheInputs in;
    auto place = [&](const Tensor& t) {
      if (!on_device) return t.tv();
      fa::TensorView v = t.tv();
      v.data = dev.mirror(t);
      v.device = kCuda0;
      return v;
    };
    in.q = place(q);
    if (a.new_keys) {
      in.k_new = place(k_new);
      in.v_new = place(v_new);
    }
    if (!on_device) return in;  // the caller sets the host index tensors (and keeps them alive)
    if (a.rotary_rows > 0) {
      for (auto [view, table] : {std::pair{&in.rotary_cos, &cos}, std::pair{&in.rotary_sin, &sin}}) {
        *view = place(*table);
        view->shape[0] = a.rotary_rows;
      }
    }
    in.cache_seqlens = device_i32(dev, a.seqlens, {kB});
    if (paged) {
      in.block_table = device_i32(dev, a.table, {kB, 2});
    } else {
      in.cache_batch_idx = device_i32(dev, a.batch_idx, {kB});
    }
    return in;
  }
  void run_device(const Args& a, bool synchronous) {
    fa::KVCacheInputs in = inputs(a, true);
    in.k_cache = k_cache->view();
    in.v_cache = v_cache->view();
    fa::Options opt;
    opt.check_indices = synchronous;
    opt.num_splits = a.num_splits;
    const std::size_t bytes = fa::forward_kvcache_workspace_size(in, opt);
    void* ws = dev.alloc(bytes);
    fa::forward_kvcache(in, {out->view(), lse->view()}, opt, {ws, bytes});
  }
  std::vector<const DeviceGuarded*> watched() const { return {k_cache.get(), v_cache.get(), out.get(), lse.get()}; }
  std::vector<std::vector<unsigned char>> snapshot() const {
    std::vector<std::vector<unsigned char>> s;
    for (const DeviceGuarded* g : watched()) s.push_back(g->bytes());
    return s;
  }
  // A valid call on the device, against the reference on host copies of the same cache.
  void expect_valid_call_right() {
    const Args valid;
    Tensor k_ref = k_cache->download(), v_ref = v_cache->download();
    Tensor out_ref = out_host.clone(), lse_ref = lse_host.clone();
    fa::KVCacheInputs in = inputs(valid, false);
    const Tensor seqlens = Tensor::from_i32(valid.seqlens), idx = Tensor::from_i32(valid.batch_idx);
    const Tensor table = Tensor::from_i32(valid.table).view(0, {kB, 2}, {2, 1});
    in.cache_seqlens = seqlens.tv();
    if (paged) {
      in.block_table = table.tv();
    } else {
      in.cache_batch_idx = idx.tv();
    }
    in.k_cache = k_ref.tv();
    in.v_cache = v_ref.tv();
    fa::Options ref_opt;
    ref_opt.backend = Backend::cpu_reference;
    fa::forward_kvcache(in, {out_ref.tv(), lse_ref.tv()}, ref_opt);
    ASSERT_NO_THROW(run_device(valid, true));
    EXPECT_TRUE(bitwise_equal(k_cache->download(), k_ref)) << "the append differs from the reference's";
    EXPECT_TRUE(bitwise_equal(v_cache->download(), v_ref));
    const Tensor got = out->download();
    for (std::int64_t e = 0; e < got.numel(); ++e) {
      ASSERT_NEAR(got.load(e), out_ref.load(e), 2e-2) << "out element " << e;  // bf16 output
    }
    for (const DeviceGuarded* g : watched()) EXPECT_TRUE(g->guards_intact());
  }
};

struct KVFault {
  const char* name;
  bool paged;
  std::function<void(KVCall::Args&)> spoil;
  const char* arg;
  bool without_new_keys_too;  // still a violation when nothing is appended
};

const KVFault kKVFaults[] = {
    {"negative_cache_seqlens", false, [](KVCall::Args& a) { a.seqlens = {-1, 20}; }, "cache_seqlens", true},
    {"append_past_capacity", false, [](KVCall::Args& a) { a.seqlens = {3, 32}; }, "cache_seqlens", false},
    {"cache_seqlens_int_max", false, [](KVCall::Args& a) { a.seqlens = {3, 2147483647}; }, "cache_seqlens", true},
    {"cache_batch_idx_past_rows", false, [](KVCall::Args& a) { a.batch_idx = {3, 0}; }, "cache_batch_idx", true},
    {"negative_cache_batch_idx", false, [](KVCall::Args& a) { a.batch_idx = {2, -7}; }, "cache_batch_idx", true},
    {"block_table_past_pages", true, [](KVCall::Args& a) { a.table = {6, 1, 0, 5}; }, "block_table", true},
    {"negative_block_table", true, [](KVCall::Args& a) { a.table = {4, 1, 0, -1}; }, "block_table", true},
    {"paged_append_past_capacity", true, [](KVCall::Args& a) { a.seqlens = {3, 32}; }, "cache_seqlens", false},
    {"rotary_table_shorter_than_the_positions", false, [](KVCall::Args& a) { a.rotary_rows = 6; }, "rotary_cos",
     true},
};

// With check_indices the bad call itself throws; without, it returns and the next CUDA call on
// the device (a valid one) throws the violation instead of running. Each case runs with the check
// as a kernel of its own and folded (FLASHATTN_INDEX_CHECK_FOLD): into the append kernel's
// prologue with new keys (paged calls keep the kernel there), into the sm80 forward's without —
// its split kernel's blocks each checking their own sequence (2 splits), the unsplit kernel's
// every sequence; paged calls, MHA here, then get the check kernel ahead of the forward (only the
// packed split kernel folds it: PagedCheckFoldedIntoTheSplitKernelNamesTheFirstBadEntry).
TEST(CudaFaultInjection, KVCacheBadIndexIsRefusedAndTheNextCallIsRight) {
  FA_SKIP_WITHOUT_GPU();
  if (!kernel_built(fa::cuda::sm80::Family::fwd, fa::common::Storage::bf16, kHeadDim, kHeadDim)) return;
  // The check as a kernel of its own, folded, and folded with the combine after the split kernel
  // launched as its programmatic dependent (FLASHATTN_COMBINE_PDL, the default on sm_90) or not.
  struct Setting {
    const char* fold;
    const char* combine_pdl;
  };
  for (const Setting& setting : {Setting{"0", "0"}, Setting{"1", "0"}, Setting{"1", "1"}}) {
    const char* fold = setting.fold;
    const EnvOverride folding("FLASHATTN_INDEX_CHECK_FOLD", fold);
    const EnvOverride pdl("FLASHATTN_COMBINE_PDL", setting.combine_pdl);
    for (bool new_keys : {true, false}) {
      for (bool synchronous : {true, false}) {
        for (const KVFault& f : kKVFaults) {
          for (int splits : {0, 2}) {
            if (!new_keys && !f.without_new_keys_too) continue;
            if (splits != 0 && new_keys) continue;
            SCOPED_TRACE(std::string(f.name) + (synchronous ? " (check_indices)" : " (reported by the next call)") +
                         (new_keys ? "" : ", no new keys") + (fold[0] == '1' ? ", folded" : "") +
                         (splits != 0 ? ", 2 splits" : "") + (setting.combine_pdl[0] == '1' ? ", combine PDL" : ""));
            KVCall c(f.paged);
            KVCall::Args bad;
            bad.new_keys = new_keys;
            bad.num_splits = splits;
            f.spoil(bad);
            const auto before = c.snapshot();
            if (synchronous) {
              EXPECT_TRUE(throws_naming([&] { c.run_device(bad, true); }, f.arg));
            } else {
              ASSERT_NO_THROW(c.run_device(bad, false));
              FA_CUDA_CHECK(cudaDeviceSynchronize());
              EXPECT_TRUE(throws_naming([&] { c.run_device(KVCall::Args{}, false); }, f.arg));
            }
            EXPECT_TRUE(c.snapshot() == before) << "a guarded buffer changed";
            c.expect_valid_call_right();
          }
        }
      }
    }
  }
}

// Which checks fold into a kernel's prologue: at most kIndexFoldMaxBatch sequences, no block
// table, and not with FLASHATTN_INDEX_CHECK_FOLD=0; with a block table, into the split forward
// only (index_check_foldable_paged), any number of sequences.
TEST(CudaIndexCheckHost, FoldsOnlySmallChecksWithoutBlockTables) {
  const std::int32_t entry = 0;
  fa::common::IndexBounds ib;
  ib.batch = 2;
  ib.cache_seqlens = &entry;
  {
    const EnvOverride unset("FLASHATTN_INDEX_CHECK_FOLD", "");
    EXPECT_TRUE(fa::cuda::index_check_foldable(ib)) << "on by default";
  }
  {
    const EnvOverride off("FLASHATTN_INDEX_CHECK_FOLD", "0");
    EXPECT_FALSE(fa::cuda::index_check_foldable(ib)) << "off when turned off";
  }
  const EnvOverride on("FLASHATTN_INDEX_CHECK_FOLD", "1");
  EXPECT_TRUE(fa::cuda::index_check_foldable(ib));
  ib.batch = fa::cuda::kIndexFoldMaxBatch;
  EXPECT_TRUE(fa::cuda::index_check_foldable(ib));
  ib.batch = fa::cuda::kIndexFoldMaxBatch + 1;
  EXPECT_FALSE(fa::cuda::index_check_foldable(ib));
  ib.batch = 2;
  ib.block_table = &entry;
  EXPECT_FALSE(fa::cuda::index_check_foldable(ib)) << "a paged cache's check is not for every block";
  EXPECT_TRUE(fa::cuda::index_check_foldable_paged(ib)) << "but for the split kernel's, any batch";
  ib.batch = fa::cuda::kIndexFoldMaxBatch + 1;
  EXPECT_TRUE(fa::cuda::index_check_foldable_paged(ib));
  {
    const EnvOverride off("FLASHATTN_INDEX_CHECK_FOLD", "0");
    EXPECT_FALSE(fa::cuda::index_check_foldable_paged(ib)) << "off when turned off";
  }
  ib.batch = 2;
  ib.block_table = nullptr;
  EXPECT_TRUE(fa::cuda::index_check_foldable(ib));
  EXPECT_FALSE(fa::cuda::index_check_foldable_paged(ib)) << "without a block table";
}

// The check kernel over long block tables (a block per sequence, its threads over the pages):
// the first bad entry of the first bad sequence's pages is the one the host's check names, bad
// entries past a sequence's keys are not read, and a table without a bad entry passes.
TEST(CudaIndexCheck, LongBlockTablesReportTheFirstBadEntryAsTheHostDoes) {
  FA_SKIP_WITHOUT_GPU();
  constexpr int kBatch = 3, kPageRows = 16, kPagesPerSeq = 3000;
  constexpr std::int64_t kCachePages = 9000;
  std::vector<std::int32_t> table(std::size_t(kBatch) * kPagesPerSeq);
  for (std::size_t i = 0; i < table.size(); ++i) table[i] = std::int32_t((i * 7919) % kCachePages);
  const std::vector<std::int32_t> seqlens = {kPagesPerSeq * kPageRows, 2000 * kPageRows + 5, 1000 * kPageRows};
  // Sequence 0 clean; sequence 1 bad at 1999 (2001 pages hold its keys: 0 … 2000), 2001 (past
  // them), 1500 and 1800 (the first of these to name: 1500); sequence 2 bad at 2500 (past its keys).
  auto at = [&](int b, int blk) -> std::int32_t& { return table[std::size_t(b) * kPagesPerSeq + std::size_t(blk)]; };
  at(1, 1999) = -1, at(1, 2001) = std::int32_t(kCachePages), at(1, 1800) = std::int32_t(kCachePages) + 3;
  at(1, 1500) = std::int32_t(kCachePages), at(2, 2500) = -7;
  DeviceArena dev;
  const fa::TensorView d_seqlens = device_i32(dev, seqlens, {kBatch});
  fa::common::IndexBounds ib;
  ib.batch = kBatch;
  ib.api = fa::common::IndexApi::forward_kvcache;
  ib.block_table_batch_stride = kPagesPerSeq;
  ib.page_size = kPageRows;
  ib.cache_rows = kCachePages;
  ib.capacity = std::int64_t(kPagesPerSeq) * kPageRows;
  ib.seqlen_q = 1;
  auto device_check = [&](const fa::TensorView& d_table) {
    ib.cache_seqlens = static_cast<const std::int32_t*>(d_seqlens.data);
    ib.block_table = static_cast<const std::int32_t*>(d_table.data);
    fa::cuda::check_indices(ib, nullptr);
    return fa::cuda::take_index_violation(nullptr);
  };
  auto host_check = [&] {
    ib.cache_seqlens = seqlens.data();
    ib.block_table = table.data();
    for (int b = 0; b < kBatch; ++b) {
      if (const auto v = fa::common::check_sequence_indices(ib, b)) return v;
    }
    return fa::common::IndexViolation{};
  };
  const auto expected = host_check();
  ASSERT_TRUE(bool(expected));
  EXPECT_EQ(expected.batch, 1);
  EXPECT_EQ(expected.entry, 1500);
  const auto got = device_check(device_i32(dev, table, {kBatch, kPagesPerSeq}));
  ASSERT_TRUE(bool(got)) << "the device check passed a bad table";
  EXPECT_EQ(got.rule, expected.rule);
  EXPECT_EQ(got.batch, expected.batch);
  EXPECT_EQ(got.entry, expected.entry);
  EXPECT_EQ(got.value, expected.value);
  EXPECT_EQ(got.bound, expected.bound);
  // Sequence 1 repaired but for its page past the keys: nothing left to report.
  at(1, 1999) = 0, at(1, 1800) = 0, at(1, 1500) = 0;
  ASSERT_FALSE(bool(host_check()));
  EXPECT_FALSE(bool(device_check(device_i32(dev, table, {kBatch, kPagesPerSeq}))))
      << "a clean table (bad entries past the keys only)";
}

// The check of a paged KV-cache call folded into the sm80 split forward (GQA 8/2 decoding: the
// packed split kernel, each block checking the entries it reads, a row block's first split those
// of pages outside the mask's visible keys;
// FLASHATTN_INDEX_CHECK_FOLD on, the default) and as a kernel of its own (off), through the public
// API (whichever family the ordered choice takes): long block tables, 16 splits, bad entries spread over one
// sequence's splits — the one named is the first, as the host's check names it, and entries past
// a sequence's keys are not read. Outputs, caches and their guards keep every byte, and the same
// call with the table repaired then matches the reference.
TEST(CudaFaultInjection, PagedCheckFoldedIntoTheSplitKernelNamesTheFirstBadEntry) {
  FA_SKIP_WITHOUT_GPU();
  if (!kernel_built(fa::cuda::sm80::Family::fwd, fa::common::Storage::bf16, kHeadDim, kHeadDim)) return;
  constexpr std::int64_t kB = 3, kH = 8, kHk = 2, kPage = 16, kPagesPerSeq = 600, kCachePages = 1900;
  DeviceArena dev;
  Tensor q(DType::bf16, {kB, 1, kH, kHeadDim}), k_host(DType::bf16, {kCachePages, kPage, kHk, kHeadDim});
  Tensor v_host(DType::bf16, {kCachePages, kPage, kHk, kHeadDim});
  Tensor out_host(DType::bf16, {kB, 1, kH, kHeadDim}), lse_host(DType::f32, {kB, kH, 1});
  q.fill_random(test_seed(1));
  k_host.fill_random(test_seed(2));
  v_host.fill_random(test_seed(3));
  const DeviceGuarded k_cache(dev, k_host), v_cache(dev, v_host), out(dev, out_host), lse(dev, lse_host);
  const std::vector<std::int32_t> seqlens = {kPagesPerSeq * kPage, 500 * kPage + 5, 250 * kPage};
  std::vector<std::int32_t> table(std::size_t(kB * kPagesPerSeq));
  for (std::size_t i = 0; i < table.size(); ++i) table[i] = std::int32_t((i * 7919) % kCachePages);
  const std::vector<std::int32_t> clean = table;
  // Sequence 1 (501 pages hold its keys): bad at 499, 480 and 300 (the first), and at 501 (past
  // its keys); sequence 2 at 400 (past its 250 pages).
  auto at = [&](std::int64_t b, std::int64_t blk) -> std::int32_t& { return table[std::size_t(b * kPagesPerSeq + blk)]; };
  at(1, 499) = -1, at(1, 480) = std::int32_t(kCachePages) + 3, at(1, 300) = std::int32_t(kCachePages);
  at(1, 501) = -5, at(2, 400) = -7;

  fa::KVCacheInputs in;
  in.q = q.tv();
  in.q.data = dev.mirror(q);
  in.q.device = kCuda0;
  in.k_cache = k_cache.view();
  in.v_cache = v_cache.view();
  in.cache_seqlens = device_i32(dev, seqlens, {kB});
  fa::Options opt;
  opt.num_splits = 16;
  auto run = [&](const std::vector<std::int32_t>& t, bool synchronous) {
    in.block_table = device_i32(dev, t, {kB, kPagesPerSeq});
    opt.check_indices = synchronous;
    const std::size_t bytes = fa::forward_kvcache_workspace_size(in, opt);
    fa::forward_kvcache(in, {out.view(), lse.view()}, opt, {dev.alloc(bytes), bytes});
  };
  const std::vector<const DeviceGuarded*> watched = {&k_cache, &v_cache, &out, &lse};
  auto snapshot = [&] {
    std::vector<std::vector<unsigned char>> b;
    for (const DeviceGuarded* g : watched) b.push_back(g->bytes());
    return b;
  };
  // With the check folded and as a kernel of its own: the violation recorded names `batch`'s
  // entry `entry` holding `value`, the synchronous check throws naming block_table, and no
  // watched byte changes.
  auto expect_first_bad_named = [&](const std::vector<std::int32_t>& t, std::int64_t batch, std::int64_t entry,
                                    std::int64_t value) {
    const auto before = snapshot();
    for (const char* fold : {"1", "0"}) {
      SCOPED_TRACE(std::string("FLASHATTN_INDEX_CHECK_FOLD=") + fold);
      const EnvOverride folding("FLASHATTN_INDEX_CHECK_FOLD", fold);
      ASSERT_NO_THROW(run(t, false));
      const fa::common::IndexViolation got = fa::cuda::take_index_violation(nullptr);
      ASSERT_TRUE(bool(got)) << "a bad table passed";
      EXPECT_EQ(got.rule, fa::common::IndexRule::block_table_range);
      EXPECT_EQ(got.batch, batch);
      EXPECT_EQ(got.entry, entry);
      EXPECT_EQ(got.value, value);
      EXPECT_EQ(got.bound, kCachePages);
      EXPECT_TRUE(throws_naming([&] { run(t, true); }, "block_table"));
      EXPECT_TRUE(snapshot() == before) << "a guarded buffer changed";
    }
  };
  expect_first_bad_named(table, 1, 300, kCachePages);
  // Repaired but for the entries past the keys: nothing to report, and the result is right.
  std::vector<std::int32_t> repaired = clean;
  repaired[std::size_t(1 * kPagesPerSeq + 501)] = -5, repaired[std::size_t(2 * kPagesPerSeq + 400)] = -7;
  ASSERT_NO_THROW(run(repaired, true));
  fa::KVCacheInputs ref = in;
  const Tensor seqlens_host = Tensor::from_i32(seqlens);
  const Tensor table_host = Tensor::from_i32(repaired).view(0, {kB, kPagesPerSeq}, {kPagesPerSeq, 1});
  ref.q = q.tv(), ref.k_cache = k_host.tv(), ref.v_cache = v_host.tv();
  ref.cache_seqlens = seqlens_host.tv(), ref.block_table = table_host.tv();
  Tensor out_ref = out_host.clone(), lse_ref = lse_host.clone();
  fa::Options ref_opt;
  ref_opt.backend = Backend::cpu_reference;
  fa::forward_kvcache(ref, {out_ref.tv(), lse_ref.tv()}, ref_opt);
  const Tensor got = out.download(), got_lse = lse.download();
  for (std::int64_t e = 0; e < got.numel(); ++e) ASSERT_NEAR(got.load(e), out_ref.load(e), 2e-2) << "out element " << e;
  for (std::int64_t e = 0; e < got_lse.numel(); ++e) ASSERT_NEAR(got_lse.load(e), lse_ref.load(e), 1e-3) << "lse " << e;
  for (const DeviceGuarded* g : watched) EXPECT_TRUE(g->guards_intact());

  // A sliding window: each sequence's one query row sees its last 201 keys, so no block reads the
  // entries of the pages before them; a bad one there is found all the same and named, and
  // nothing is written.
  std::vector<std::int32_t> windowed = repaired;
  windowed[std::size_t(0 * kPagesPerSeq + 5)] = -3;
  opt.window_left = 200;
  {
    SCOPED_TRACE("window_left 200");
    expect_first_bad_named(windowed, 0, 5, -3);
  }
  for (const DeviceGuarded* g : watched) EXPECT_TRUE(g->guards_intact());
}

TEST(CudaFaultInjection, CheckIndexErrorsWaitsAndThrows) {
  FA_SKIP_WITHOUT_GPU();
  if (!kernel_built(fa::cuda::sm80::Family::fwd, fa::common::Storage::bf16, kHeadDim, kHeadDim)) return;
  KVCall c(true);
  KVCall::Args bad;
  bad.table = {4, 1, 0, 9};
  ASSERT_NO_THROW(c.run_device(bad, false));
  EXPECT_TRUE(throws_naming([] { fa::check_index_errors(); }, "block_table"));
  EXPECT_NO_THROW(fa::check_index_errors()) << "the violation is reported once";
  c.expect_valid_call_right();
}

// --- varlen -------------------------------------------------------------------------------------

struct VarlenCall {
  static constexpr std::int64_t kTotal = 40, kH = 2;
  DeviceArena dev;
  Tensor q{DType::bf16, {kTotal, kH, kHeadDim}}, k{DType::bf16, {kTotal, kH, kHeadDim}};
  Tensor v{DType::bf16, {kTotal, kH, kHeadDim}}, dout{DType::bf16, {kTotal, kH, kHeadDim}};
  Tensor out_host{DType::bf16, {kTotal, kH, kHeadDim}}, lse_host{DType::f32, {kH, kTotal}};
  std::unique_ptr<DeviceGuarded> out, lse, dq, dk, dv, softmax_d;
  fa::TensorView dq_, dk_, dv_;

  VarlenCall() {
    std::uint64_t salt = 0;
    for (Tensor* t : {&q, &k, &v, &dout}) t->fill_random(test_seed(++salt));
    out = std::make_unique<DeviceGuarded>(dev, out_host);
    lse = std::make_unique<DeviceGuarded>(dev, lse_host);
    dq = std::make_unique<DeviceGuarded>(dev, out_host);
    dk = std::make_unique<DeviceGuarded>(dev, out_host);
    dv = std::make_unique<DeviceGuarded>(dev, out_host);
    softmax_d = std::make_unique<DeviceGuarded>(dev, lse_host);
  }
  fa::TensorView on_device(const Tensor& t) {
    fa::TensorView view = t.tv();
    view.data = dev.mirror(t);
    view.device = kCuda0;
    return view;
  }
  fa::Varlen varlen(const std::vector<std::int32_t>& cu_q, const std::vector<std::int32_t>& cu_k, int max_q,
                    int max_k) {
    const std::int64_t n = std::int64_t(cu_q.size());
    return {device_i32(dev, cu_q, {n}), device_i32(dev, cu_k, {n}), {}, max_q, max_k};
  }
  void forward(const fa::Varlen& vl, bool synchronous) {
    fa::Options opt;
    opt.check_indices = synchronous;
    fa::forward({on_device(q), on_device(k), on_device(v), vl}, {out->view(), lse->view()}, opt);
  }
  void backward(const fa::Varlen& vl, bool synchronous) {
    fa::Options opt;
    opt.check_indices = synchronous;
    const fa::BackwardInputs in{on_device(dout), on_device(q), on_device(k), on_device(v), out->view(), lse->view(), vl};
    const std::size_t bytes = fa::backward_workspace_size(in, opt);
    fa::backward(in, {dq->view(), dk->view(), dv->view(), softmax_d->view()}, opt, {dev.alloc(bytes), bytes});
  }
  std::vector<std::vector<unsigned char>> snapshot() const {
    std::vector<std::vector<unsigned char>> s;
    for (const auto* g : {out.get(), lse.get(), dq.get(), dk.get(), dv.get(), softmax_d.get()}) s.push_back(g->bytes());
    return s;
  }
};

TEST(CudaFaultInjection, VarlenBadIndexThrowsAndWritesNothing) {
  FA_SKIP_WITHOUT_GPU();
  if (!kernel_built(fa::cuda::sm80::Family::bwd, fa::common::Storage::bf16, kHeadDim, kHeadDim)) return;
  struct Fault {
    const char* name;
    std::vector<std::int32_t> cu_q, cu_k;
    int max_q, max_k;
    const char* arg;
  };
  const Fault faults[] = {
      {"decreasing_cu_seqlens_q", {0, 30, 20}, {0, 10, 40}, 40, 40, "varlen.cu_seqlens_q"},
      {"cu_seqlens_k_past_tokens", {0, 10, 40}, {0, 10, 41}, 40, 40, "varlen.cu_seqlens_k"},
      // Its last sequence is longer than any max_seqlen_k may be: that rule is the first it breaks.
      {"cu_seqlens_k_huge", {0, 10, 40}, {0, 10, 2147483647}, 40, 40, "varlen.max_seqlen_k"},
      {"max_seqlen_k_huge", {0, 10, 40}, {0, 10, 40}, 40, 2147483647, "varlen.max_seqlen_k"},
      {"cu_seqlens_q_not_from_0", {5, 10, 40}, {0, 10, 40}, 40, 40, "varlen.cu_seqlens_q"},
      {"max_seqlen_q_below_a_sequence", {0, 10, 40}, {0, 10, 40}, 29, 40, "varlen.max_seqlen_q"},
  };
  for (bool backward : {false, true}) {
    for (const Fault& f : faults) {
      SCOPED_TRACE(std::string(f.name) + (backward ? " (backward)" : " (forward)"));
      VarlenCall c;
      const auto before = c.snapshot();
      const fa::Varlen bad = c.varlen(f.cu_q, f.cu_k, f.max_q, f.max_k);
      EXPECT_TRUE(throws_naming([&] { backward ? c.backward(bad, true) : c.forward(bad, true); }, f.arg));
      EXPECT_TRUE(c.snapshot() == before) << "a guarded buffer changed";
      // The next calls are right: a forward, then its backward, checked for finite values (the
      // values themselves: tests/cuda/test_cuda_backward.cpp).
      const fa::Varlen good = c.varlen({0, 10, 40}, {0, 10, 40}, 30, 30);
      ASSERT_NO_THROW(c.forward(good, true));
      ASSERT_NO_THROW(c.backward(good, true));
      for (const auto* g : {c.out.get(), c.dq.get(), c.dk.get(), c.dv.get()}) {
        const Tensor t = g->download();
        for (std::int64_t e = 0; e < t.numel(); ++e) ASSERT_TRUE(std::isfinite(t.load(e))) << e;
        EXPECT_TRUE(g->guards_intact());
      }
    }
  }
}

// Rows past cu_seqlens[b]: out = 0 and lse = +∞; dq = dk = dv = 0, softmax_d = 0.
TEST(CudaFaultInjection, VarlenRowsNoSequenceCoversAreZero) {
  FA_SKIP_WITHOUT_GPU();
  if (!kernel_built(fa::cuda::sm80::Family::bwd, fa::common::Storage::bf16, kHeadDim, kHeadDim)) return;
  VarlenCall c;
  const fa::Varlen vl = c.varlen({0, 10, 31}, {0, 12, 35}, 21, 23);
  c.forward(vl, true);
  c.backward(vl, true);
  const Tensor out = c.out->download(), lse = c.lse->download(), dq = c.dq->download();
  const Tensor dk = c.dk->download(), dv = c.dv->download(), sd = c.softmax_d->download();
  for (std::int64_t r = 0; r < VarlenCall::kTotal; ++r) {
    for (std::int64_t h = 0; h < VarlenCall::kH; ++h) {
      SCOPED_TRACE("row " + std::to_string(r) + " head " + std::to_string(h));
      EXPECT_EQ(std::isinf(lse.get({h, r})), r >= 31);
      if (r >= 31) EXPECT_EQ(sd.get({h, r}), 0.0f);
      for (std::int64_t e = 0; e < kHeadDim; ++e) {
        if (r >= 31) {
          ASSERT_EQ(out.get({r, h, e}), 0.0f);
          ASSERT_EQ(dq.get({r, h, e}), 0.0f);
        } else {
          ASSERT_TRUE(std::isfinite(dq.get({r, h, e})));
        }
        if (r >= 35) {
          ASSERT_EQ(dk.get({r, h, e}), 0.0f);
          ASSERT_EQ(dv.get({r, h, e}), 0.0f);
        }
      }
    }
  }
}

// Keys past seqused_k[b] belong to no sequence: their dk and dv are zero (the buffers start
// poisoned, so a row the backward leaves alone fails).
TEST(CudaFaultInjection, VarlenKeysPastSequsedKGetZeroGradients) {
  FA_SKIP_WITHOUT_GPU();
  if (!kernel_built(fa::cuda::sm80::Family::bwd, fa::common::Storage::bf16, kHeadDim, kHeadDim)) return;
  VarlenCall c;
  fa::Varlen vl = c.varlen({0, 10, 31}, {0, 12, 35}, 21, 23);
  vl.seqused_k = device_i32(c.dev, {5, 20}, {2});
  const std::size_t bytes = std::size_t(VarlenCall::kTotal * VarlenCall::kH * kHeadDim) * 2;
  for (auto* g : {c.dk.get(), c.dv.get()}) FA_CUDA_CHECK(cudaMemset(g->view().data, 0x7f, bytes));
  c.forward(vl, true);
  c.backward(vl, true);
  const Tensor dk = c.dk->download(), dv = c.dv->download();
  for (std::int64_t r = 0; r < VarlenCall::kTotal; ++r) {
    const bool used = r < 5 || (r >= 12 && r < 32);
    for (std::int64_t h = 0; h < VarlenCall::kH; ++h) {
      SCOPED_TRACE("key row " + std::to_string(r) + " head " + std::to_string(h));
      for (std::int64_t e = 0; e < kHeadDim; ++e) {
        if (used) {
          ASSERT_TRUE(std::isfinite(dk.get({r, h, e})) && std::isfinite(dv.get({r, h, e})));
        } else {
          ASSERT_EQ(dk.get({r, h, e}), 0.0f);
          ASSERT_EQ(dv.get({r, h, e}), 0.0f);
        }
      }
    }
  }
}

// --- combine ------------------------------------------------------------------------------------

TEST(CudaFaultInjection, CombineSplitWithNanLsePropagates) {
  FA_SKIP_WITHOUT_GPU();
  constexpr std::int64_t kSplits = 3, kSq = 4, kH = 2, kDv = 64;
  DeviceArena dev;
  Tensor op(DType::f32, {kSplits, 1, kSq, kH, kDv}), lp(DType::f32, {kSplits, 1, kH, kSq});
  op.fill_random(test_seed(1));
  lp.fill_random(test_seed(2), -2.0f, 2.0f);
  lp.set({1, 0, 1, 2}, std::numeric_limits<float>::quiet_NaN());
  Tensor out(DType::f32, {1, kSq, kH, kDv}), lse(DType::f32, {1, kH, kSq});
  DeviceGuarded d_out(dev, out), d_lse(dev, lse);
  fa::TensorView d_op = op.tv(), d_lp = lp.tv();
  d_op.data = dev.mirror(op), d_op.device = kCuda0;
  d_lp.data = dev.mirror(lp), d_lp.device = kCuda0;
  fa::combine({d_op, d_lp}, {d_out.view(), d_lse.view()});
  FA_CUDA_CHECK(cudaDeviceSynchronize());
  const Tensor got = d_out.download(), got_lse = d_lse.download();
  for (std::int64_t i = 0; i < kSq; ++i) {
    for (std::int64_t h = 0; h < kH; ++h) {
      const bool nan_row = i == 2 && h == 1;
      EXPECT_EQ(std::isnan(got_lse.get({0, h, i})), nan_row);
      for (std::int64_t e = 0; e < kDv; ++e) ASSERT_EQ(std::isnan(got.get({0, i, h, e})), nan_row);
    }
  }
  EXPECT_TRUE(d_out.guards_intact() && d_lse.guards_intact());
}

}  // namespace
}  // namespace fa_test::cuda

namespace fa_test::cuda {
namespace {

// --- NaN in the inputs (docs/errors.md) ---------------------------------------------------------

// Rows (i, head) of out that hold a NaN, and rows of lse that are NaN, must be the reference's:
// a NaN in q_5 of head 0 reaches row 5 only; a NaN in k_150 of kv head 1 reaches the rows that see
// key 150 under the causal mask (150 and later), not the earlier ones of the same key tiles. With
// and without split-KV (the combine must carry a split's NaN), in the ordered family choice (sm90
// on a Hopper GPU) and in the sm80 family alone.
TEST(CudaNonFinite, ForwardNanRowsMatchTheReference) {
  FA_SKIP_WITHOUT_GPU();
  constexpr int kLen = 200;
  AttnConfig cfg = dense_config(DType::bf16, 1, kLen, kLen, 2, 2, kHeadDim);
  cfg.opt.causal = true;
  AttnProblem p = make_problem(cfg);
  p.q.set({0, 5, 0, 7}, std::numeric_limits<float>::quiet_NaN());
  p.k.set({0, 150, 1, 7}, std::numeric_limits<float>::quiet_NaN());
  const ForwardResult ref = run_forward(p, Backend::cpu_reference);
  for (const auto& [family, splits] : {std::pair{"", 1}, std::pair{"sm80", 1}, std::pair{"sm80", 3}}) {
    SCOPED_TRACE(std::string("family '") + family + "', num_splits " + std::to_string(splits));
    const FamilyOverride only(family);
    const ForwardResult got = run_cuda_forward(
        p, [splits](fa::common::AttentionParams& dp, DeviceArena&) { dp.num_splits = splits; }, nullptr, true);
    if (got.not_run) continue;
    for (std::int64_t i = 0; i < kLen; ++i) {
      for (std::int64_t h = 0; h < 2; ++h) {
        bool ref_nan = false, got_nan = false;
        for (std::int64_t e = 0; e < kHeadDim; ++e) {
          ref_nan = ref_nan || std::isnan(ref.out.get({0, i, h, e}));
          got_nan = got_nan || std::isnan(got.out.get({0, i, h, e}));
        }
        EXPECT_EQ(got_nan, ref_nan) << "out row " << i << " head " << h;
        EXPECT_EQ(std::isnan(got.lse.get({0, h, i})), std::isnan(ref.lse.get({0, h, i}))) << "lse " << i << ", " << h;
        EXPECT_EQ(ref_nan, (h == 0 && i == 5) || (h == 1 && i >= 150)) << "the reference's own NaN rows";
      }
    }
  }
}

}  // namespace
}  // namespace fa_test::cuda
