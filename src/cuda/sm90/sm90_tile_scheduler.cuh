// src/cuda/sm90/sm90_tile_scheduler.cuh — which output tiles a CTA of the Hopper forward computes,
// and the key tiles each tile walks.
#pragma once

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
  template <bool kPaged = false, bool kSplit = false>
  __device__ __forceinline__ static FwdTile tile(const common::AttentionParams& p, int index, int section,
                                                 int rising_parity, int splits = 1) {
    int split = 0;
    if constexpr (kSplit) {
      split = index % splits;
      index /= splits;
    }
    const int m_blocks = (p.max_seqlen_q + kBlockM - 1) / kBlockM;
    const bool masked = p.has_mask();
    FwdTile t;
    t.split = split;
    int head_batch;
    if (masked) {
      const auto at = common::MaskedTileOrder{m_blocks, p.heads * p.batch, section, rising_parity}.at(index);
      t.m_block = at.m_block;
      head_batch = at.pair;
    } else {
      t.m_block = index % m_blocks;
      head_batch = index / m_blocks;
    }
    t.head = head_batch % p.heads;
    t.batch = head_batch / p.heads;
    t.kv_head = t.head / p.group_size();
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
      t.n_block_min += split * per;
      t.n_block_max = max(t.n_block_min, min(t.n_block_max, t.n_block_min + per));
    }
    return t;
  }
};

}  // namespace flashattn::cuda::sm90
