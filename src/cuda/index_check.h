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
