// tests/cpp/paged_test_util.h — paged prefill (a varlen forward over a paged K/V) for the CPU and
// CUDA tests: the packed keys and values of a varlen problem scattered into a poisoned paged cache
// with shuffled pages, and the forward inputs that read them through block_table.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include "test_util.h"

namespace fa_test {

// Where the key counts of a paged call come from (FA2's public function passes cu_seqlens_k;
// vLLM passes seqused_k alone; both may be given).
enum class PagedLengths { seqused_k, cu_seqlens_k, both };

// A varlen configuration: per-sequence query and key lengths, heads, kv heads, head dims (dv 0: = d).
inline AttnConfig varlen_config(DType dtype, std::vector<int> sq, std::vector<int> sk, int h, int hk, int d,
                                int dv = 0) {
  AttnConfig c;
  c.dtype = dtype;
  c.varlen_q = std::move(sq);
  c.varlen_k = std::move(sk);
  c.heads = h;
  c.heads_k = hk;
  c.head_dim = d;
  c.head_dim_v = dv;
  return c;
}

inline const char* lengths_name(PagedLengths l) {
  return l == PagedLengths::seqused_k ? "seqused_k" : l == PagedLengths::cu_seqlens_k ? "cu_seqlens_k" : "both";
}

struct PagedCache {
  int page_size = 0, blocks_per_seq = 0, num_blocks = 0;
  Tensor k, v;             // (num_blocks, page_size, hk, d / dv), poisoned where not written
  Tensor block_table;      // (batch, blocks_per_seq) int32
  Tensor seqused_k;        // (batch) int32: the key counts
  std::vector<int> table;  // block_table, row-major
  std::vector<int> keys;   // key count of each sequence
};

// The keys a sequence of problem p uses: seqused_k when the config has it, else its cu_seqlens_k
// length.
inline std::vector<int> used_keys(const AttnProblem& p) {
  return p.cfg.seqused_k.empty() ? p.cfg.varlen_k : p.cfg.seqused_k;
}

// The keys [0, keys[i]) of every sequence of the varlen problem p, copied into pages that are
// shuffled over the cache; the other positions (keys past seqused_k, pages nobody uses, the
// tail of each sequence's last page) keep the poison, so reading one makes the output NaN.
// Table entries past the pages a sequence uses are out of range on purpose (never read).
// extra_pages: columns of block_table past the longest sequence's.
inline PagedCache make_paged_cache(const AttnProblem& p, DType dtype, int page_size, std::uint64_t seed,
                                   int extra_pages = 1) {
  PagedCache c;
  c.page_size = page_size;
  c.keys = used_keys(p);
  const int b = p.cfg.batch, hk = p.cfg.heads_k, d = p.cfg.head_dim, dv = p.head_dim_v;
  int most = 0;
  for (int n : c.keys) most = std::max(most, (n + page_size - 1) / page_size);
  c.blocks_per_seq = most + extra_pages;
  int used = 0;
  for (int n : c.keys) used += (n + page_size - 1) / page_size;
  c.num_blocks = used + 2;  // two pages nobody references
  std::vector<int> pages(static_cast<std::size_t>(c.num_blocks));
  std::iota(pages.begin(), pages.end(), 0);
  std::mt19937_64 rng(seed);
  std::shuffle(pages.begin(), pages.end(), rng);
  c.table.assign(std::size_t(b) * c.blocks_per_seq, c.num_blocks + 7);  // unused: out of range
  int next = 0;
  for (int i = 0; i < b; ++i) {
    const int n = (c.keys[std::size_t(i)] + page_size - 1) / page_size;
    for (int blk = 0; blk < n; ++blk) c.table[std::size_t(i) * c.blocks_per_seq + blk] = pages[std::size_t(next++)];
  }
  c.block_table = Tensor(DType::i32, {b, c.blocks_per_seq});
  for (std::size_t e = 0; e < c.table.size(); ++e) c.block_table.store(std::int64_t(e), float(c.table[e]));
  c.seqused_k = Tensor::from_i32(std::vector<std::int32_t>(c.keys.begin(), c.keys.end()));
  c.k = Tensor(dtype, {c.num_blocks, page_size, hk, d});
  c.v = Tensor(dtype, {c.num_blocks, page_size, hk, dv});
  for (int i = 0; i < b; ++i) {
    const int row0 = int(p.cu_seqlens_k.get({i}));
    for (int j = 0; j < c.keys[std::size_t(i)]; ++j) {
      const int page = c.table[std::size_t(i) * c.blocks_per_seq + j / page_size];
      for (int g = 0; g < hk; ++g) {
        for (int e = 0; e < d; ++e) c.k.set({page, j % page_size, g, e}, p.k.get({row0 + j, g, e}));
        for (int e = 0; e < dv; ++e) c.v.set({page, j % page_size, g, e}, p.v.get({row0 + j, g, e}));
      }
    }
  }
  return c;
}

// The forward inputs of p with K/V read from the paged cache, the key counts given as `lengths`
// says.
inline flashattn::ForwardInputs paged_inputs(const AttnProblem& p, const PagedCache& c, PagedLengths lengths) {
  flashattn::ForwardInputs in = p.forward_inputs();
  in.k = c.k.tv();
  in.v = c.v.tv();
  in.block_table = c.block_table.tv();
  in.varlen.seqused_k = lengths == PagedLengths::cu_seqlens_k ? flashattn::TensorView{} : c.seqused_k.tv();
  if (lengths == PagedLengths::seqused_k) in.varlen.cu_seqlens_k = {};
  return in;
}

}  // namespace fa_test
