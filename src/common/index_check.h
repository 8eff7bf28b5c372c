// src/common/index_check.h — THE rules for index VALUES (cu_seqlens, seqused_k, cache_seqlens,
// cache_batch_idx, block_table, rotary positions), one sequence at a time, for the host validation
// (src/api/validate.cpp reads host tensors) and the CUDA index check (src/cuda/index_check.cu reads
// device tensors). A value that passes keeps every read and write inside the caller's tensors. The
// message of each rule is written once, on the host (validate.cpp, index_violation_message).
#pragma once

#include <cstdint>

#include "common/macros.h"

namespace flashattn::common {

enum class IndexRule : int {
  ok = 0,
  cu_seqlens_start,        // cu_seqlens[0] != 0
  cu_seqlens_decreasing,   // cu_seqlens[b + 1] < cu_seqlens[b]
  max_seqlen_too_small,    // a sequence longer than max_seqlen
  cu_seqlens_past_total,   // cu_seqlens[batch] > the packed rows
  seqused_k_range,         // seqused_k[b] outside [0, keys of sequence b]
  cache_seqlens_range,     // cache_seqlens[b] < 0 or + seqlen_new > capacity
  rotary_too_short,        // rotary table rows < cache_seqlens[b] + max(seqlen_q, seqlen_new)
  cache_batch_idx_range,   // cache_batch_idx[b] outside [0, cache rows)
  block_table_range,       // a used block_table entry outside [0, pages)
  paged_keys_past_capacity,  // paged varlen: a sequence's keys exceed its block_table row's pages
  cache_leftpad_range,     // cache_leftpad[b] outside [0, cache_seqlens[b]]
};

// Which side a varlen rule is about.
enum class IndexSide : int { q = 0, k = 1 };

// The first broken rule of a sequence: `value` is the offending value, `bound` the limit it broke
// (its meaning per rule: index_violation_message), `entry` the position in the index tensor.
struct IndexViolation {
  IndexRule rule = IndexRule::ok;
  IndexSide side = IndexSide::q;
  int batch = 0;
  int entry = 0;
  long long value = 0;
  long long bound = 0;
  int api = 0;  // which entry point (IndexApi), for a message raised after the call returned
  FA_HOST_DEVICE explicit operator bool() const { return rule != IndexRule::ok; }
};

enum class IndexApi : int { forward = 0, backward = 1, forward_kvcache = 2 };

// The index tensors of one call and the extents their values must respect. Null pointers are
// absent tensors.
struct IndexBounds {
  int batch = 0;
  IndexApi api = IndexApi::forward;
  // Varlen.
  const std::int32_t* cu_seqlens_q = nullptr;  // (batch + 1)
  const std::int32_t* cu_seqlens_k = nullptr;  // (batch + 1)
  const std::int32_t* seqused_k = nullptr;     // (batch)
  int max_seqlen_q = 0, max_seqlen_k = 0;
  std::int64_t total_q = 0, total_k = 0;  // packed rows of q and k; total_k < 0: k is paged, not packed
  // KV cache: lengths BEFORE the append of seqlen_new keys.
  const std::int32_t* cache_seqlens = nullptr;    // (batch)
  const std::int32_t* cache_batch_idx = nullptr;  // (batch)
  const std::int32_t* cache_leftpad = nullptr;    // (batch), with cache_seqlens
  // Paged K/V, of a KV-cache call or of a varlen forward (paged prefill).
  const std::int32_t* block_table = nullptr;     // (batch, blocks per sequence)
  std::int64_t block_table_batch_stride = 0;
  std::int64_t cache_rows = 0;  // k_cache.shape[0]: batch rows, or pages when paged
  std::int64_t capacity = 0;    // keys a sequence can hold (paged: blocks per sequence · page_size)
  int page_size = 0;
  int seqlen_new = 0;
  int seqlen_q = 0;
  std::int64_t rotary_rows = -1;  // rows of rotary_cos; -1 = no rotary embedding

