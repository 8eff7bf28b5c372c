// src/common/kvcache.h — what the KV-cache call does before attention, as every backend reads it:
// the new keys/values to append, the rotary tables, and which position each row is rotated at.
#pragma once

#include <cstdint>

#include "common/macros.h"
#include "common/mask.h"
#include "common/params.h"

namespace flashattn::common {

// k_new/v_new (b, sk_new, hk, d/dv) are written into the cache rows [cache_seqlens[b],
// cache_seqlens[b] + sk_new) of sequence b (following the params' cache layout: cache_batch_idx
// or block_table), k rotated by rotary_cos/sin when given. Pointers are in the call's memory
// space (host or device).
struct AppendArgs {
  const void* k_new = nullptr;  // (b, sk_new, hk, d) with the strides below
  const void* v_new = nullptr;
  std::int64_t k_new_strides[3] = {};  // batch, row, head
  std::int64_t v_new_strides[3] = {};
  int seqlen_new = 0;
  const std::int32_t* cache_seqlens = nullptr;  // before the append
  const void* rotary_cos = nullptr;  // (seqlen_ro, rotary_dim / 2), row stride below
  const void* rotary_sin = nullptr;
  std::int64_t rotary_cos_stride = 0;
  std::int64_t rotary_sin_stride = 0;
  int rotary_dim = 0;  // 0: no rotary
  bool rotary_interleaved = false;
};

// The reference API's convention for q: when the mask is causal or windowed, query row i of
// sequence b sits at position cache_seqlens[b] + i; otherwise every row sits at cache_seqlens[b].
FA_HOST_DEVICE bool rotary_q_positions_per_row(const AttentionParams& p) {
  const Mask m = make_mask(p.causal, p.window_left, p.window_right, p.max_seqlen_k, 0, 0);
  return m.window_left >= 0 || m.window_right >= 0;
}
FA_HOST_DEVICE int rotary_q_position(const AppendArgs& a, int b, int i, bool per_row) {
  return a.cache_seqlens[b] + (per_row ? i : 0);
}

// The view of a rotated copy of q: (b, sq, h, d), contiguous.
FA_HOST_DEVICE RowHeadTensor contiguous_q(void* data, const AttentionParams& p) {
  RowHeadTensor t;
  t.data = data;
  t.head_stride = p.head_dim;
  t.row_stride = std::int64_t(p.heads) * p.head_dim;
  t.batch_stride = t.row_stride * p.max_seqlen_q;
  return t;
}

}  // namespace flashattn::common
