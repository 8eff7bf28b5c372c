// flashattn/options.h — the ONE options struct shared by every entry point (SPEC §4).
#pragma once

#include <cstdint>

#include "flashattn/tensor.h"

namespace flashattn {

// Which implementation serves a call. `automatic` picks the fastest backend that can serve the
// call on the tensors' device (CUDA tensors → CUDA kernels, host tensors → the CPU flash backend).
enum class Backend : std::uint8_t {
  automatic,
  cpu,            // the tiled CPU flash backend (threads; memory O(tiles))
  cpu_reference,  // the naive fp64 reference (materialises scores; the test oracle)
  cuda,
};

const char* backend_name(Backend backend);

struct Options {
  // Scores are softmax_scale · q·k; 0 means 1/sqrt(d).
  float softmax_scale = 0.0f;
  // Bottom-right aligned causal mask; the same as window_right = 0.
  bool causal = false;
  // Sliding window: key j is visible to query i iff j ≥ r − window_left and j ≤ r + window_right,
  // r = i + seqlen_k − seqlen_q. −1 means unbounded on that side.
  int window_left = -1;
  int window_right = -1;
  // Soft-capping: s = softcap · tanh(s / softcap) when softcap > 0.
  float softcap = 0.0f;
  // ALiBi slopes, fp32, shape (h) or (b, h); s −= slope · |i + seqlen_k − seqlen_q − j|.
  TensorView alibi_slopes = {};
  // Dropout probability in [0, 1). The mask is a pure function of (seed, offset, batch, head,
  // i, j): see docs/dropout.md.
  float dropout_p = 0.0f;
  std::uint64_t dropout_seed = 0;
  std::uint64_t dropout_offset = 0;
  // Optional {seed, offset} pair in memory on the tensors' device, read at run time instead of
  // dropout_seed / dropout_offset (this lets a captured CUDA graph replay with new randomness).
  const std::uint64_t* dropout_rng_state = nullptr;
  // Where this call's query rows and keys sit in a longer sequence whose mask to draw: query row
  // i and key j take the mask of (dropout_row_offset + i, dropout_col_offset + j) (context
  // parallelism computes one attention in blocks). Multiples of 16 (the mask's block size), ≥ 0.
  std::int64_t dropout_row_offset = 0;
  std::int64_t dropout_col_offset = 0;
  // Backward: bitwise identical results from run to run (and across thread counts on the CPU).
  bool deterministic = false;
  // Forward: write lse (when false, the lse view may be left undefined).
  bool return_lse = true;
  Backend backend = Backend::automatic;
  // CPU backends: worker threads; 0 = std::thread::hardware_concurrency().
  int num_threads = 0;
  // CUDA forward (and forward_kvcache): split-KV, the key tiles of each row block spread over this
  // many CTAs and merged by a combine kernel. 0 = a heuristic decides; 1 = never split; n ≥ 2 = n
  // splits (at most 128). Splitting needs the workspace that *_workspace_size reports for the same
  // options; without it the forward runs unsplit. Ignored by the CPU backends.
  int num_splits = 0;
  // CUDA calls with index tensors (varlen cu_seqlens / seqused_k, KV-cache cache_seqlens,
  // cache_batch_idx, block_table, rotary tables): the values are checked on the device and a bad
  // one stops every kernel of the call before it reads or writes anything. When true (or when the
  // environment has FLASHATTN_CHECK_INDICES=1) the call waits for its stream and throws the
  // violation as flashattn::Error; otherwise the next CUDA call on the device that finds it
  // recorded throws it, and flashattn::check_index_errors() waits for it (docs/errors.md).
  bool check_indices = false;
};

}  // namespace flashattn
