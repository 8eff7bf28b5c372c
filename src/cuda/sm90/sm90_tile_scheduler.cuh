// src/cuda/sm90/sm90_tile_scheduler.cuh — which output tiles a CTA of the Hopper forward computes,
// and the key tiles each tile walks.
#pragma once

#include <cutlass/fast_math.h>

#include "common/params.h"
#include "common/tile_order.h"

namespace flashattn::cuda::sm90 {

// One output tile: kBlockM query rows of one (batch, query head), with the sequence's lengths and
// the key tiles [n_block_min, n_block_max) that hold a key visible to one of its rows.
struct FwdTile {
  int m_block;
  int head;
  int kv_head;
  int batch;
  int seqlen_q;
  int seqlen_k;
  // Where the sequence starts in the tensors TMA reads: its first packed row and its batch index
  // (varlen: cu_seqlens and batch 0 of one packed batch; dense: row 0 of batch `batch`; a KV
  // cache: row 0 of the cache's batch cache_batch_idx[batch]; a paged cache: unused, the producer
  // follows block_table[batch]).
  int q_row0;
  int k_row0;
  int q_tma_batch;
  int k_tma_batch;
  int n_block_min;
  int n_block_max;
  int split;  // split-KV kernels: which share of the row block's key tiles (0 elsewhere)
  common::Mask mask;

  __device__ __forceinline__ bool empty() const { return n_block_min >= n_block_max; }
};

// Where tile `index` of the order lies: its row block, (head, batch) pair and, split-KV, its split.
struct FwdTileIndex {
  int m_block;
  int head;
  int batch;
  int kv_head;
  int split;
};

// The order's runtime divisors as multiply-and-shift constants (cutlass::FastDivmod), made once by
// the host (make), for the decode of the kernels that take it (fwd_fast_divmod): a tile's decode otherwise divides
// by runtime values five to seven times (each a MUFU reciprocal and a dozen instructions on sm_90),
// in every warp that walks the tiles, at every tile's start.
struct FwdTileDivisors {
  cutlass::FastDivmod splits;         // split-KV shares (1: none)
  cutlass::FastDivmod m_blocks;       // row blocks per pair
  cutlass::FastDivmod section_tiles;  // section · m_blocks: the tiles of a whole section (masked order)
  cutlass::FastDivmod section;        // pairs of a whole section (its divisor: the section's size)
  cutlass::FastDivmod last_section;   // pairs of the last section (≤ section)
  cutlass::FastDivmod heads;          // query heads
  cutlass::FastDivmod group;          // query heads per kv head
  int pairs;

  static FwdTileDivisors make(const common::AttentionParams& p, int block_m, int section, int splits) {
    const int m_blocks = p.max_seqlen_q > 0 ? (p.max_seqlen_q + block_m - 1) / block_m : 1;
    const int pairs = p.heads * p.batch > 0 ? p.heads * p.batch : 1;
    const int sec = section < 1 ? 1 : (section > pairs ? pairs : section);
    const int last = pairs - (pairs - 1) / sec * sec;
    FwdTileDivisors d{cutlass::FastDivmod(splits < 1 ? 1 : splits), cutlass::FastDivmod(m_blocks),
                      cutlass::FastDivmod(sec * m_blocks),  cutlass::FastDivmod(sec),
                      cutlass::FastDivmod(last),            cutlass::FastDivmod(p.heads > 0 ? p.heads : 1),
                      cutlass::FastDivmod(p.group_size() > 0 ? p.group_size() : 1), pairs};
    return d;
  }

