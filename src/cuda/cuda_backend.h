// src/cuda/cuda_backend.h — the CUDA backends as the API layer sees them: "can you serve this
// call?" with a reason, and the call itself. Validation has already happened; every pointer in
// the params (tensors, cu_seqlens, block_table, ALiBi slopes) is device memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/params.h"

namespace flashattn::cuda {

// Whether a compiled forward kernel serves p; when not, *why_not (if given) says why and which
// build option or layout change would help.
bool can_serve_forward(const common::AttentionParams& p, std::string* why_not);

// Launches the forward kernel on `stream` (a cudaStream_t; nullptr = default stream). When
// rng_state is given it points to device memory holding {seed, offset} for dropout, read by the
// kernel at run time instead of p.dropout.seed / p.dropout.offset (CUDA-graph capture).
// Throws flashattn::Error when no kernel serves p or the launch fails.
void forward(const common::AttentionParams& p, void* stream,
             const std::uint64_t* rng_state = nullptr);

// --- backward --------------------------------------------------------------------------------

// Whether a compiled backward kernel serves p; when not, *why_not says why.
bool can_serve_backward(const common::AttentionParams& p, std::string* why_not);

// Device workspace of the backward, in bytes: a fp32 dQ accumulator of total_q_rows × heads ×
// head_dim (rounded up to 8) and, when p.deterministic, one int32 counter per (batch, head, row
// block). total_q_rows: b · sq, or total_q for varlen batches.
std::size_t backward_workspace_size(const common::AttentionParams& p, std::int64_t total_q_rows);

// Launches preprocess, main and postprocess kernels on `stream`. workspace: device memory of at
// least backward_workspace_size bytes, 256-byte aligned (the API layer checks both). rng_state as
// for forward.
void backward(const common::AttentionParams& p, std::int64_t total_q_rows, void* workspace, void* stream,
              const std::uint64_t* rng_state = nullptr);

// The head dims and dtypes compiled into this build, e.g. "sm80 fwd: f16/bf16 × d 64, 128, 256".
std::string compiled_kernels();

}  // namespace flashattn::cuda
