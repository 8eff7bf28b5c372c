// flashattn/flashattn.h — the public C++ API: forward, backward, forward with KV cache, combine.
//
// Every entry point takes non-owning views of caller-owned memory, one Options struct and a
// stream. It validates the call completely before writing anything (SPEC §5): a bad call throws
// flashattn::Error and leaves every output untouched.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "flashattn/error.h"
#include "flashattn/options.h"
#include "flashattn/tensor.h"

namespace flashattn {

// Variable-length batches: sequences packed along the first dimension. Given cu_seqlens_q makes a
// call varlen; then q is (total_q, h, d), k/v (total_k, hk, d/dv), out (total_q, h, dv) and
// lse (h, total_q).
struct Varlen {
  TensorView cu_seqlens_q;  // (b + 1) int32, prefix sums starting at 0
  TensorView cu_seqlens_k;  // (b + 1) int32; optional with a paged K/V (ForwardInputs::block_table)
  TensorView seqused_k;     // optional (b) int32: use only the first seqused_k[i] keys
  int max_seqlen_q = 0;
  int max_seqlen_k = 0;
  bool enabled() const { return cu_seqlens_q.defined(); }
};

// Attention sinks (docs/sinks.md): an optional per-head logit s_h that joins every row's softmax
// denominator and carries no value: lse_i = log(exp(s_h) + Σ_j exp(s_ij)), p_ij = exp(s_ij − lse_i).
// s_h is in the units of the scores (not multiplied by softmax_scale); −∞ is the same as no sink.

struct ForwardInputs {
  TensorView q;  // (b, sq, h, d)   or varlen (total_q, h, d)
  TensorView k;  // (b, sk, hk, d)  or varlen (total_k, hk, d)  or paged (num_blocks, page_size, hk, d)
  TensorView v;  // (b, sk, hk, dv) or varlen (total_k, hk, dv) or paged (num_blocks, page_size, hk, dv)
  Varlen varlen = {};
  // Paged prefill (varlen calls only; forward only): optional (b, max_blocks_per_seq) int32. Given,
  // k/v are paged caches and row i lists the pages of sequence i in order (key j of sequence i is
  // row j % page_size of page block_table[i][j / page_size]). The key count of sequence i is
  // varlen.seqused_k[i], or cu_seqlens_k[i + 1] − cu_seqlens_k[i] without seqused_k (one of the
  // two is required; with both, seqused_k[i] must not exceed that difference). Keys are at most
  // varlen.max_seqlen_k and max_blocks_per_seq · page_size per sequence.
  TensorView block_table = {};
  TensorView sinks = {};  // optional (h) fp32, contiguous, on q's device: the sink logit of each query head
  // FP8 (q, k and v all DType::f8e4m3; no backward): optional (b, hk) fp32 descale factors on
  // q's device, any strides, as FlashAttention-3 takes them — the attention is that of
  // q_descale[b][g]·q, k_descale[b][g]·k and v_descale[b][g]·v for the query heads of K/V head g
  // (absent: 1). out is then bf16 or f16. The CPU backends serve FP8 calls; CUDA refuses them.
  TensorView q_descale = {};
  TensorView k_descale = {};
  TensorView v_descale = {};
};

struct ForwardOutputs {
  TensorView out;  // (b, sq, h, dv) or varlen (total_q, h, dv), q's dtype (FP8 inputs: bf16 or f16)
  TensorView lse;  // (b, h, sq)     or varlen (h, total_q), fp32; optional if !return_lse
};

struct BackwardInputs {
  TensorView dout;  // like out
  TensorView q, k, v;
  TensorView out;
  TensorView lse;  // fp32, as written by forward (with the sinks, when the forward had them)
  Varlen varlen = {};
  TensorView sinks = {};  // optional (h) fp32: the forward's sinks (required when dsinks is given)
};

struct BackwardOutputs {
  TensorView dq;         // like q
  TensorView dk;         // like k
  TensorView dv;         // like v
  TensorView softmax_d;  // (b, h, sq) or varlen (h, total_q), fp32: rowsum(dout ∘ out)
  // optional (h) fp32, contiguous: the gradient of the sinks, −Σ over batch and rows of
  // exp(s_h − lse) · softmax_d, overwritten (not accumulated into). Needs BackwardInputs::sinks.
  TensorView dsinks = {};
};

// Decoding / chunked prefill against a KV cache (the reference API's fwd_kvcache).
// Without block_table the cache is (b_cache, sk_cache, hk, d); with it the cache is paged:
// (num_blocks, page_size, hk, d) and block_table (b, max_blocks_per_seq) int32 lists each
// sequence's pages. Sequence i attends to cache_seqlens[i] + sk_new keys.
struct KVCacheInputs {
  TensorView q;                // (b, sq, h, d)
  TensorView k_cache;          // (b_cache, sk_cache, hk, d) or paged (num_blocks, page_size, hk, d)
  TensorView v_cache;          // likewise with dv
  TensorView k_new;            // optional (b, sk_new, hk, d): appended in place at cache_seqlens
  TensorView v_new;            // optional (b, sk_new, hk, dv)
  TensorView cache_seqlens;    // optional (b) int32; absent = the whole cache is valid
  TensorView cache_batch_idx;  // optional (b) int32: the cache row of each batch entry
  // optional (b) int32, left padding: the keys of sequence i start at row cache_leftpad[i] of its
  // cache row (rows before it are not attended to; 0 ≤ cache_leftpad[i] ≤ cache_seqlens[i]). Needs
  // cache_seqlens; not with a paged cache. Masks and ALiBi count key positions from that row, so
  // sequence i has cache_seqlens[i] + sk_new − cache_leftpad[i] keys; k_new is still written at
  // row cache_seqlens[i] and rotary positions are still cache rows, as in the reference API.
  TensorView cache_leftpad = {};
  TensorView block_table;      // optional (b, max_blocks_per_seq) int32: paged cache
  TensorView rotary_cos;       // optional (seqlen_ro, rotary_dim / 2), q's dtype
  TensorView rotary_sin;       // optional, like rotary_cos
  bool rotary_interleaved = false;  // rotate pairs (0,1),(2,3)… instead of (i, i + rotary_dim/2)
  TensorView sinks = {};       // optional (h) fp32: attention sinks, as in ForwardInputs
  // FP8 (q, the caches and k_new/v_new all DType::f8e4m3; not with rotary): optional (b, hk) fp32
  // descale factors as in ForwardInputs, b the call's batch index (not the cache row). The new
  // rows are written into the caches as given (e4m3 bytes); out is bf16 or f16.
  TensorView q_descale = {};
  TensorView k_descale = {};
  TensorView v_descale = {};
};

// Merge partial attention results over disjoint key sets (split-KV, context parallelism).
struct CombineInputs {
  TensorView out_partial;  // (splits, b, sq, h, dv) fp32
  TensorView lse_partial;  // (splits, b, h, sq) fp32
};

// --- entry points -------------------------------------------------------------------------------

void forward(const ForwardInputs& in, const ForwardOutputs& out, const Options& opt = {},
             Workspace workspace = {}, Stream stream = {});

void backward(const BackwardInputs& in, const BackwardOutputs& out, const Options& opt = {},
              Workspace workspace = {}, Stream stream = {});

// Appends k_new/v_new into the caches (rotated when rotary_cos/sin are given), then attends.
void forward_kvcache(const KVCacheInputs& in, const ForwardOutputs& out, const Options& opt = {},
                     Workspace workspace = {}, Stream stream = {});

// out (b, sq, h, dv) in out's dtype (f16/bf16/f32), lse (b, h, sq) fp32 (optional).
void combine(const CombineInputs& in, const ForwardOutputs& out, Workspace workspace = {},
             Stream stream = {});

// --- what a call needs --------------------------------------------------------------------------

// Bytes of workspace a call needs (0 when none). Only shapes, dtypes and devices are read.
// On CUDA tensors the forward's workspace holds split-KV partials (decoding: few query rows, long
// contexts); it is optional — without it, or with less, the forward runs unsplit. In
// forward_kvcache's workspace that part follows the required KV-cache region. The backward's is
// the largest need among the CUDA kernel families with a kernel for the call's dtype and head dims
// (which one serves also depends on the outputs' layouts): enough whichever runs it.
std::size_t forward_workspace_size(const ForwardInputs& in, const Options& opt = {});
std::size_t backward_workspace_size(const BackwardInputs& in, const Options& opt = {});
std::size_t forward_kvcache_workspace_size(const KVCacheInputs& in, const Options& opt = {});

// Whether a backend can serve a call, and why not. Validation errors are reported as a "no"
// with the same message the call would throw.
struct Support {
  bool ok = false;
  Backend backend = Backend::automatic;  // the backend that would serve it when ok
  std::string reason;                    // why not, when !ok
  explicit operator bool() const { return ok; }
};

Support can_implement(const ForwardInputs& in, const ForwardOutputs& out, const Options& opt = {});
Support can_implement(const BackwardInputs& in, const BackwardOutputs& out,
                      const Options& opt = {});
Support can_implement(const KVCacheInputs& in, const ForwardOutputs& out, const Options& opt = {});

// Waits for the current CUDA device and throws flashattn::Error for an index value that the
// device-side check of an earlier call found bad (Options::check_indices); returns when there is
// none, or when the build has no CUDA backend.
void check_index_errors();

// The backends compiled into this build, e.g. {cpu, cpu_reference}.
std::vector<Backend> compiled_backends();
// A one-line description of the build (version, backends, compiled kernel sets).
std::string build_info();

}  // namespace flashattn