  // FwdTileIndex of `index` (kSplit: (tile, split) pairs, the split innermost), as decode_tile_index.
  template <bool kSplit>
  FA_HOST_DEVICE FwdTileIndex decode(int index, bool masked, int rising_parity) const {
    FwdTileIndex at{};
    if constexpr (kSplit) splits.fast_divmod(index, at.split, index);
    int head_batch = 0;
    if (masked) {
      int k = 0, local = 0;
      section_tiles.fast_divmod(k, local, index);
      const int first = k * section.divisor;
      int step = 0, in = 0;
      (pairs - first < section.divisor ? last_section : section).fast_divmod(step, in, local);
      at.m_block = (k & 1) == rising_parity ? step : m_blocks.divisor - 1 - step;
      head_batch = first + in;
    } else {
      m_blocks.fast_divmod(head_batch, at.m_block, index);
    }
    heads.fast_divmod(at.batch, at.head, head_batch);
    at.kv_head = group.div(at.head);
    return at;
  }
};

// The same decode by plain division (the default): the tile order's definition, which the
// FastDivmod decode must match (a host test compares them).
template <bool kSplit>
FA_HOST_DEVICE FwdTileIndex decode_tile_index(const common::AttentionParams& p, int block_m, int index, int section,
                                              int rising_parity, int splits) {
  FwdTileIndex at{};
  if constexpr (kSplit) {
    at.split = index % splits;
    index /= splits;
  }
  const int m_blocks = (p.max_seqlen_q + block_m - 1) / block_m;
  int head_batch;
  if (p.has_mask()) {
    const auto o = common::MaskedTileOrder{m_blocks, p.heads * p.batch, section, rising_parity}.at(index);
    at.m_block = o.m_block;
    head_batch = o.pair;
  } else {
    at.m_block = index % m_blocks;
    head_batch = index / m_blocks;
  }
  at.head = head_batch % p.heads;
  at.batch = head_batch / p.heads;
  at.kv_head = at.head / p.group_size();
  return at;
}

// Persistent CTAs: one per SM (at most one per tile), each walking one tile per round — so that
// while one tile's output is written, the producer already loads the next tile's Q and first K/V
// stages. The producer and the consumers walk the same sequence independently and agree on every
// barrier phase. Round r holds the tiles [r·G, (r+1)·G) of the order below (G CTAs); CTA c takes
// the c-th of them on even rounds and the (G−1−c)-th on odd rounds (a snake), so that under a mask,
// where the order runs from long tiles to short ones, no CTA takes the longest tile of every round.
// The rounds' sets are those of a plain walk; only who takes which tile changes
// (FLASHATTN_SM90_FWD_WALK=plain restores the plain walk, CTA c always the c-th).
//
// Order: without a mask every tile costs the same, and consecutive tiles are the row blocks of
// one (head, batch), which the CTAs of one wave take together, reading its K/V once from HBM and
// then from L2. Under a causal or windowed mask the highest row blocks of every (head, batch) come
// first (longest first shortens the tail of the last wave). H200, bf16, causal s 16k: d 128 560,
// d 256 566 TFLOP/s in this order; with the row blocks of one head together also under the mask
// (highest first) 441 / 418 — kept out. That order is taken in sections of (head, batch) pairs
// whose K/V fit in a share of L2 (fwd_l2_sections): every round then reads K/V that the
// section's earlier rounds left in L2, where one section of all pairs would stream all of K/V
// from HBM again in every round once they outgrow L2.
template <int kBlockM, int kBlockN>
struct PersistentTileScheduler {
  __host__ __device__ static int tiles(const common::AttentionParams& p) {
    return (p.max_seqlen_q + kBlockM - 1) / kBlockM * p.heads * p.batch;
  }
  // splits: split-KV, each tile of the order taken `splits` times (the split innermost).
  static dim3 grid(const common::AttentionParams& p, int sms, int splits = 1) {
    const int n = tiles(p) * splits;
    return dim3(n < sms ? n : sms);
  }

  // The tile CTA `cta` of `ctas` takes in round `round` (may be ≥ tiles() in the last round).
  __device__ __forceinline__ static int index(int round, int cta, int ctas, bool snake) {
    return round * ctas + (snake && (round & 1) ? ctas - 1 - cta : cta);
  }

  // section: under a mask, how many (head, batch) pairs form one section of the order (≥ 1; see
  // above), the host's fwd_l2_sections; rising_parity: which sections go up
  // (common::MaskedTileOrder). kPaged: the call's K/V are paged (the paged kernels). kSplit: index
  // counts (tile, split) pairs, the split innermost, and the tile keeps split `split` of
  // `splits` equal shares of its key tiles (an empty share is an empty tile).
  // divisors: the FastDivmod decode's (fwd_fast_divmod), or nullptr for division.
  template <bool kPaged = false, bool kSplit = false>
  __device__ __forceinline__ static FwdTile tile(const common::AttentionParams& p, int index, int section,
                                                 int rising_parity, int splits = 1,
                                                 const FwdTileDivisors* divisors = nullptr) {
    const FwdTileIndex at =
        divisors != nullptr ? divisors->template decode<kSplit>(index, p.has_mask(), rising_parity)
                            : decode_tile_index<kSplit>(p, kBlockM, index, section, rising_parity, splits);
    FwdTile t;
    t.split = at.split;
    t.m_block = at.m_block;
    t.head = at.head;
    t.batch = at.batch;
    t.kv_head = at.kv_head;
    if (p.is_varlen()) {
      t.q_row0 = p.cu_seqlens_q[t.batch];
      t.seqlen_q = p.cu_seqlens_q[t.batch + 1] - t.q_row0;
      if constexpr (kPaged) {  // keys found by pages (cu_seqlens_k may be absent)
        t.k_row0 = 0;
        t.seqlen_k = p.seqlen_k(t.batch);
      } else {
        t.k_row0 = p.cu_seqlens_k[t.batch];
        t.seqlen_k = p.seqused_k ? p.seqused_k[t.batch] : p.cu_seqlens_k[t.batch + 1] - t.k_row0;
      }
      t.q_tma_batch = t.k_tma_batch = 0;
    } else {
      t.q_row0 = 0;
      t.k_row0 = int(p.k_row0(t.batch));  // a KV cache's left padding, else 0
      t.seqlen_q = p.max_seqlen_q;
      t.seqlen_k = p.seqlen_k(t.batch);  // seqused_k, cache_seqlens (less the padding) or all
      t.q_tma_batch = t.batch;
      t.k_tma_batch = p.kv_batch(t.batch);
    }
    t.mask = p.mask_for(t.seqlen_q, t.seqlen_k);
    const int m_start = t.m_block * kBlockM;
    const int m_end = min(m_start + kBlockM, t.seqlen_q);
    if (m_start >= m_end) {
      t.n_block_min = t.n_block_max = 0;
      return t;
    }
    t.n_block_min = t.mask.block_col_begin(m_start) / kBlockN;
    t.n_block_max = (t.mask.block_col_end(m_end) + kBlockN - 1) / kBlockN;
    if constexpr (kSplit) {
      const int per = (max(t.n_block_max - t.n_block_min, 0) + splits - 1) / splits;
      t.n_block_min += t.split * per;
      t.n_block_max = max(t.n_block_min, min(t.n_block_max, t.n_block_min + per));
    }
    return t;
  }
};

}  // namespace flashattn::cuda::sm90
