// src/cuda/kvcache_append.h — the KV-cache call's work before attention, on CUDA tensors: append
// k_new/v_new into the cache in place (k rotated), rotate q, and the lengths after the append.
// Same definitions as the CPU backend (src/common/kvcache.h, rotary.h), bit for bit.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/index_check.h"
#include "common/kvcache.h"
#include "common/params.h"

namespace flashattn::cuda {

// The KV-cache region of forward_kvcache's device workspace. It sits at the start of the
// workspace; what the attention itself needs follows at offset `bytes`. Offsets and size are
// multiples of 256 bytes.
struct KvcacheWorkspace {
  bool appends = false;           // holds the lengths after the append
  bool rotary = false;            // holds the rotated q
  std::size_t seqlens_after = 0;  // offset of int32 (b): cache_seqlens + sk_new
  std::size_t q_rotated = 0;      // offset of (b, sq, h, d), contiguous, in q's dtype
  std::size_t bytes = 0;          // the region's size; 0 when the call needs neither part
};

// The region for a call with `batch` sequences and q of q_elements elements of element_bytes each;
// appends: k_new is given; rotary: rotary_cos/sin are given. Only shapes decide it, so the size
// query and the call agree.
KvcacheWorkspace kvcache_workspace(std::int64_t batch, std::int64_t q_elements, std::size_t element_bytes,
                                   bool appends, bool rotary);

// Launches the append and the q rotation on `stream` (one kernel), then points p at what the
// attention must read: p.cache_seqlens at the lengths after the append (when appending; otherwise
// at a.cache_seqlens) and p.q at the rotated copy (with rotary). `region` is kvcache_workspace of
// this call; workspace: device memory holding it, 256-byte aligned (the API layer checks both).
// Validation has already happened on the host; the index VALUES in device memory are checked here
// first, when `check` has index tensors (index_check.h): where index_check_foldable allows it,
// folded into the append kernel's prologue when that kernel runs, else — when no kernel runs here
// and forward_folds (the caller's attention runs in the sm80 forward kernel, which checks
// p.index_fold) — into the attention's (p.index_fold; with a block table where
// index_check_foldable_paged allows it, the sm80 family then folding it into its split kernel or
// launching the check kernel ahead of an unsplit one); otherwise by check_indices before anything
// else. Throws flashattn::Error when a launch fails.
void kvcache_append(common::AttentionParams& p, const common::AppendArgs& a, bool q_positions_per_row,
                    const KvcacheWorkspace& region, void* workspace, void* stream, const common::IndexBounds& check,
                    bool forward_folds = false);

}  // namespace flashattn::cuda