  FA_HOST_DEVICE bool any() const {
    return cu_seqlens_q != nullptr || cache_seqlens != nullptr || cache_batch_idx != nullptr || block_table != nullptr;
  }
};

namespace index_detail {

FA_HOST_DEVICE IndexViolation violation(IndexRule rule, IndexSide side, int b, int entry, long long value,
                                        long long bound) {
  IndexViolation v;
  v.rule = rule;
  v.side = side;
  v.batch = b;
  v.entry = entry;
  v.value = value;
  v.bound = bound;
  return v;
}

// One side of a varlen batch, sequence b.
FA_HOST_DEVICE IndexViolation check_cu_seqlens(const std::int32_t* cu, IndexSide side, int batch, int b, int max_len,
                                               std::int64_t total) {
  if (b == 0 && cu[0] != 0) return violation(IndexRule::cu_seqlens_start, side, 0, 0, cu[0], 0);
  const long long len = (long long)cu[b + 1] - cu[b];
  if (len < 0) return violation(IndexRule::cu_seqlens_decreasing, side, b, b + 1, cu[b + 1], cu[b]);
  if (len > max_len) return violation(IndexRule::max_seqlen_too_small, side, b, b, max_len, len);
  if (b == batch - 1 && total >= 0 && cu[batch] > total) {
    return violation(IndexRule::cu_seqlens_past_total, side, b, batch, cu[batch], total);
  }
  return {};
}

}  // namespace index_detail

// The checks below read only entry b of each index tensor (and b + 1 of cu_seqlens, cu_seqlens[0]
// for b = 0, the block_table entries of the pages sequence b uses), so that every sequence can be
// checked on its own, and its block_table entries by threads of their own.
//
// The rules of sequence b other than its block_table entries (check_block_table_entry); *len:
// the keys it reads, whose pages' entries are the ones to check.
FA_HOST_DEVICE IndexViolation check_sequence_scalars(const IndexBounds& ib, int b, long long* len_out) {
  using index_detail::violation;
  IndexViolation v;
  // Keys sequence b reads: a KV cache's after the append (the whole capacity without
  // cache_seqlens); a paged varlen sequence's seqused_k or cu_seqlens_k length.
  long long len = ib.capacity + ib.seqlen_new;
  if (ib.cu_seqlens_q != nullptr) {
    v = index_detail::check_cu_seqlens(ib.cu_seqlens_q, IndexSide::q, ib.batch, b, ib.max_seqlen_q, ib.total_q);
    if (v) return v;
    // cu_seqlens_k may be absent only with a paged K/V (then seqused_k gives the lengths).
    long long keys = ib.max_seqlen_k;
    if (ib.cu_seqlens_k != nullptr) {
      v = index_detail::check_cu_seqlens(ib.cu_seqlens_k, IndexSide::k, ib.batch, b, ib.max_seqlen_k, ib.total_k);
      if (v) return v;
      keys = (long long)ib.cu_seqlens_k[b + 1] - ib.cu_seqlens_k[b];
    }
    if (ib.seqused_k != nullptr) {
      const long long used = ib.seqused_k[b];
      if (used < 0 || (ib.cu_seqlens_k != nullptr && used > keys)) {
        return violation(IndexRule::seqused_k_range, IndexSide::k, b, b, used, keys);
      }
      // Without cu_seqlens_k nothing else bounds it: max_seqlen_k must (the mask and the CUDA
      // grid are sized by it).
      if (used > ib.max_seqlen_k) return violation(IndexRule::max_seqlen_too_small, IndexSide::k, b, b, ib.max_seqlen_k, used);
      keys = used;
    }
    if (ib.block_table != nullptr) {
      len = keys;
      if (len > ib.capacity) return violation(IndexRule::paged_keys_past_capacity, IndexSide::k, b, b, len, ib.capacity);
    }
  }
  if (ib.cache_seqlens != nullptr) {
    const long long before = ib.cache_seqlens[b];
    len = before + ib.seqlen_new;
    if (before < 0 || len > ib.capacity) {
      return violation(IndexRule::cache_seqlens_range, IndexSide::k, b, b, before, ib.capacity - ib.seqlen_new);
    }
    if (ib.cache_leftpad != nullptr && (ib.cache_leftpad[b] < 0 || ib.cache_leftpad[b] > before)) {
      return violation(IndexRule::cache_leftpad_range, IndexSide::k, b, b, ib.cache_leftpad[b], before);
    }
    const long long rotated_end = before + (ib.seqlen_q > ib.seqlen_new ? ib.seqlen_q : ib.seqlen_new);
    if (ib.rotary_rows >= 0 && rotated_end > ib.rotary_rows) {
      return violation(IndexRule::rotary_too_short, IndexSide::k, b, b, ib.rotary_rows, rotated_end);
    }
  }
  if (ib.cache_batch_idx != nullptr && (ib.cache_batch_idx[b] < 0 || ib.cache_batch_idx[b] >= ib.cache_rows)) {
    return violation(IndexRule::cache_batch_idx_range, IndexSide::k, b, b, ib.cache_batch_idx[b], ib.cache_rows);
  }
  *len_out = len;
  return {};
}

// The pages of sequence b's block_table row that hold its first len keys.
FA_HOST_DEVICE long long block_table_pages(const IndexBounds& ib, long long len) {
  return ib.block_table != nullptr && len > 0 ? (len + ib.page_size - 1) / ib.page_size : 0;
}

// Entry blk of sequence b's block_table row: a page of the cache.
FA_HOST_DEVICE IndexViolation check_block_table_entry(const IndexBounds& ib, int b, long long blk) {
  const std::int32_t page = ib.block_table[b * ib.block_table_batch_stride + blk];
  if (page < 0 || page >= ib.cache_rows) {
    return index_detail::violation(IndexRule::block_table_range, IndexSide::k, b, int(blk), page, ib.cache_rows);
  }
  return {};
}

// The first rule that sequence b breaks (check_sequence_scalars, then its block_table entries in
// order), or an IndexViolation that converts to false.
FA_HOST_DEVICE IndexViolation check_sequence_indices(const IndexBounds& ib, int b) {
  long long len = 0;
  const IndexViolation v = check_sequence_scalars(ib, b, &len);
  if (v) return v;
  const long long pages = block_table_pages(ib, len);
  for (long long blk = 0; blk < pages; ++blk) {
    const IndexViolation e = check_block_table_entry(ib, b, blk);
    if (e) return e;
  }
  return {};
}

// A check folded into the prologue of a call's first kernel instead of a kernel of its own (one
// launch less: most of the check's cost on a decoding step), src/cuda/index_check.h: every block of
// that kernel checks every sequence (the append kernel, the unsplit sm80 forward) or the one it
// reads (the split sm80 forward) and reads or writes nothing when one fails; the kernels after it
// read the flag as usual. record and mirror: the device's violation record and its mapped host
// mirror (cuda::IndexRecord, opaque here). Inactive (record null): the check, if any, runs as its
// own kernel.
struct IndexFold {
  IndexBounds bounds;
  void* record = nullptr;
  void* mirror = nullptr;
  FA_HOST_DEVICE bool active() const { return record != nullptr; }
};

}  // namespace flashattn::common
