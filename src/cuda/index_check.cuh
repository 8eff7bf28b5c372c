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

}  // namespace flashattn::cuda
