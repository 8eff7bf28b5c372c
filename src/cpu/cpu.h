// src/cpu/cpu.h — the CPU backends behind the API layer. Each function reads and writes tensors
// only through common::AttentionParams (src/common/params.h), so dense, varlen and paged batches
// share one code path. Validation has already happened: these functions trust their input.
#pragma once

#include "common/kvcache.h"
#include "common/params.h"

namespace flashattn::cpu {

// How the reference computes.
enum class RefPrecision {
  fp64,               // the oracle: fp64 everywhere, from the stored low-precision inputs
  emulate_storage,    // "naive_lowprec" of SPEC §7: fp32 math, every materialised intermediate
                      // (scores, probabilities, products, gradients) rounded to the input dtype
};

// Where the reference puts its results when the caller wants them unrounded (tests): fp64 arrays
// indexed by the SAME element offsets as the corresponding output tensors of the params
// (q_offset(p.out, ...), lse_index(...), k_offset(p.dk, ...)), so size each like that tensor's
// storage. When a sink is given, the reference writes there instead of into the params' outputs.
struct Fp64Outputs {
  double* out = nullptr;
  double* lse = nullptr;
  double* dq = nullptr;
  double* dk = nullptr;
  double* dv = nullptr;
  double* softmax_d = nullptr;
  double* dsinks = nullptr;  // (h)
};

// Naive attention: materialises each (sq × sk) score matrix of one (batch, head).
// Forward writes out and lse (lse may be null). num_threads: (batch, head) pairs — in the
// backward (batch, kv head) pairs — computed at once, at most; the results are the same for any
// count (each pair writes only its own rows, and the sinks' gradient is summed over the batch in
// order).
void reference_forward(const common::AttentionParams& p, RefPrecision precision = RefPrecision::fp64,
                       const Fp64Outputs* sink = nullptr, int num_threads = 1);
// Backward writes dq, dk, dv, softmax_d (and dsinks when p.dsinks is set). It recomputes the
// forward itself (it does not read p.out or p.lse), so it is the exact gradient of the function
// SPEC §2 defines.
void reference_backward(const common::AttentionParams& p,
                        RefPrecision precision = RefPrecision::fp64,
                        const Fp64Outputs* sink = nullptr, int num_threads = 1);

// The tiled CPU flash backend: online softmax forward, recomputing backward, threads over
// (batch, head, row blocks), memory O(tiles), deterministic for any num_threads (≥ 1).
void flash_forward(const common::AttentionParams& p, int num_threads);
void flash_backward(const common::AttentionParams& p, int num_threads);

// Varlen: the packed rows past cu_seqlens_q[b] (of q, out, dq) and past cu_seqlens_k[b] (of k, v,
// dk, dv) that no sequence covers. Forward: out = 0, lse = +∞; backward: dq = dk = dv = 0,
// softmax_d = 0. total_q / total_k: the packed row counts. Nothing to do in dense mode.
void fill_uncovered_rows(const common::AttentionParams& p, std::int64_t total_q, std::int64_t total_k, bool backward);

}  // namespace flashattn::cpu

namespace flashattn::cpu {

// KV cache, before attention: appends k_new/v_new into the cache, rotating k (common::AppendArgs
// says what and where).
using common::AppendArgs;
void append_kv(const common::AttentionParams& p, const AppendArgs& a);

// Rotates q (b, sq, h, d) into q_rotated (contiguous, same dtype) for the KV-cache call: row i of
// sequence b sits at position cache_seqlens[b] + i when the mask is causal or windowed, else all
// rows at cache_seqlens[b] (the reference API's convention).
void rotate_q(const common::AttentionParams& p, const AppendArgs& a, bool positions_per_row, void* q_rotated);

// Merges partial (out, lse) over splits: out (b, sq, h, dv) in out_storage, lse (b, h, sq) or null.
struct CombineArgs {
  const float* out_partial = nullptr;  // (splits, b, sq, h, dv)
  std::int64_t op_strides[5] = {};
  const float* lse_partial = nullptr;  // (splits, b, h, sq) contiguous
  void* out = nullptr;
  std::int64_t out_strides[4] = {};
  common::Storage out_storage = common::Storage::f32;
  float* lse = nullptr;  // (b, h, sq) contiguous, optional
  int splits = 0, batch = 0, seqlen_q = 0, heads = 0, head_dim_v = 0;
};
void combine(const CombineArgs& a);

}  // namespace flashattn::cpu
