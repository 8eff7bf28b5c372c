// src/common/params.h — ONE parameter block for every attention call, with per-sequence accessors
// that hide the batch layout: dense (b, s, h, d), varlen (cu_seqlens, seqused_k) and paged K/V
// (block_table, cache_seqlens, cache_batch_idx). Backends and the reference read tensors only
// through these accessors, so every layout is served by one main loop.
#pragma once

#include <cstdint>

#include "common/index_check.h"
#include "common/macros.h"
#include "common/mask.h"
#include "common/philox.h"
#include "common/score_mod.h"

namespace flashattn::common {

enum class Storage : std::uint8_t { f16, bf16, f32 };

// A strided 3-axis view (row, head, dim) of one batch layout; batch_stride is used only in dense
// mode. Strides are in elements.
struct RowHeadTensor {
  void* data = nullptr;
  std::int64_t batch_stride = 0;
  std::int64_t row_stride = 0;
  std::int64_t head_stride = 0;
};

struct AttentionParams {
  Storage storage = Storage::f16;
  int batch = 0;
  int heads = 0;     // h
  int heads_k = 0;   // hk; h % hk == 0
  int head_dim = 0;  // d
  int head_dim_v = 0;  // dv
  int max_seqlen_q = 0;
  int max_seqlen_k = 0;

  RowHeadTensor q, k, v, out;  // q (b, sq, h, d) ... varlen: batch_stride unused
  float* lse = nullptr;        // (b, h, sq) or varlen (h, total_q), contiguous
  std::int64_t lse_batch_stride = 0;  // dense: h·sq; varlen: 0 (rows are global)
  std::int64_t lse_head_stride = 0;   // dense: sq;   varlen: total_q

  // Backward only.
  RowHeadTensor dout, dq, dk, dv;
  float* softmax_d = nullptr;  // laid out like lse

  // Varlen (nullptr in dense mode).
  const std::int32_t* cu_seqlens_q = nullptr;
  const std::int32_t* cu_seqlens_k = nullptr;
  const std::int32_t* seqused_k = nullptr;
  std::int64_t total_q = 0, total_k = 0;  // rows of the packed q and k/v (0 in dense mode)
  // KV cache (nullptr when unused).
  const std::int32_t* cache_seqlens = nullptr;    // keys of sequence b (replaces max_seqlen_k)
  const std::int32_t* cache_batch_idx = nullptr;  // K/V batch row of sequence b
  // Left padding (KV cache): sequence b's keys start at row k_leftpad[b] of its K/V rows; set only
  // for the attention, after the KV-cache append (which writes at absolute rows).
  const std::int32_t* k_leftpad = nullptr;
  const std::int32_t* block_table = nullptr;      // (b, blocks_per_seq): paged K/V
  std::int64_t block_table_batch_stride = 0;
  std::int64_t cache_batches = 0;  // the caches' leading extent: their batches, or pages (0: no cache)
  int page_size = 0;  // rows per page; K/V batch_stride then steps one page

  // Semantics.
  float softmax_scale = 1.0f;
  float softcap = 0.0f;
  const float* alibi_slopes = nullptr;  // (h) or (b, h)
  std::int64_t alibi_batch_stride = 0;  // 0 for (h)
  bool causal = false;
  int window_left = -1;
  int window_right = -1;
  float dropout_p = 0.0f;
  DropoutParams dropout = {};
  // Attention sinks (docs/sinks.md): one logit per query head, in score units, that joins each
  // row's softmax denominator: lse = log(exp(sink) + Σ exp(s)). nullptr: none.
  const float* sinks = nullptr;  // (h)
  // Backward: the sinks' gradient, −Σ_{b,i} exp(sink − lse) · softmax_d per head. nullptr: none.
  float* dsinks = nullptr;  // (h)
  bool deterministic = false;

  // Split-KV (forward on CUDA): each (row block, head, batch) spreads its key tiles over this many
  // CTAs, whose partial results are merged by the combine kernel. 0: the backend's heuristic
  // decides (it splits only when a workspace is given); 1: never split; n > 1: n splits when the
  // workspace holds them (tests force splitting this way). Ignored by the CPU backends.
  int num_splits = 0;

  // CUDA: the device's index-check flag (src/cuda/index_check.h), set when the call has index
  // tensors in device memory. A kernel that reads an index exits at its start when the flag is
  // non-zero: a bad value found by the check is never used. nullptr: no check (host tensors, or
  // no index tensor).
  const int* index_error = nullptr;
  // CUDA: this call's index check folded into the sm80 forward kernel's prologue (IndexFold, set
  // by a KV-cache call without an append kernel; inactive otherwise, and for every other kernel).
  IndexFold index_fold;

  // --- per-sequence accessors -------------------------------------------------------------------
  FA_HOST_DEVICE bool is_varlen() const { return cu_seqlens_q != nullptr; }
  FA_HOST_DEVICE bool is_paged() const { return block_table != nullptr; }
  // A causal mask or a window: key tiles of unequal work (the kernels' tile orders ask).
  FA_HOST_DEVICE bool has_mask() const { return causal || window_left >= 0 || window_right >= 0; }
  FA_HOST_DEVICE int group_size() const { return heads / heads_k; }
  // Device code only (index_error points to device memory).
  FA_HOST_DEVICE bool index_check_failed() const { return index_error != nullptr && *index_error != 0; }

