// src/cuda/sm90/sm90_tile_scheduler.cuh — which output tile a CTA of the Hopper forward computes,
// and the key tiles that tile walks.
#pragma once

#include "common/params.h"

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
  int n_block_min;
  int n_block_max;
  common::Mask mask;

  __device__ __forceinline__ bool empty() const { return n_block_min >= n_block_max; }
};

// One tile per CTA, grid (row blocks, heads, batch). The highest row blocks go first: under a
// causal mask they see the most keys, and starting the long CTAs early shortens the grid's tail.
// The producer and the consumers ask it independently and get the same tile and key range, so
// both sides agree on every barrier phase.
template <int kBlockM, int kBlockN>
struct SingleTileScheduler {
  static dim3 grid(const common::AttentionParams& p) {
    return dim3((p.max_seqlen_q + kBlockM - 1) / kBlockM, p.heads, p.batch);
  }

  __device__ __forceinline__ static FwdTile tile(const common::AttentionParams& p) {
    FwdTile t;
    t.m_block = gridDim.x - 1 - blockIdx.x;
    t.head = blockIdx.y;
    t.kv_head = t.head / p.group_size();
    t.batch = blockIdx.z;
    t.seqlen_q = p.seqlen_q(t.batch);
    t.seqlen_k = p.seqlen_k(t.batch);
    t.mask = p.mask_for(t.seqlen_q, t.seqlen_k);
    const int m_start = t.m_block * kBlockM;
    const int m_end = min(m_start + kBlockM, t.seqlen_q);
    if (m_start >= m_end) {
      t.n_block_min = t.n_block_max = 0;
      return t;
    }
    t.n_block_min = t.mask.block_col_begin(m_start) / kBlockN;
    t.n_block_max = (t.mask.block_col_end(m_end) + kBlockN - 1) / kBlockN;
    return t;
  }
};

}  // namespace flashattn::cuda::sm90
