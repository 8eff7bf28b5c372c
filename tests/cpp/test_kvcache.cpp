// tests/cpp/test_kvcache.cpp — flashattn::forward_kvcache: decoding and chunked prefill into a
// KV cache (contiguous, paged with shuffled pages, or rows picked by cache_batch_idx) give the
// same attention as one causal forward over the whole sequence (SPEC §7 accuracy rule against the
// fp64 oracle of that whole-sequence problem), and the cache holds exactly the appended keys and
// values afterwards — rotated by the documented rotary formula when rotary_cos/sin are given.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kvcache_test_util.h"
#include "test_util.h"

namespace fa_test {
namespace {

// Rows [t0, t0 + n) of a dense (b, s, h, w) tensor, as a view.
Tensor rows_view(const Tensor& t, int t0, int n) {
  return t.view(t.offset({0, t0, 0, 0}), {t.shape(0), n, t.shape(2), t.shape(3)}, t.stride());
}

// --- incremental attention == one whole-sequence forward ---------------------------------------

struct Incremental {
  AttnConfig cfg;           // the whole-sequence problem (seqlen_q == seqlen_k, causal)
  std::vector<int> chunks;  // q rows / new keys per call, summing to the sequence length
  CacheKind kind = CacheKind::contiguous;
  int page_size = 16;
  int extra_capacity = 5;   // cache positions past the sequence (never read)
  Backend backend = Backend::cpu;
};

// Feeds the sequence chunk by chunk through forward_kvcache (appending k_new/v_new at
// cache_seqlens), assembles the outputs, and checks them against the whole-sequence forward's
// oracle; then checks the cache holds exactly k and v, and no other position was written.
void run_incremental(const Incremental& inc) {
  const AttnProblem full = make_problem(inc.cfg);
  SCOPED_TRACE(describe(full.cfg) + " cache=" + kind_name(inc.kind) +
               " page=" + std::to_string(inc.page_size));
  const int b = full.cfg.batch, s = full.cfg.seqlen_q, hk = full.cfg.heads_k;
  const int d = full.cfg.head_dim, dv = full.head_dim_v;
  int capacity = s + inc.extra_capacity;
  if (inc.kind == CacheKind::paged) capacity = (capacity + inc.page_size - 1) / inc.page_size * inc.page_size;
  Cache cache = make_cache(inc.kind, full.cfg.dtype, b, capacity, hk, d, dv, inc.page_size,
                           test_seed(7));

  ForwardResult assembled = make_forward_outputs(full);
  int t0 = 0;
  for (int n : inc.chunks) {
    flashattn::KVCacheInputs in = cache_inputs(cache);
    const Tensor q = rows_view(full.q, t0, n), k_new = rows_view(full.k, t0, n),
                 v_new = rows_view(full.v, t0, n);
    in.q = q.tv();
    in.k_new = k_new.tv();
    in.v_new = v_new.tv();
    const Tensor seqlens = Tensor::from_i32(std::vector<std::int32_t>(std::size_t(b), t0));
    in.cache_seqlens = seqlens.tv();
    Tensor out(full.cfg.dtype, {b, n, full.cfg.heads, dv});
    Tensor lse(DType::f32, {b, full.cfg.heads, n});
    flashattn::Options opt = full.opt;
    opt.backend = inc.backend;
    opt.num_threads = 2;
    flashattn::forward_kvcache(in, {out.tv(), lse.tv()}, opt);
    for (int bb = 0; bb < b; ++bb)
      for (int i = 0; i < n; ++i)
        for (int hh = 0; hh < full.cfg.heads; ++hh) {
          assembled.lse.set({bb, hh, t0 + i}, lse.get({bb, hh, i}));
          for (int c = 0; c < dv; ++c) assembled.out.set({bb, t0 + i, hh, c}, out.get({bb, i, hh, c}));
        }
    t0 += n;
  }
  ASSERT_EQ(t0, s) << "chunks must cover the sequence";
  EXPECT_TRUE(check_forward(full, assembled));

  // The cache now holds k and v at positions [0, s) of each sequence, bit for bit.
  std::int64_t wrong = 0;
  for (int bb = 0; bb < b; ++bb)
    for (int j = 0; j < s; ++j)
      for (int h = 0; h < hk; ++h) {
        const std::int64_t ko = cache.offset(cache.k, bb, j, h), vo = cache.offset(cache.v, bb, j, h);
        for (int c = 0; c < d; ++c) wrong += cache.k.bits_at(ko + c) != full.k.bits_at(full.k.offset({bb, j, h, c}));
        for (int c = 0; c < dv; ++c) wrong += cache.v.bits_at(vo + c) != full.v.bits_at(full.v.offset({bb, j, h, c}));
      }
  EXPECT_EQ(wrong, 0) << "cache elements that differ from the appended k/v";
  // Nothing else was written: count non-poison elements of the whole cache.
  std::int64_t written = 0;
  for (const Tensor* t : {&cache.k, &cache.v})
    t->for_each_index([&](const Index& idx) { written += t->bits_at(t->offset(idx)) != poison_bits(t->dtype()); });
  EXPECT_EQ(written, std::int64_t(b) * s * hk * (d + dv)) << "cache positions written";
}

AttnConfig seq_config(DType dtype, int b, int s, int h, int hk, int d, int dv = 0) {
  AttnConfig c;
  c.dtype = dtype;
  c.batch = b;
  c.seqlen_q = c.seqlen_k = s;
  c.heads = h;
  c.heads_k = hk;
  c.head_dim = d;
  c.head_dim_v = dv;
  c.opt.causal = true;
  return c;
}

class KVCache : public testing::TestWithParam<Backend> {};

// Decoding: one query and one new key per call equals causal attention over the sequence.
TEST_P(KVCache, DecodeStepByStep) {
  Incremental inc;
  inc.backend = GetParam();
  inc.cfg = seq_config(DType::f16, 2, 150, 4, 2, 64);
  inc.chunks.assign(150, 1);
  run_incremental(inc);
}

// Decoding with every score modifier: sliding window, softcap, ALiBi (b, h), MQA, d ≠ dv, bf16.
TEST_P(KVCache, DecodeWithWindowSoftcapAlibi) {
  Incremental inc;
  inc.backend = GetParam();
  inc.cfg = seq_config(DType::bf16, 2, 90, 4, 1, 64, 32);
  inc.cfg.opt.window_left = 20;
  inc.cfg.opt.softcap = 2.0f;
  inc.cfg.alibi = Alibi::per_batch_head;
  inc.chunks.assign(90, 1);
  run_incremental(inc);
}

// Chunked prefill: four queries and four new keys per call (the last chunk shorter).
TEST_P(KVCache, ChunkedPrefill) {
  Incremental inc;
  inc.backend = GetParam();
  inc.cfg = seq_config(DType::f32, 2, 150, 2, 2, 32);
  inc.chunks.assign(37, 4);
  inc.chunks.push_back(2);
  run_incremental(inc);
}

// A paged cache with shuffled pages (page sizes 16 and 256) equals the contiguous one: prefill
// then decode, chunks crossing page boundaries.
TEST_P(KVCache, LargePagedCache) {
  for (int page : {16, 256}) {
    Incremental inc;
    inc.backend = GetParam();
    inc.kind = CacheKind::paged;
    inc.page_size = page;
    inc.cfg = seq_config(DType::f16, 3, 300, 4, 2, 64);
    inc.chunks = {37, 1, 4, 16, 1, 17, 200, 1, 23};
    run_incremental(inc);
  }
}

// cache_batch_idx: each sequence uses an arbitrary row of a larger cache; other rows untouched.
TEST_P(KVCache, CacheBatchIdx) {
  Incremental inc;
  inc.backend = GetParam();
  inc.kind = CacheKind::batch_idx;
  inc.cfg = seq_config(DType::bf16, 3, 60, 2, 1, 32);
  inc.chunks = {5, 1, 1, 3, 50};
  run_incremental(inc);
}

// Without k_new and without cache_seqlens the whole cache is attended (non-causal: a prompt of
// 3 queries against 40 cached keys equals plain attention).
TEST_P(KVCache, WholeCacheWithoutAppend) {
  AttnConfig cfg = seq_config(DType::f16, 2, 0, 4, 2, 64);
  cfg.seqlen_q = 3;
  cfg.seqlen_k = 40;
  cfg.opt.causal = false;
  const AttnProblem p = make_problem(cfg);
  flashattn::KVCacheInputs in;
  in.q = p.q.tv();
  in.k_cache = p.k.tv();
  in.v_cache = p.v.tv();
  ForwardResult r = make_forward_outputs(p);
  flashattn::Options opt = p.opt;
  opt.backend = GetParam();
  flashattn::forward_kvcache(in, {r.out.tv(), r.lse.tv()}, opt);
  EXPECT_TRUE(check_forward(p, r));
}

// --- rotary embedding --------------------------------------------------------------------------

// The documented rotation of one head vector x (w entries) at `pos`, in double from the stored
// x, cos and sin: pairs (x[i], x[i + rd/2]) or, interleaved, (x[2i], x[2i+1]) become
// (xa·cos − xb·sin, xa·sin + xb·cos); entries past rotary_dim are unchanged.
std::vector<double> rotate(const std::vector<double>& x, const Tensor& cos, const Tensor& sin,
                           int pos, int rd, bool interleaved) {
  std::vector<double> y = x;
  for (int i = 0; i < rd / 2; ++i) {
    const int a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + rd / 2;
    const double c = cos.get({pos, i}), s = sin.get({pos, i});
    y[std::size_t(a)] = x[std::size_t(a)] * c - x[std::size_t(b)] * s;
    y[std::size_t(b)] = x[std::size_t(a)] * s + x[std::size_t(b)] * c;
  }
  return y;
}

struct RotaryCase {
  DType dtype;
  bool interleaved;
  bool causal;
  CacheKind kind;
  int rotary_dim;
  bool window = false;  // a local (sliding-window) mask: q rows at per-row positions too
};

class KVCacheRotary : public testing::TestWithParam<RotaryCase> {};

// One forward_kvcache call per batch layout: sequences with different cache_seqlens (10 and 3)
// append 3 rotated keys each; the queries are rotated at cache_seqlens[b] + i (causal) or all at
// cache_seqlens[b] (non-causal). Checked: the cache holds the rotated keys (within one rounding
// to the dtype) and unrotated values, and the output equals plain attention of the rotated q
// over the cache, per sequence, by the SPEC §7 rule.
TEST_P(KVCacheRotary, AppendRotatesLikeTheFormula) {
  const RotaryCase rc = GetParam();
  const int b = 2, sq = 3, sk_new = 3, h = 4, hk = 2, d = 64, dv = 32, page = 16;
  const std::vector<int> cached = {10, 3};
  const int capacity = 32;
  Cache cache = make_cache(rc.kind, rc.dtype, b, capacity, hk, d, dv, page, test_seed(1));
  const Tensor pre_k = prefill_cache(cache, cached, test_seed(2), test_seed(3)).k;
  Tensor q(rc.dtype, {b, sq, h, d}), k_new(rc.dtype, {b, sk_new, hk, d}), v_new(rc.dtype, {b, sk_new, hk, dv});
  q.fill_random(test_seed(4));
  k_new.fill_random(test_seed(5));
  v_new.fill_random(test_seed(6));
  Tensor cos, sin;
  make_tables(rc.dtype, 20, rc.rotary_dim, cos, sin);
  const Tensor seqlens = Tensor::from_i32({cached[0], cached[1]});

  flashattn::KVCacheInputs in = cache_inputs(cache);
  in.q = q.tv();
  in.k_new = k_new.tv();
  in.v_new = v_new.tv();
  in.cache_seqlens = seqlens.tv();
  in.rotary_cos = cos.tv();
  in.rotary_sin = sin.tv();
  in.rotary_interleaved = rc.interleaved;
  Tensor out(rc.dtype, {b, sq, h, dv}), lse(DType::f32, {b, h, sq});
  flashattn::Options opt;
  opt.causal = rc.causal;
  if (rc.window) {
    opt.window_left = 6;
    opt.window_right = 1;
  }
  opt.backend = Backend::cpu;
  flashattn::forward_kvcache(in, {out.tv(), lse.tv()}, opt);
  const bool per_row_positions = rc.causal || rc.window;

  const double u = unit_roundoff(rc.dtype);
  auto row = [](const Tensor& t, const Index& at, int w) {
    std::vector<double> x(static_cast<std::size_t>(w));
    Index idx = at;
    for (int c = 0; c < w; ++c) {
      idx.back() = c;
      x[std::size_t(c)] = t.get(idx);
    }
    return x;
  };
  for (int bb = 0; bb < b; ++bb) {
    const int cs = cached[std::size_t(bb)], sk = cs + sk_new;
    SCOPED_TRACE("sequence " + std::to_string(bb));
    // The cache after the append.
    for (int j = 0; j < sk; ++j)
      for (int x = 0; x < hk; ++x) {
        const std::int64_t ko = cache.offset(cache.k, bb, j, x), vo = cache.offset(cache.v, bb, j, x);
        if (j < cs) {  // untouched
          for (int c = 0; c < d; ++c) ASSERT_EQ(cache.k.load(ko + c), pre_k.get({bb, j, x, c}));
          continue;
        }
        const int t = j - cs;
        const std::vector<double> kin = row(k_new, {bb, t, x, 0}, d);
        const std::vector<double> want = rotate(kin, cos, sin, j, rc.rotary_dim, rc.interleaved);
        for (int c = 0; c < d; ++c) {
          const double got = cache.k.load(ko + c), w = want[std::size_t(c)];
          // One rounding to the dtype (≤ u·|w|) plus fp32 arithmetic on products of size |x|.
          const double tol = u * std::abs(w) + 1e-6 * (std::abs(kin[std::size_t(c)]) + 1.0);
          ASSERT_LE(std::abs(got - w), tol) << "k cache pos " << j << " head " << x << " col " << c;
        }
        for (int c = 0; c < dv; ++c) ASSERT_EQ(cache.v.load(vo + c), v_new.get({bb, t, x, c})) << "v is not rotated";
      }
    // The attention: a batch-1 problem over the cache's keys with the rotated queries.
    AttnProblem p = sequence_problem(cache, bb, sk, sq, h, opt);
    for (int i = 0; i < sq; ++i)
      for (int hh = 0; hh < h; ++hh) {
        const int pos = cs + (per_row_positions ? i : 0);
        const auto qr = rotate(row(q, {bb, i, hh, 0}, d), cos, sin, pos, rc.rotary_dim, rc.interleaved);
        for (int c = 0; c < d; ++c) p.q.set({0, i, hh, c}, float(qr[std::size_t(c)]));
      }
    const ForwardResult r = sequence_outputs(p, out, lse, bb);
    EXPECT_TRUE(check_forward(p, r));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Variants, KVCacheRotary,
    testing::Values(RotaryCase{DType::f16, false, true, CacheKind::contiguous, 32},
                    RotaryCase{DType::f16, true, true, CacheKind::contiguous, 32},
                    RotaryCase{DType::bf16, false, false, CacheKind::contiguous, 48},
                    RotaryCase{DType::bf16, true, false, CacheKind::paged, 16},
                    RotaryCase{DType::f32, false, true, CacheKind::paged, 64},
                    RotaryCase{DType::f32, true, false, CacheKind::batch_idx, 32},
                    RotaryCase{DType::f16, false, false, CacheKind::contiguous, 32, true},
                    RotaryCase{DType::bf16, true, false, CacheKind::paged, 64, true}),
    [](const testing::TestParamInfo<RotaryCase>& info) {
      const RotaryCase& c = info.param;
      return std::string(flashattn::dtype_name(c.dtype)) + (c.interleaved ? "_interleaved" : "_halves") +
             (c.causal ? "_causal" : c.window ? "_window" : "_noncausal") + "_" + kind_name(c.kind) +
             "_rd" + std::to_string(c.rotary_dim);
    });

INSTANTIATE_TEST_SUITE_P(Backends, KVCache, testing::Values(Backend::cpu, Backend::cpu_reference),
                         [](const testing::TestParamInfo<Backend>& info) {
                           return std::string(info.param == Backend::cpu ? "cpu" : "cpuref");
                         });

}  // namespace
}  // namespace fa_test
