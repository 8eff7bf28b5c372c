// tests/cpp/test_fault_injection.cpp — bad index values and bad options, on the CPU backends, with
// guard memory: every output and KV cache is the middle of a larger buffer whose guard zones hold
// a poison pattern. After each bad call the call must have thrown flashattn::Error naming the
// argument, the guards and the buffers themselves must be byte-for-byte unchanged, and a valid
// call in the same process must then give the reference's result and still leave the guards
// alone. (The same cases on CUDA tensors are in tests/cuda/test_cuda_fault_injection.cpp.)
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "test_util.h"

namespace fa_test {
namespace {

namespace fa = flashattn;

constexpr std::int64_t kGuard = 64;  // poisoned elements before and after every guarded tensor

// A contiguous tensor inside a poisoned buffer of kGuard extra elements on each side.
struct Guarded {
  Tensor buffer;  // (kGuard + numel + kGuard), the tensor's dtype, poisoned
  Tensor t;       // the view the call gets

  Guarded(DType dtype, Shape shape) {
    std::int64_t n = 1;
    for (std::int64_t s : shape) n *= s;
    buffer = Tensor(dtype, {kGuard + n + kGuard});
    Strides strides(shape.size());
    std::int64_t step = 1;
    for (std::size_t i = shape.size(); i-- > 0;) {
      strides[i] = step;
      step *= shape[i];
    }
    t = buffer.view(kGuard, shape, strides);
  }
  // Guard elements that no longer hold the poison pattern.
  int guard_writes() const {
    const std::uint32_t poison = poison_bits(buffer.dtype());
    const std::int64_t n = buffer.numel();
    int changed = 0;
    for (std::int64_t e = 0; e < n; ++e) {
      if ((e < kGuard || e >= n - kGuard) && buffer.bits_at(e) != poison) ++changed;
    }
    return changed;
  }
  std::vector<unsigned char> bytes() const {
    const auto* p = static_cast<const unsigned char*>(buffer.data());
    return std::vector<unsigned char>(p, p + std::size_t(buffer.numel()) * fa::dtype_size(buffer.dtype()));
  }
};

// Runs `call`, which must throw flashattn::Error whose message names `arg`, and leave every
// guarded buffer (tensor and guards) unchanged.
void expect_refused(const std::function<void()>& call, const std::vector<const Guarded*>& watched,
                    const std::string& arg) {
  std::vector<std::vector<unsigned char>> before;
  for (const Guarded* g : watched) before.push_back(g->bytes());
  try {
    call();
    ADD_FAILURE() << "accepted; expected flashattn::Error naming " << arg;
  } catch (const fa::Error& e) {
    EXPECT_NE(std::string(e.what()).find(": " + arg + ": "), std::string::npos) << e.what();
  }
  for (std::size_t i = 0; i < watched.size(); ++i) {
    EXPECT_TRUE(watched[i]->bytes() == before[i]) << "guarded buffer #" << i << " changed";
  }
}

// --- varlen -------------------------------------------------------------------------------------

struct VarlenCall {
  static constexpr std::int64_t kTotal = 24, kH = 2, kD = 16;
  Tensor q{DType::f16, {kTotal, kH, kD}}, k{DType::f16, {kTotal, kH, kD}}, v{DType::f16, {kTotal, kH, kD}};
  Guarded out{DType::f16, {kTotal, kH, kD}}, lse{DType::f32, {kH, kTotal}};
  VarlenCall() {
    q.fill_random(test_seed(1));
    k.fill_random(test_seed(2));
    v.fill_random(test_seed(3));
  }
  void run(const std::vector<std::int32_t>& cu_q, const std::vector<std::int32_t>& cu_k,
           const std::vector<std::int32_t>& used, int max_q, int max_k, Backend backend) {
    const Tensor cq = Tensor::from_i32(cu_q), ck = Tensor::from_i32(cu_k);
    const Tensor su = used.empty() ? Tensor() : Tensor::from_i32(used);
    fa::Varlen vl{cq.tv(), ck.tv(), su.defined() ? su.tv() : fa::TensorView{}, max_q, max_k};
    fa::Options opt;
    opt.backend = backend;
    opt.num_threads = 2;
    fa::forward({q.tv(), k.tv(), v.tv(), vl}, {out.t.tv(), lse.t.tv()}, opt);
  }
  // A valid call after the errors: the CPU backend against the reference, guards untouched.
  void expect_valid_call_right() {
    run({0, 10, 24}, {0, 7, 24}, {}, 14, 17, Backend::cpu);
    const std::vector<float> out_flash = out.t.to_vector(), lse_flash = lse.t.to_vector();
    run({0, 10, 24}, {0, 7, 24}, {}, 14, 17, Backend::cpu_reference);
    const std::vector<float> out_ref = out.t.to_vector(), lse_ref = lse.t.to_vector();
    for (std::size_t e = 0; e < out_ref.size(); ++e) {
      ASSERT_NEAR(out_flash[e], out_ref[e], 4e-3) << "out element " << e;  // two f16 roundings
    }
    for (std::size_t e = 0; e < lse_ref.size(); ++e) ASSERT_NEAR(lse_flash[e], lse_ref[e], 1e-4) << "lse " << e;
    EXPECT_EQ(out.guard_writes(), 0);
    EXPECT_EQ(lse.guard_writes(), 0);
  }
};

struct VarlenFault {
  const char* name;
  std::vector<std::int32_t> cu_q, cu_k, used;
  int max_q, max_k;
  const char* arg;
};

TEST(FaultInjectionVarlen, BadIndexValuesAreRefusedAndTheNextCallIsRight) {
  const VarlenFault faults[] = {
      {"decreasing cu_seqlens_q", {0, 12, 8}, {0, 7, 24}, {}, 24, 24, "varlen.cu_seqlens_q"},
      {"cu_seqlens_k past the tokens", {0, 10, 24}, {0, 7, 25}, {}, 24, 24, "varlen.cu_seqlens_k"},
      {"cu_seqlens_q not starting at 0", {3, 10, 24}, {0, 7, 24}, {}, 24, 24, "varlen.cu_seqlens_q"},
      {"huge cu_seqlens_k", {0, 10, 24}, {0, 7, 2147483647}, {}, 24, 2147483647, "varlen.cu_seqlens_k"},
      {"seqused_k past its sequence", {0, 10, 24}, {0, 7, 24}, {8, 3}, 14, 17, "varlen.seqused_k"},
      {"negative seqused_k", {0, 10, 24}, {0, 7, 24}, {-1, 3}, 14, 17, "varlen.seqused_k"},
      {"max_seqlen_q below a sequence", {0, 10, 24}, {0, 7, 24}, {}, 13, 17, "varlen.max_seqlen_q"},
  };
  for (Backend backend : {Backend::cpu, Backend::cpu_reference}) {
    VarlenCall c;
    for (const VarlenFault& f : faults) {
      SCOPED_TRACE(std::string(f.name) + " on " + fa::backend_name(backend));
      expect_refused([&] { c.run(f.cu_q, f.cu_k, f.used, f.max_q, f.max_k, backend); }, {&c.out, &c.lse}, f.arg);
      c.expect_valid_call_right();
    }
  }
}

// --- KV cache -----------------------------------------------------------------------------------

struct KVCacheCall {
  static constexpr std::int64_t kB = 2, kH = 2, kD = 16, kPage = 8, kPages = 6, kSq = 1, kNew = 2;
  bool paged;
  std::int64_t rows, capacity;
  Tensor q{DType::f16, {kB, kSq, kH, kD}}, k_new{DType::f16, {kB, kNew, kH, kD}}, v_new{DType::f16, {kB, kNew, kH, kD}};
  Tensor cos{DType::f16, {20, kD / 2}}, sin{DType::f16, {20, kD / 2}};
  Guarded k_cache, v_cache, out{DType::f16, {kB, kSq, kH, kD}}, lse{DType::f32, {kB, kH, kSq}};

