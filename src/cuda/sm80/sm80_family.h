// src/cuda/sm80/sm80_family.h — the sm80 (portable) kernel family as the CUDA backend sees it:
// which calls it serves, its split-KV planning, its backward workspace, and the calls themselves.
// The generic files (cuda_backend.cu, cuda_bwd.cu, family.cu) reach the sm80 kernels only here.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/params.h"

namespace flashattn::cuda::sm80 {

// Why this family does not serve the forward of p on the current device ("" when it does);
// *head_dim receives the instantiated head dim that runs it.
std::string forward_refusal(const common::AttentionParams& p, int* head_dim);

// The number of splits of the key tiles the forward of p uses when a workspace holds their
// partials: p.num_splits when > 0 (at most kMaxSplits), else cuda::num_splits_heuristic over the
// SMs of the device and the key tiles the widest row block sees in the tile the call runs with.
int forward_num_splits(const common::AttentionParams& p);

// The GQA packing the forward of p runs with (fwd_pack): g when one CTA serves the g query heads
// of a kv head (decoding: short queries, the plain variant), else 1.
int forward_pack(const common::AttentionParams& p);

// The forward of p in the instantiated head dim `head_dim` (forward_refusal said yes): split-KV
// when forward_num_splits(p) > 1 and `workspace` holds the partials, unsplit otherwise.
void forward(const common::AttentionParams& p, int head_dim, const std::uint64_t* rng_state, void* workspace,
             std::size_t workspace_bytes, cudaStream_t stream);

// The backward's answer, workspace (a fp32 dQ accumulator, deterministic counters) and call.
std::string backward_refusal(const common::AttentionParams& p);
std::size_t backward_workspace_size(const common::AttentionParams& p, std::int64_t total_q_rows);
void backward(const common::AttentionParams& p, std::int64_t total_q_rows, void* workspace, cudaStream_t stream,
              const std::uint64_t* rng_state);

// The kernels compiled into this build, e.g. "sm80 fwd: f16 d 64, 128, 256, bf16 d …; …".
std::string compiled_kernels();

}  // namespace flashattn::cuda::sm80
