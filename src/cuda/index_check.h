// src/cuda/index_check.h — index values in device memory (cu_seqlens, seqused_k, cache_seqlens,
// cache_batch_idx, block_table, rotary positions), checked on the device with the rules of
// src/common/index_check.h before any kernel reads them.
//
// A call with index tensors launches check_indices first: one thread per sequence, on the call's
// stream. The first violation is recorded per device, in device memory (whose address the kernels
// get as AttentionParams::index_error / CombineParams::index_error: every kernel that reads an
// index exits at its start when the record is set, so nothing is read or written outside the
// caller's tensors) and in mapped host memory. The host learns of it (a) synchronously, when the
// call asked for it (Options::check_indices or FLASHATTN_CHECK_INDICES=1: the stream is waited
// for), (b) at the start of any later CUDA call on the device once the check has run, or (c) from
// flashattn::check_index_errors(), which waits for the device. The record is then cleared.
#pragma once

#include "common/index_check.h"

namespace flashattn::cuda {

// One violation as the device records it, plain data (a __device__ variable cannot have
// constructors). state: 0 none, 1 recorded (set by the first thread that finds one; the others
// leave the record alone).
struct IndexRecord {
  int state;
  int rule, side, batch, entry, api;
  long long value, bound;
};

// The check folded into the prologue of the call's first kernel (common::IndexFold; its record
// and mirror are this device's IndexRecord and the record's mapped host copy): checked there by
// index_check.cuh's index_check_passes. Folded into the KV-cache append kernel where that kernel
// runs, else into the sm80 forward kernel (AttentionParams::index_fold) where that family runs the
// call's attention. A paged cache's check folds into the split forward only (each block checking
// its share of a sequence's pages); where the sm80 family runs such a call unsplit, it launches
// the check kernel instead (sm80::forward).
using common::IndexFold;

// The most sequences a folded check takes: one pass of a 256-thread block.
inline constexpr int kIndexFoldMaxBatch = 256;

// Whether `ib`'s check may be folded into a kernel's prologue: at most kIndexFoldMaxBatch
// sequences, no block table (a sequence's pages are a loop of their own), and not turned off by
// FLASHATTN_INDEX_CHECK_FOLD=0 (read per call; src/cuda/README.md, tuning knobs).
bool index_check_foldable(const common::IndexBounds& ib);

// Whether `ib`'s check, with a block table, may be folded into the sm80 split forward (any
// number of sequences: each has blocks of its own); not with FLASHATTN_INDEX_CHECK_FOLD=0.
bool index_check_foldable_paged(const common::IndexBounds& ib);

// The fold of `ib`'s check on the current device (the caller has decided it is foldable).
IndexFold fold_index_check(const common::IndexBounds& ib);

// The current device's violation flag in device memory (non-zero: a check failed), for the
// kernels' early exit.
const int* index_error_flag();

// Launches the check of every sequence of `ib` on `stream` (nothing when ib has no index tensor).
void check_indices(const common::IndexBounds& ib, void* stream);

// Waits for `stream` and takes the current device's violation (clearing it); none when the check
// passed.
common::IndexViolation take_index_violation(void* stream);

// A violation of an earlier call on the current device that has reached the host, taken (cleared);
// none otherwise. Does not wait for anything unless there is a violation to clear.
common::IndexViolation take_pending_index_violation();

// Waits for the current device and takes its violation (cleared); none when there is none.
common::IndexViolation take_device_index_violation();

}  // namespace flashattn::cuda