  explicit KVCacheCall(bool paged_cache)
      : paged(paged_cache),
        rows(paged_cache ? kPages : 3),
        capacity(paged_cache ? 2 * kPage : 24),
        k_cache(DType::f16, {rows, paged_cache ? kPage : 24, kH, kD}),
        v_cache(DType::f16, {rows, paged_cache ? kPage : 24, kH, kD}) {
    q.fill_random(test_seed(1));
    k_new.fill_random(test_seed(2));
    v_new.fill_random(test_seed(3));
    cos.fill_random(test_seed(4));
    sin.fill_random(test_seed(5));
    k_cache.t.fill_random(test_seed(6));
    v_cache.t.fill_random(test_seed(7));
  }
  struct Args {
    std::vector<std::int32_t> seqlens = {3, 5};
    std::vector<std::int32_t> batch_idx = {2, 0};    // non-paged only: 3 cache rows, 2 sequences
    std::vector<std::int32_t> table = {4, 1, 0, 5};  // paged: (2, 2)
    bool rotary = false;
    std::int64_t rotary_rows = 20;
    float softcap = 0.0f;
  };
  void run(const Args& a, Backend backend) {
    const Tensor seqlens = Tensor::from_i32(a.seqlens);
    const Tensor idx = paged ? Tensor() : Tensor::from_i32(a.batch_idx);
    Tensor table;
    if (paged) table = Tensor::from_i32(a.table).view(0, {kB, 2}, {2, 1});
    fa::KVCacheInputs in;
    in.q = q.tv();
    in.k_cache = k_cache.t.tv();
    in.v_cache = v_cache.t.tv();
    in.k_new = k_new.tv();
    in.v_new = v_new.tv();
    in.cache_seqlens = seqlens.tv();
    if (idx.defined()) in.cache_batch_idx = idx.tv();
    if (paged) in.block_table = table.tv();
    if (a.rotary) {
      in.rotary_cos = cos.view(0, {a.rotary_rows, kD / 2}, {kD / 2, 1}).tv();
      in.rotary_sin = sin.view(0, {a.rotary_rows, kD / 2}, {kD / 2, 1}).tv();
    }
    fa::Options opt;
    opt.backend = backend;
    opt.num_threads = 2;
    opt.softcap = a.softcap;
    fa::forward_kvcache(in, {out.t.tv(), lse.t.tv()}, opt);
  }
  // A valid call after the errors: the appended rows land in the cache, the output is the
  // reference's, and no guard changed.
  void expect_valid_call_right(const Args& valid) {
    const std::vector<unsigned char> k_before = k_cache.bytes(), v_before = v_cache.bytes();
    run(valid, Backend::cpu_reference);
    const std::vector<float> out_ref = out.t.to_vector();
    const std::vector<unsigned char> k_after_ref = k_cache.bytes(), v_after_ref = v_cache.bytes();
    std::memcpy(k_cache.buffer.data(), k_before.data(), k_before.size());
    std::memcpy(v_cache.buffer.data(), v_before.data(), v_before.size());
    run(valid, Backend::cpu);
    EXPECT_TRUE(k_cache.bytes() == k_after_ref && v_cache.bytes() == v_after_ref) << "the appends differ";
    const std::vector<float> out_flash = out.t.to_vector();
    for (std::size_t e = 0; e < out_ref.size(); ++e) ASSERT_NEAR(out_flash[e], out_ref[e], 4e-3) << "out " << e;
    for (const Guarded* g : {&k_cache, &v_cache, &out, &lse}) EXPECT_EQ(g->guard_writes(), 0);
  }
};

struct KVCacheFault {
  const char* name;
  bool paged;
  std::function<void(KVCacheCall::Args&)> spoil;
  const char* arg;
};

TEST(FaultInjectionKVCache, BadIndexValuesAreRefusedAndTheNextCallIsRight) {
  using Args = KVCacheCall::Args;
  const KVCacheFault faults[] = {
      {"negative cache_seqlens", false, [](Args& a) { a.seqlens = {-1, 5}; }, "cache_seqlens"},
      {"append past the capacity", false, [](Args& a) { a.seqlens = {3, 23}; }, "cache_seqlens"},
      {"cache_seqlens at INT_MAX", false, [](Args& a) { a.seqlens = {3, 2147483647}; }, "cache_seqlens"},
      {"cache_batch_idx past the cache rows", false, [](Args& a) { a.batch_idx = {0, 3}; }, "cache_batch_idx"},
      {"negative cache_batch_idx", false, [](Args& a) { a.batch_idx = {-1, 1}; }, "cache_batch_idx"},
      {"rotary table shorter than the positions", false, [](Args& a) { a.rotary = true, a.rotary_rows = 6; }, "rotary_cos"},
      {"block_table entry past the pages", true, [](Args& a) { a.table = {6, 1, 0, 5}; }, "block_table"},
      {"negative block_table entry", true, [](Args& a) { a.table = {4, 1, -1, 5}; }, "block_table"},
      {"paged append past the capacity", true, [](Args& a) { a.seqlens = {15, 5}; }, "cache_seqlens"},
      {"softcap whose reciprocal overflows", false, [](Args& a) { a.softcap = 1e-40f; }, "options.softcap"},
  };
  for (Backend backend : {Backend::cpu, Backend::cpu_reference}) {
    for (const KVCacheFault& f : faults) {
      SCOPED_TRACE(std::string(f.name) + " on " + fa::backend_name(backend));
      KVCacheCall c(f.paged);
      Args bad;
      f.spoil(bad);
      expect_refused([&] { c.run(bad, backend); }, {&c.k_cache, &c.v_cache, &c.out, &c.lse}, f.arg);
      Args valid;
      valid.rotary = true;
      c.expect_valid_call_right(valid);
    }
  }
}

// A tiny softcap that the rule admits is exact: scores within ±softcap, so the softmax is
// uniform over the visible keys and out is their mean value row.
TEST(FaultInjectionOptions, TinySoftcapGivesTheMeanOfTheVisibleValues) {
  AttnConfig cfg = dense_config(DType::f32, 1, 3, 40, 1, 1, 16);
  cfg.opt.softcap = 1e-30f;
  const AttnProblem p = make_problem(cfg);
  for (Backend backend : {Backend::cpu, Backend::cpu_reference}) {
    const ForwardResult r = run_forward(p, backend, 2);
    for (std::int64_t e = 0; e < 16; ++e) {
      double mean = 0.0;
      for (std::int64_t j = 0; j < 40; ++j) mean += p.v.get({0, j, 0, e}) / 40.0;
      for (std::int64_t i = 0; i < 3; ++i) ASSERT_NEAR(r.out.get({0, i, 0, e}), mean, 1e-5) << fa::backend_name(backend);
    }
    EXPECT_NEAR(r.lse.get({0, 0, 0}), std::log(40.0), 1e-5);
  }
}

}  // namespace
}  // namespace fa_test
