// src/cuda/uncovered.h — the rows of a varlen batch that no sequence covers, on the device: the
// CUDA counterpart of src/cpu/uncovered.cpp (docs/errors.md). Forward: out = 0, lse = +∞;
// backward: dq = dk = dv = 0, softmax_d = 0, for packed rows past cu_seqlens_q[b] (q side) and
// cu_seqlens_k[b] (k side), and dk = dv = 0 for the keys of each sequence past seqused_k.
#pragma once

#include <cstdint>

#include "common/params.h"

namespace flashattn::cuda {

// Launches one small kernel on `stream` (nothing in dense mode). It reads cu_seqlens[b] on the
// device, so the common case of no such rows costs one launch and one load per thread.
void fill_uncovered_rows(const common::AttentionParams& p, std::int64_t total_q, std::int64_t total_k, bool backward,
                         void* stream);

}  // namespace flashattn::cuda
