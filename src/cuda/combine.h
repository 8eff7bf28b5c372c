// src/cuda/combine.h — the combine kernel as the host sees it: merges partial attention results
// (fp32 out and lse) over disjoint key sets, with the numerics of src/cpu/combine.cpp. Serves the
// split-KV forward and flashattn::combine on CUDA tensors. Every pointer is device memory.
#pragma once

#include <cstdint>

#include "common/params.h"

namespace flashattn::cuda {

struct CombineParams {
  int splits = 0;
  int batch = 0;
  int heads = 0;
  int max_seqlen_q = 0;  // rows per batch entry of the partials
  int head_dim_v = 0;

  // Partials, fp32: out_partial (splits, b, max_seqlen_q, h, dv) with dv contiguous, lse_partial
  // (splits, b, h, max_seqlen_q) with the rows contiguous. Strides in elements.
  const float* out_partial = nullptr;
  std::int64_t out_partial_split_stride = 0;
  std::int64_t out_partial_batch_stride = 0;
  std::int64_t out_partial_row_stride = 0;
  std::int64_t out_partial_head_stride = 0;
  const float* lse_partial = nullptr;
  std::int64_t lse_partial_split_stride = 0;
  std::int64_t lse_partial_batch_stride = 0;
  std::int64_t lse_partial_head_stride = 0;

  // Results: out (b, sq, h, dv) in out_storage (f16, bf16 or f32), last dim contiguous; lse
  // (b, h, sq) fp32, optional. With cu_seqlens_q (varlen) sequence b has cu_seqlens_q[b + 1] −
  // cu_seqlens_q[b] rows, packed from row cu_seqlens_q[b] of out and lse; batch strides unused.
  common::RowHeadTensor out;
  common::Storage out_storage = common::Storage::f16;
  float* lse = nullptr;
  std::int64_t lse_batch_stride = 0;
  std::int64_t lse_head_stride = 0;
  const std::int32_t* cu_seqlens_q = nullptr;
  // Attention sinks (h) fp32 (common/sink.h), joined to each row's sum here: the split-KV
  // forward's partials are sink-free. nullptr: none (flashattn::combine takes none).
  const float* sinks = nullptr;
  // The index-check flag (AttentionParams::index_error): the kernel exits when it is set.
  const int* index_error = nullptr;
  // The kernel before this one on the stream wrote the partials (the split-KV forward;
  // combine_split_partials sets it). Unless FLASHATTN_COMBINE_PDL=0 (read per call; src/cuda/README.md,
  // tuning knobs) the combine is then launched as that kernel's programmatic dependent on sm_90 and
  // newer: its blocks start while that kernel's last ones still run and wait for it
  // (griddepcontrol.wait) before reading the partials and the flag. Otherwise the usual launch.
  bool after_primary = false;
};

// Launches the combine kernel on `stream` (a cudaStream_t; nullptr = default stream). Per row:
// lse = log Σ_s exp(lse_s) over the splits with finite lse_s (+∞ marks a split that saw no key,
// −∞ is skipped too) and, with sinks, exp(sink) of the row's head, out = Σ_s exp(lse_s − lse) ·
// out_s in split order; a row with no finite split gets out = 0 and lse = +∞ (the sink, with
// sinks); a split whose lse is NaN makes the row's out and lse NaN. Throws flashattn::Error when the launch fails.
void combine(const CombineParams& c, void* stream);

}  // namespace flashattn::cuda
