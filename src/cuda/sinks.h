// src/cuda/sinks.h — the gradient of the attention sinks (common/sink.h) on the device, for every
// kernel family's backward: dsinks_h = −Σ_{b,i} exp(s_h − lse_{b,h,i}) · softmax_d_{b,h,i}.
#pragma once

#include <cuda_runtime.h>

#include "common/params.h"

namespace flashattn::cuda {

// Launches one small kernel on `stream` that writes p.dsinks (nothing when it is null) from p.sinks,
// p.lse and p.softmax_d, which the backward's preprocess has written before on the same stream.
// One CTA per head sums its rows in a fixed order (per thread, then a tree): bitwise the same
// from run to run, deterministic mode or not. No query rows: dsinks = 0. Throws flashattn::Error
// when the launch fails.
void sink_gradient(const common::AttentionParams& p, cudaStream_t stream);

}  // namespace flashattn::cuda
