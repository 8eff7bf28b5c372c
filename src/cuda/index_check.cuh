// src/cuda/index_check.cuh — the device side of the index check (index_check.h): recording a
// violation, and the check folded into a kernel's prologue (IndexFold).
#pragma once

#include "cuda/index_check.h"

namespace flashattn::cuda {

// Records v in the device's record and its host mirror, unless a violation is recorded already.
__device__ inline void record_index_violation(IndexRecord* record, IndexRecord* mirror, const common::IndexViolation& v,
                                              int api) {
  if (atomicCAS(&record->state, 0, 1) != 0) return;
  const IndexRecord r{1, int(v.rule), int(v.side), v.batch, v.entry, api, v.value, v.bound};
  *record = r;
  // The host reads the mirror without synchronising: its fields first, then the state.
  mirror->rule = r.rule, mirror->side = r.side, mirror->batch = r.batch, mirror->entry = r.entry, mirror->api = r.api;
  mirror->value = r.value, mirror->bound = r.bound;
  __threadfence_system();
  *reinterpret_cast<volatile int*>(&mirror->state) = 1;
}

// A folded check, by all threads of a block together (a block-wide barrier): every sequence of
// f.bounds checked by the block's threads, a violation recorded; true when all passed. Each block
// of the kernel checks every sequence itself, so no block depends on another's finding.
__device__ inline bool index_check_passes(const IndexFold& f) {
  int failed = 0;
  for (int b = int(threadIdx.x); b < f.bounds.batch; b += int(blockDim.x)) {
    const common::IndexViolation v = common::check_sequence_indices(f.bounds, b);
    if (v) {
      failed = 1;
      record_index_violation(static_cast<IndexRecord*>(f.record), static_cast<IndexRecord*>(f.mirror), v,
                             int(f.bounds.api));
    }
  }
  return __syncthreads_or(failed) == 0;
}

// index_check_passes as a call rather than inlined: for kernels whose registers are tight (the
// sm80 forward), so that the check's code does not weigh on their register allocation.
static __device__ __noinline__ bool index_check_passes_call(const IndexFold& f) { return index_check_passes(f); }

// The folded check of sequence b alone, for a kernel whose blocks each read the indices of one
// sequence only and write nothing but scratch that a later kernel reads after the flag (the sm80
// split-KV forward: blockIdx.z; its combine writes the output): every thread checks b (the same
// few loads, served together) and thread 0 records a violation; true when b passed and no earlier
// kernel flagged one (`flag`: the device's violation flag, or null). The flag is read beside b's
// indices rather than before them, so that the two trips to memory overlap. No block barrier: no
// block depends on another's finding, and every sequence has blocks of its own. Inlined: a call
// to code elsewhere is one more instruction fetch from memory at the kernel's start.
__device__ __forceinline__ bool index_check_sequence_passes(const IndexFold& f, int b, const int* flag) {
  const int earlier = flag != nullptr ? *flag : 0;
  const common::IndexViolation v = common::check_sequence_indices(f.bounds, b);
  if (v && threadIdx.x == 0) {
    record_index_violation(static_cast<IndexRecord*>(f.record), static_cast<IndexRecord*>(f.mirror), v,
                           int(f.bounds.api));
  }
  return !v && earlier == 0;
}

// Entry blk of sequence b's block_table row, and whether a page number leaves the cache.
__device__ __forceinline__ std::int32_t table_entry(const IndexFold& f, int b, long long blk) {
  return f.bounds.block_table[b * f.bounds.block_table_batch_stride + blk];
}
__device__ __forceinline__ bool page_outside_cache(const IndexFold& f, std::int32_t page) {
  return page < 0 || page >= f.bounds.cache_rows;
}
// The error path of the paged check (below): entry `found` of sequence b is bad, or the last of
// a range that holds a bad one; the first bad entry at or before it (what the host's check names)
// is looked for and recorded. Every thread that finds a bad entry of b records the same one,
// whichever block it is in.
static __device__ __noinline__ void record_first_bad_entry(const IndexFold& f, int b, long long found) {
  long long first = found;
  constexpr int kUnroll = 8;
  for (long long base = 0; base < first; base += kUnroll) {
    std::int32_t page[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      page[u] = base + u < first ? table_entry(f, b, base + u) : 0;
    }
    bool bad = false;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (!bad && base + u < first && page_outside_cache(f, page[u])) first = base + u, bad = true;
    }
    if (bad) break;
  }
  record_index_violation(static_cast<IndexRecord*>(f.record), static_cast<IndexRecord*>(f.mirror),
                         common::check_block_table_entry(f.bounds, b, first), int(f.bounds.api));
}

// Sequence b's rules other than its block_table entries, checked by every thread of a block alike
// (thread 0 records a violation); *len: the keys it reads.
__device__ __forceinline__ bool sequence_scalars_pass(const IndexFold& f, int b, long long* len) {
  const common::IndexViolation v = common::check_sequence_scalars(f.bounds, b, len);
  if (v && threadIdx.x == 0) {
    record_index_violation(static_cast<IndexRecord*>(f.record), static_cast<IndexRecord*>(f.mirror), v,
                           int(f.bounds.api));
  }
  return !v;
}

// The folded check of a paged cache's sequence b in the sm80 split forward, by each block that
// reads b. In the prologue (index_check_paged_sequence_passes), every thread checks b's rules other
// than its block_table entries — the loads the kernel makes anyway for its key count, so nothing
// waits longer for them — and a violation ends the block's work, thread 0 recording it; true when
// they passed and no earlier kernel flagged a violation (`flag`, read beside them). The entries
// are checked where the kernel reads them: each K/V row's page number is compared as it is looked
// up (and clamped into the cache, so a bad one leads nowhere outside it), and a block that saw a
// bad one records the sequence's first (record_first_bad_entry) after its main loop; the entries
// of pages that no block reads (outside the mask's visible keys) are checked by the row block's
// first split (index_check_entries). What such a kernel writes is partials that the combine,
// reading the flag, then leaves uncombined; no block waits for another's finding.
__device__ __forceinline__ bool index_check_paged_sequence_passes(const IndexFold& f, int b, const int* flag) {
  const int earlier = flag != nullptr ? *flag : 0;
  long long len = 0;
  if (!sequence_scalars_pass(f, b, &len)) return false;
  return earlier == 0;
}

// Sequence b's block_table entries [begin, end), by the block's threads, an entry each in turn; a
// bad one makes its thread record the sequence's first.
__device__ __forceinline__ void index_check_entries(const IndexFold& f, int b, long long begin, long long end) {
  for (long long blk = begin + threadIdx.x; blk < end; blk += blockDim.x) {
    if (page_outside_cache(f, table_entry(f, b, blk))) {
      record_first_bad_entry(f, b, blk);
      break;
    }
  }
}

}  // namespace flashattn::cuda
