// tests/cpp/kvcache_test_util.h — KV caches for the tests of forward_kvcache (CPU and CUDA): a
// poisoned cache in one of three layouts (contiguous, paged with shuffled pages, rows picked by
// cache_batch_idx), its API inputs, and rotary cos/sin tables.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "test_util.h"

namespace fa_test {

// --- a KV cache in one of three layouts --------------------------------------------------------

enum class CacheKind { contiguous, paged, batch_idx };

struct Cache {
  CacheKind kind = CacheKind::contiguous;
  int batch = 0, capacity = 0, page_size = 0;
  Tensor k, v;                 // (rows, capacity, hk, d) or paged (num_blocks, page_size, hk, d)
  Tensor block_table;          // (batch, blocks_per_seq) int32, paged only
  Tensor cache_batch_idx;      // (batch) int32, batch_idx only
  std::vector<int> table;      // block_table entries, row-major
  std::vector<int> batch_rows; // cache row of each sequence (batch_idx)

  // Element offset of (sequence b, position j, kv head hk, 0) in k (or v with v's tensor).
  std::int64_t offset(const Tensor& t, int b, int j, int hk) const {
    if (kind == CacheKind::paged) {
      const int blocks = capacity / page_size;
      return t.offset({table[std::size_t(b) * blocks + j / page_size], j % page_size, hk, 0});
    }
    const int row = kind == CacheKind::batch_idx ? batch_rows[std::size_t(b)] : b;
    return t.offset({row, j, hk, 0});
  }
};

// A poisoned cache: positions never written stay NaN, so reading one poisons the output.
inline Cache make_cache(CacheKind kind, DType dtype, int batch, int capacity, int hk, int d, int dv,
                        int page_size, std::uint64_t seed) {
  Cache c;
  c.kind = kind;
  c.batch = batch;
  c.capacity = capacity;
  c.page_size = page_size;
  std::mt19937_64 rng(seed);
  if (kind == CacheKind::paged) {
    const int blocks = capacity / page_size;
    const int num_blocks = batch * blocks + 3;  // three spare pages nobody references
    std::vector<int> pages(static_cast<std::size_t>(num_blocks));
    std::iota(pages.begin(), pages.end(), 0);
    std::shuffle(pages.begin(), pages.end(), rng);
    c.table.assign(pages.begin(), pages.begin() + std::ptrdiff_t(batch) * blocks);
    c.block_table = Tensor(DType::i32, {batch, blocks});
    for (int i = 0; i < batch * blocks; ++i) c.block_table.store(i, float(c.table[std::size_t(i)]));
    c.k = Tensor(dtype, {num_blocks, page_size, hk, d});
    c.v = Tensor(dtype, {num_blocks, page_size, hk, dv});
  } else if (kind == CacheKind::batch_idx) {
    const int rows = batch + 2;  // two rows nobody references
    std::vector<int> perm(static_cast<std::size_t>(rows));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    c.batch_rows.assign(perm.begin(), perm.begin() + batch);
    c.cache_batch_idx = Tensor::from_i32(std::vector<std::int32_t>(c.batch_rows.begin(), c.batch_rows.end()));
    c.k = Tensor(dtype, {rows, capacity, hk, d});
    c.v = Tensor(dtype, {rows, capacity, hk, dv});
  } else {
    c.k = Tensor(dtype, {batch, capacity, hk, d});
    c.v = Tensor(dtype, {batch, capacity, hk, dv});
  }
  return c;
}

inline flashattn::KVCacheInputs cache_inputs(const Cache& c) {
  flashattn::KVCacheInputs in;
  in.k_cache = c.k.tv();
  in.v_cache = c.v.tv();
  if (c.kind == CacheKind::paged) in.block_table = c.block_table.tv();
  if (c.kind == CacheKind::batch_idx) in.cache_batch_idx = c.cache_batch_idx.tv();
  return in;
}

inline std::string kind_name(CacheKind k) {
  return k == CacheKind::paged ? "paged" : k == CacheKind::batch_idx ? "batch_idx" : "contiguous";
}

// cos/sin tables (seqlen_ro, rotary_dim / 2) in dtype: angle pos · 10000^(−2i / rotary_dim).
inline void make_tables(DType dtype, int seqlen_ro, int rotary_dim, Tensor& cos, Tensor& sin) {
  cos = Tensor(dtype, {seqlen_ro, rotary_dim / 2});
  sin = Tensor(dtype, {seqlen_ro, rotary_dim / 2});
  for (int pos = 0; pos < seqlen_ro; ++pos)
    for (int i = 0; i < rotary_dim / 2; ++i) {
      const double angle = pos * std::pow(10000.0, -2.0 * i / rotary_dim);
      cos.set({pos, i}, float(std::cos(angle)));
      sin.set({pos, i}, float(std::sin(angle)));
    }
}

// Random (unrotated) keys and values at positions [0, lengths[b]) of each sequence of c; the rest
// stays poisoned. Returns them dense: (b, capacity, hk, d) and (b, capacity, hk, dv).
struct CacheContents {
  Tensor k, v;
};
inline CacheContents prefill_cache(Cache& c, const std::vector<int>& lengths, std::uint64_t seed_k,
                                   std::uint64_t seed_v) {
  const int hk = int(c.k.shape(2)), d = int(c.k.shape(3)), dv = int(c.v.shape(3));
  CacheContents pre{Tensor(c.k.dtype(), {c.batch, c.capacity, hk, d}), Tensor(c.v.dtype(), {c.batch, c.capacity, hk, dv})};
  pre.k.fill_random(seed_k);
  pre.v.fill_random(seed_v);
  for (int b = 0; b < c.batch; ++b)
    for (int j = 0; j < lengths[std::size_t(b)]; ++j)
      for (int x = 0; x < hk; ++x) {
        for (int i = 0; i < d; ++i) c.k.store(c.offset(c.k, b, j, x) + i, pre.k.get({b, j, x, i}));
        for (int i = 0; i < dv; ++i) c.v.store(c.offset(c.v, b, j, x) + i, pre.v.get({b, j, x, i}));
      }
  return pre;
}

// The attention of sequence b alone: a batch-1 problem of sq random queries (the caller
// overwrites them as needed) and h heads over the first sk keys and values of c, with opt's mask.
inline AttnProblem sequence_problem(const Cache& c, int b, int sk, int sq, int h, const flashattn::Options& opt) {
  const int hk = int(c.k.shape(2)), d = int(c.k.shape(3)), dv = int(c.v.shape(3));
  AttnConfig cfg = dense_config(c.k.dtype(), 1, sq, sk, h, hk, d, dv);
  cfg.opt.causal = opt.causal;
  cfg.opt.window_left = opt.window_left;
  cfg.opt.window_right = opt.window_right;
  AttnProblem p = make_problem(cfg);
  for (int j = 0; j < sk; ++j)
    for (int x = 0; x < hk; ++x) {
      const std::int64_t ko = c.offset(c.k, b, j, x), vo = c.offset(c.v, b, j, x);
      for (int i = 0; i < d; ++i) p.k.set({0, j, x, i}, c.k.load(ko + i));
      for (int i = 0; i < dv; ++i) p.v.set({0, j, x, i}, c.v.load(vo + i));
    }
  return p;
}

// Sequence b of a batched call's out (b, sq, h, dv) and lse (b, h, sq), as the outputs of its
// sequence_problem p.
inline ForwardResult sequence_outputs(const AttnProblem& p, const Tensor& out, const Tensor& lse, int b) {
  ForwardResult r = make_forward_outputs(p);
  for (int i = 0; i < p.cfg.seqlen_q; ++i)
    for (int hh = 0; hh < p.cfg.heads; ++hh) {
      r.lse.set({0, hh, i}, lse.get({b, hh, i}));
      for (int x = 0; x < p.head_dim_v; ++x) r.out.set({0, i, hh, x}, out.get({b, i, hh, x}));
    }
  return r;
}

}  // namespace fa_test