  FA_HOST_DEVICE int seqlen_q(int b) const {
    return is_varlen() ? cu_seqlens_q[b + 1] - cu_seqlens_q[b] : max_seqlen_q;
  }
  FA_HOST_DEVICE int seqlen_k(int b) const {
    if (seqused_k) return seqused_k[b];
    if (cache_seqlens) return cache_seqlens[b] - (k_leftpad ? k_leftpad[b] : 0);
    return is_varlen() ? cu_seqlens_k[b + 1] - cu_seqlens_k[b] : max_seqlen_k;
  }
  // First packed row of sequence b (varlen) — 0 in dense mode, where the batch stride is used.
  FA_HOST_DEVICE std::int64_t q_row0(int b) const { return is_varlen() ? cu_seqlens_q[b] : 0; }
  // First key row of sequence b: its cu_seqlens_k entry (varlen), its left padding (KV cache), or 0.
  FA_HOST_DEVICE std::int64_t k_row0(int b) const {
    return is_varlen() ? cu_seqlens_k[b] : k_leftpad ? k_leftpad[b] : 0;
  }
  FA_HOST_DEVICE int kv_batch(int b) const { return cache_batch_idx ? cache_batch_idx[b] : b; }

  // Element offset of row i, head hh of sequence b in a q-like tensor (q, out, dout, dq).
  FA_HOST_DEVICE std::int64_t q_offset(const RowHeadTensor& t, int b, int i, int hh) const {
    return q_offset_at(t, b, q_row0(b), i, hh);
  }
  // The same with row0 = q_row0(b) read by the caller: a kernel reads cu_seqlens once, instead of
  // one dependent global load per offset it takes.
  FA_HOST_DEVICE std::int64_t q_offset_at(const RowHeadTensor& t, int b, std::int64_t row0, int i, int hh) const {
    const std::int64_t batch = is_varlen() ? 0 : std::int64_t(b) * t.batch_stride;
    return batch + (row0 + i) * t.row_stride + std::int64_t(hh) * t.head_stride;
  }
  // Element offset of key row j, kv head hk of sequence b in a k-like tensor (k, v, dk, dv);
  // follows the page table for paged caches.
  FA_HOST_DEVICE std::int64_t k_offset(const RowHeadTensor& t, int b, int j, int hk) const {
    if (is_paged()) {
      const std::int64_t page = block_table[std::int64_t(b) * block_table_batch_stride + j / page_size];
      return page * t.batch_stride + std::int64_t(j % page_size) * t.row_stride +
             std::int64_t(hk) * t.head_stride;
    }
    return k_offset_at(t, kv_batch(b), k_row0(b), j, hk);
  }
  // The unpaged k_offset with kv_b = kv_batch(b) and row0 = k_row0(b) read by the caller.
  FA_HOST_DEVICE std::int64_t k_offset_at(const RowHeadTensor& t, int kv_b, std::int64_t row0, int j, int hk) const {
    const std::int64_t batch = is_varlen() ? 0 : std::int64_t(kv_b) * t.batch_stride;
    return batch + (row0 + j) * t.row_stride + std::int64_t(hk) * t.head_stride;
  }
  // Index of (b, hh, i) in lse / softmax_d.
  FA_HOST_DEVICE std::int64_t lse_index(int b, int hh, int i) const { return lse_index_at(b, q_row0(b), hh, i); }
  // The same with row0 = q_row0(b) read by the caller.
  FA_HOST_DEVICE std::int64_t lse_index_at(int b, std::int64_t row0, int hh, int i) const {
    return is_varlen() ? std::int64_t(hh) * lse_head_stride + row0 + i
                       : std::int64_t(b) * lse_batch_stride + std::int64_t(hh) * lse_head_stride + i;
  }

  FA_HOST_DEVICE Mask mask(int b) const { return mask_for(seqlen_q(b), seqlen_k(b)); }
  // The mask of a sequence of sq queries and sk keys (seqlen_q(b), seqlen_k(b) read by the caller).
  FA_HOST_DEVICE Mask mask_for(int sq, int sk) const {
    return make_mask(causal, window_left, window_right, max_seqlen_k, sq, sk);
  }
  template <class Acc>
  FA_HOST_DEVICE ScoreMod<Acc> score_mod(int b, int hh) const {
    return score_mod_for<Acc>(b, hh, seqlen_q(b), seqlen_k(b));
  }
  template <class Acc>
  FA_HOST_DEVICE ScoreMod<Acc> score_mod_for(int b, int hh, int sq, int sk) const {
    ScoreMod<Acc> m;
    m.scale = Acc(softmax_scale);
    m.softcap = Acc(softcap);
    m.alibi_slope = alibi_slopes ? Acc(alibi_slopes[std::int64_t(b) * alibi_batch_stride + hh]) : Acc(0);
    m.diag_offset = (long long)sk - sq;
    return m;
  }
  // The sink logit of head hh; −∞ (no sink) when there are none.
  FA_HOST_DEVICE float sink(int hh) const { return sinks ? sinks[hh] : -__builtin_huge_valf(); }
  // Stream index of the dropout counter (docs/dropout.md).
  FA_HOST_DEVICE std::uint64_t dropout_stream(int b, int hh) const {
    return std::uint64_t(b) * std::uint64_t(heads) + std::uint64_t(hh);
  }
};

}  // namespace flashattn::common
