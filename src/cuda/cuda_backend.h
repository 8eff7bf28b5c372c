// src/cuda/cuda_backend.h — the CUDA backends as the API layer sees them: "can you serve this
// call?" with a reason, and the call itself. Validation has already happened; every pointer in
// the params (tensors, cu_seqlens, block_table, ALiBi slopes) is device memory.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/params.h"
#include "cuda/combine.h"
#include "cuda/family.h"
#include "cuda/split_kv.h"

namespace flashattn::cuda {

// Whether a compiled forward kernel serves p; when not, *why_not (if given) says why and which
// build option or layout change would help.
bool can_serve_forward(const common::AttentionParams& p, std::string* why_not);

// Launches the forward kernel on `stream` (a cudaStream_t; nullptr = default stream). When
// rng_state is given it points to device memory holding {seed, offset} for dropout, read by the
// kernel at run time instead of p.dropout.seed / p.dropout.offset (CUDA-graph capture).
// workspace: optional device memory for split-KV (see forward_workspace_size); the call splits
// only when the workspace holds the partials of the chosen number of splits, and otherwise runs
// unsplit — it never fails for lack of workspace.
// Throws flashattn::Error when no kernel serves p or a launch fails.
void forward(const common::AttentionParams& p, void* stream, const std::uint64_t* rng_state = nullptr,
             void* workspace = nullptr, std::size_t workspace_bytes = 0);

// The same with the kernel family already chosen (choose_forward_family(p), family.h): the API
// layer chooses once per call, where it asks can_serve_forward's question, and runs that choice
// (each choice asks the device and both families).
void forward(const FamilyChoice& choice, const common::AttentionParams& p, void* stream,
             const std::uint64_t* rng_state, void* workspace, std::size_t workspace_bytes);

// The split-KV workspace the forward would use on p with the family already chosen (what
// forward_workspace_size counts, without choosing again): 0 when it runs unsplit.
std::size_t forward_workspace_size(const FamilyChoice& choice, const common::AttentionParams& p);

// --- split-KV ----------------------------------------------------------------------------------
// Decoding (few query rows, long contexts) gives one CTA per (row block, head, batch) too few CTAs
// to fill the GPU; split-KV spreads each one's key tiles over several CTAs, which write fp32
// partials into the workspace, and the combine kernel (cuda/combine.h) merges them.

inline constexpr int kMaxSplits = 128;

// The number of splits that fills `slots` concurrent CTA places best when `ctas` CTAs each walk
// `n_blocks` key tiles (a pure function; 1 = do not split). Splitting pays only while the grid is
// short of one wave: at ≥ 80 % of the slots it returns 1. Otherwise, with waves(s) = ctas · s /
// slots and efficiency(s) = waves(s) / ⌈waves(s)⌉ (the busy fraction of the last wave), it
// returns the smallest s ≤ min(max_splits, slots, n_blocks) whose efficiency is within 85 % of
// the best — more splits only add partials to combine — skipping any s that leaves
// ⌈n_blocks / s⌉, the tiles of the longest split, where s − 1 had it.
// Example (H200: 132 SMs, 2 CTAs each = 264 slots): b = 2, h = 16, sq = 1 at 8192 keys of d 128
// is 32 CTAs of 128 tiles. The best efficiency is 256/264 = 0.97 (s = 8, 16, 32, …; s = 33 would
// fill the slots exactly but leaves 4 tiles per split, as s = 32 does, so it is skipped); s = 7
// reaches 224/264 = 0.85 ≥ 0.85 · 0.97: 7 splits, 224 CTAs of at most 19 tiles, one wave.
int num_splits_heuristic(std::int64_t ctas, int n_blocks, int slots, int max_splits);

// The key tiles (of block_n keys) that the widest row block of p sees, row blocks of block_m rows
// of a kernel that packs `pack` query heads per row (packed row r is query row r / pack): with a
// bottom-right aligned causal mask the last block sees the most keys; with a window (or sq > sk)
// the first can, so both ends are asked. p has at least one query row.
int widest_row_block_key_tiles(const common::AttentionParams& p, int block_m, int block_n, int pack);

// The number of splits the forward of p uses on the current device when the workspace suffices,
// as the kernel family that runs it plans them (1: that family does not split p; the sm80 family:
// p.num_splits when > 0, at most kMaxSplits, else num_splits_heuristic over the SMs of the device
// and the key tiles the widest row block of p sees).
int forward_num_splits(const common::AttentionParams& p);

// The partials of `splits` splits in a workspace, as flashattn::combine takes them: fp32 out
// (splits, b, sq, h, dv), then lse (splits, b, h, sq), each region 256-byte aligned.
struct SplitPartialsLayout {
  std::size_t out_bytes = 0;
  std::size_t lse_bytes = 0;
};
SplitPartialsLayout split_partials_layout(const common::AttentionParams& p, int splits);

// The partials of `splits` splits carved out of a forward's workspace (a misaligned workspace is
// used from its first aligned byte on): num_splits 1 and no pointers when splits ≤ 1 or the
// workspace does not hold them (the forward then runs unsplit).
SplitKvPartials carve_split_partials(const common::AttentionParams& p, int splits, void* workspace,
                                     std::size_t workspace_bytes);

// Merges such partials into p.out and p.lse on `stream` (the combine kernel).
void combine_split_partials(const common::AttentionParams& p, float* out_partial, float* lse_partial, int splits,
                            cudaStream_t stream);

// Device workspace the forward of p can use, in bytes: fp32 out and lse partials for
// forward_num_splits(p) splits (0 when that is 1), each region 256-byte aligned. Reads only
// shapes and options (batch, heads, max_seqlen_q/k, head dims, mask, softcap / ALiBi / dropout,
// num_splits).
std::size_t forward_workspace_size(const common::AttentionParams& p);

// --- backward --------------------------------------------------------------------------------

// Whether a compiled backward kernel serves p; when not, *why_not says why.
bool can_serve_backward(const common::AttentionParams& p, std::string* why_not);

// Device workspace of the backward, in bytes: a fp32 dQ accumulator of total_q_rows × heads ×
// head_dim (rounded up to 8) and, when p.deterministic, one int32 counter per (batch, head, row
// block). total_q_rows: b · sq, or total_q for varlen batches.
std::size_t backward_workspace_size(const common::AttentionParams& p, std::int64_t total_q_rows);
// Before the call's tensors are known (the public size query reads shapes and options only): the
// largest workspace among the kernel families with a kernel for p's dtype and head dims, so that
// whichever family the call's layouts lead to finds enough (backward_workspace_size ≤ this).
std::size_t backward_workspace_bound(const common::AttentionParams& p, std::int64_t total_q_rows);

// Launches preprocess, main and postprocess kernels on `stream`. workspace: device memory of at
// least backward_workspace_size bytes, 256-byte aligned (the API layer checks both). rng_state as
// for forward.
void backward(const common::AttentionParams& p, std::int64_t total_q_rows, void* workspace, void* stream,
              const std::uint64_t* rng_state = nullptr);

// The head dims and dtypes compiled into this build, e.g. "sm80 fwd: f16/bf16 × d 64, 128, 256".
std::string compiled_kernels();

}  // namespace flashattn::cuda
