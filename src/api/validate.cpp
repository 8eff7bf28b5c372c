// src/api/validate.cpp — SPEC §5. Every rule throws flashattn::Error before anything is written;
// messages read "<api>: <argument>: <rule>; expected <x>, got <y>".
#include "api/validate.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace flashattn::detail {

std::string index_violation_message(const char* api, const common::IndexViolation& v) {
  using common::IndexRule;
  const bool q_side = v.side == common::IndexSide::q;
  const std::string cu = q_side ? "varlen.cu_seqlens_q" : "varlen.cu_seqlens_k";
  const std::string b = std::to_string(v.batch), bound = std::to_string(v.bound);
  std::string value = std::to_string(v.value);
  std::string arg, rule, expected;
  switch (v.rule) {
    case IndexRule::ok: return std::string(api) + ": no index violation";
    case IndexRule::cu_seqlens_start: arg = cu, rule = "prefix sums must start at 0", expected = "0"; break;
    case IndexRule::cu_seqlens_decreasing:
      arg = cu, rule = "prefix sums must be non-decreasing", expected = "entry " + std::to_string(v.entry) + " ≥ " + bound;
      break;
    case IndexRule::max_seqlen_too_small:
      arg = q_side ? "varlen.max_seqlen_q" : "varlen.max_seqlen_k", rule = "must be at least every sequence's length",
      expected = "≥ " + bound;
      break;
    case IndexRule::cu_seqlens_past_total:
      arg = cu, rule = "last prefix sum exceeds the packed rows", expected = "≤ " + bound;
      break;
    case IndexRule::seqused_k_range:
      arg = "varlen.seqused_k", rule = "entry " + b + " must lie in [0, that sequence's key count]",
      expected = "0 ≤ x ≤ " + bound;
      break;
    case IndexRule::cache_seqlens_range:
      arg = "cache_seqlens", rule = "entry " + b + " plus the appended keys must fit the cache",
      expected = "0 ≤ x ≤ " + bound;
      break;
    case IndexRule::rotary_too_short:
      arg = "rotary_cos", rule = "must cover every rotated position (cache_seqlens[" + b + "] + max(seqlen_q, seqlen_new))",
      expected = "seqlen_ro ≥ " + bound;
      break;
    case IndexRule::cache_batch_idx_range:
      arg = "cache_batch_idx", rule = "entry " + b + " out of range", expected = "0 ≤ x < " + bound;
      break;
    case IndexRule::block_table_range:
      arg = "block_table", rule = "entry (" + b + ", " + std::to_string(v.entry) + ") is not a page of the cache",
      expected = "0 ≤ x < " + bound;
      break;
    case IndexRule::cache_leftpad_range:
      arg = "cache_leftpad", rule = "entry " + b + " must lie in [0, cache_seqlens[" + b + "]]",
      expected = "0 ≤ x ≤ " + bound;
      break;
    case IndexRule::paged_keys_past_capacity:
      arg = "block_table",
      rule = "row " + b + " (max_blocks_per_seq · page_size keys) cannot hold the keys of sequence " + b +
             " (seqused_k[" + b + "], or its cu_seqlens_k length)",
      expected = "at most " + bound + " keys", value = std::to_string(v.value) + " keys";
      break;
  }
  return std::string(api) + ": " + arg + ": " + rule + "; expected " + expected + ", got " + value;
}

namespace {

constexpr int kMaxHeadDim = 256;
constexpr int kHeadDimMultiple = 8;
constexpr int kRotaryDimMultiple = 16;
// Sequence lengths (and KV-cache capacities) stay at most 2^30 so that every row index, diagonal
// and dropout counter fits its 32-bit field (docs/dropout.md).
constexpr std::int64_t kMaxSeqlen = std::int64_t(1) << 30;

std::string device_string(Device d) {
  return d.type == DeviceType::cpu ? "cpu" : "cuda:" + std::to_string(d.index);
}

// A float with the digits that tell it apart (std::to_string prints 1e-40 as 0.000000).
std::string float_string(float x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", double(x));
  return buf;
}

std::string strides_string(const TensorView& t) {
  std::string s = "(";
  for (int i = 0; i < t.ndim; ++i) s += (i ? ", " : "") + std::to_string(t.stride[i]);
  return s + ")";
}

std::string shape_of(std::initializer_list<std::int64_t> dims) {
  std::string s = "(";
  bool first = true;
  for (std::int64_t d : dims) {
    s += (first ? "" : ", ") + std::to_string(d);
    first = false;
  }
  return s + ")";
}

class Checker {
 public:
  explicit Checker(const char* api) : api_(api) {}

  // Names and rules are string views: every check of a valid call passes them, and only a failure
  // builds a message (a std::string parameter would copy each literal, on the heap past 15 bytes).
  [[noreturn]] void fail(std::string_view arg, std::string_view rule, const std::string& expected,
                         const std::string& actual) const {
    std::string message(api_);
    message.append(": ").append(arg).append(": ").append(rule);
    throw Error(message + "; expected " + expected + ", got " + actual);
  }

  void require(std::string_view name, const TensorView& t) const {
    if (!t.defined()) fail(name, "is required", "a tensor", "none");
  }

  // Structure every given tensor must have: rank, non-negative strides, memory when non-empty.
  void well_formed(std::string_view name, const TensorView& t) const {
    if (t.ndim < 1 || t.ndim > kMaxDims) {
      fail(name, "rank out of range", "1 to " + std::to_string(kMaxDims), std::to_string(t.ndim));
    }
    for (int i = 0; i < t.ndim; ++i) {
      if (t.shape[i] < 0) fail(name, "negative dimension", "sizes ≥ 0", shape_string(t));
      if (t.stride[i] < 0) {
        fail(name, "negative stride in dimension " + std::to_string(i), "strides ≥ 0",
             std::to_string(t.stride[i]));
      }
    }
    if (t.numel() > 0 && t.data == nullptr) fail(name, "null data pointer", "memory for " + shape_string(t), "nullptr");
  }

  void dtype(std::string_view name, const TensorView& t, DType expected, std::string_view why) const {
    if (t.dtype != expected) fail(name, why, dtype_name(expected), dtype_name(t.dtype));
  }

  void shape(std::string_view name, const TensorView& t, std::initializer_list<std::int64_t> expected) const {
    bool ok = t.ndim == int(expected.size());
    int i = 0;
    for (std::int64_t e : expected) ok = ok && t.shape[i++] == e;
    if (!ok) fail(name, "wrong shape", shape_of(expected), shape_string(t));
  }

  void last_dim_contiguous(std::string_view name, const TensorView& t) const {
    if (t.shape[t.ndim - 1] > 1 && t.stride[t.ndim - 1] != 1) {
      fail(name, "last dimension must be contiguous", "stride 1", "stride " + std::to_string(t.stride[t.ndim - 1]));
    }
  }

  void contiguous(std::string_view name, const TensorView& t) const {
    if (!t.is_contiguous()) {
      TensorView dense = t;
      std::int64_t stride = 1;
      for (int i = t.ndim - 1; i >= 0; --i) {
        dense.stride[i] = stride;
        stride *= t.shape[i];
      }
      fail(name, "must be contiguous (row-major)", "strides " + strides_string(dense), "strides " + strides_string(t));
    }
  }

  void same_device(std::string_view name, const TensorView& t, Device device) const {
    if (t.device != device) fail(name, "all tensors must be on one device", device_string(device), device_string(t.device));
  }

  const char* api() const { return api_; }

 private:
  const char* api_;
};

common::Storage storage_of(DType dtype) {
  switch (dtype) {
    case DType::f16: return common::Storage::f16;
    case DType::bf16: return common::Storage::bf16;
    default: return common::Storage::f32;
  }
}

common::RowHeadTensor row_head(const TensorView& t) {
  common::RowHeadTensor r;
  r.data = t.data;
  if (t.ndim == 4) {
    r.batch_stride = t.stride[0];
    r.row_stride = t.stride[1];
    r.head_stride = t.stride[2];
  } else {  // varlen (total, heads, dim)
    r.row_stride = t.stride[0];
    r.head_stride = t.stride[1];
  }
  return r;
}

// The attention input dtype rule and the device rule, shared by every entry point. fp8: the
// caller is the forward or the KV-cache call, which take float8_e4m3 inputs on the CPU backends.
void check_element_type(const Checker& c, const TensorView& q, const Options& opt, bool fp8 = false) {
  if (q.dtype == DType::f8e4m3) {
    if (!fp8) {
      c.fail("q", "float8_e4m3 inputs are for the forwards only (FP8 attention has no backward)",
             "f16, bf16 or f32", dtype_name(q.dtype));
    }
    if (q.device.type == DeviceType::cuda || opt.backend == Backend::cuda) {
      c.fail("q", "FP8 attention runs on the CPU backends only: no CUDA kernel takes float8_e4m3 inputs yet",
             "f16 or bf16 on CUDA", dtype_name(q.dtype) + std::string(" on ") + device_string(q.device));
    }
    return;
  }
  const bool low_precision = q.dtype == DType::f16 || q.dtype == DType::bf16;
  const bool cpu_only = q.device.type == DeviceType::cpu && opt.backend != Backend::cuda;
  if (!low_precision && !(q.dtype == DType::f32 && cpu_only)) {
    c.fail("q", "FlashAttention supports fp16 and bf16 (the CPU backends also fp32)",
           cpu_only ? "f16, bf16 or f32" : "f16 or bf16", dtype_name(q.dtype));
  }
}

void check_device_served(const Checker& c, const TensorView& q, const Options& opt) {
  if (q.device.type == DeviceType::cuda) {
#ifndef FLASHATTN_WITH_CUDA
    c.fail("q", "is a CUDA tensor but this build has no CUDA backend (configure with "
                "-DFLASHATTN_CUDA=ON, e.g. the dev or full preset)",
           "a host tensor", device_string(q.device));
#endif
    if (opt.backend == Backend::cpu || opt.backend == Backend::cpu_reference) {
      c.fail("options.backend", "a CPU backend cannot read CUDA tensors", "auto or cuda", backend_name(opt.backend));
    }
  } else if (opt.backend == Backend::cuda) {
    c.fail("options.backend", "the CUDA backend needs CUDA tensors", "auto, cpu or cpu_reference", "cuda with host tensors");
  }
}

void check_head_dim(const Checker& c, std::string_view name, std::int64_t d) {
  if (d % kHeadDimMultiple != 0 || d <= 0 || d > kMaxHeadDim) {
    c.fail(name, "head dimension must be a positive multiple of 8 and at most 256",
           "8, 16, ..., 256", std::to_string(d));
  }
}

// Dropout position offsets: whole mask blocks, and small enough that a block index plus the
// sequence's blocks stays within the Philox counter's 32-bit words (block_j · 32 + lane).
constexpr std::int64_t kDropoutBlock = 16;
constexpr std::int64_t kMaxDropoutOffset = std::int64_t(1) << 30;

void check_options(const Checker& c, const Options& opt) {
  if (!(opt.dropout_p >= 0.0f && opt.dropout_p < 1.0f)) {
    c.fail("options.dropout_p", "dropout probability must be in [0, 1)", "0 ≤ p < 1", std::to_string(opt.dropout_p));
  }
  if (!(opt.softcap >= 0.0f) || std::isinf(opt.softcap)) {
    c.fail("options.softcap", "softcap must be finite and ≥ 0 (0 disables it)", "≥ 0", std::to_string(opt.softcap));
  }
  if (!std::isfinite(opt.softmax_scale) || opt.softmax_scale < 0.0f) {
    c.fail("options.softmax_scale", "softmax_scale must be finite and ≥ 0 (0 means 1/sqrt(d))", "≥ 0",
           std::to_string(opt.softmax_scale));
  }
  for (const auto& [name, value] : {std::pair{"options.dropout_row_offset", opt.dropout_row_offset},
                                    std::pair{"options.dropout_col_offset", opt.dropout_col_offset}}) {
    if (value < 0 || value % kDropoutBlock != 0 || value > kMaxDropoutOffset) {
      c.fail(name, "dropout position offsets are whole 16×16 mask blocks", "0, 16, 32, ... below 2^30",
             std::to_string(value));
    }
  }
  if (opt.window_left < -1) c.fail("options.window_left", "window sizes must be ≥ −1 (−1: unbounded)", "≥ −1", std::to_string(opt.window_left));
  if (opt.window_right < -1) c.fail("options.window_right", "window sizes must be ≥ −1 (−1: unbounded)", "≥ −1", std::to_string(opt.window_right));
  if (opt.num_splits < 0) {
    c.fail("options.num_splits", "split count must be ≥ 0 (0: heuristic, 1: never split)", "≥ 0",
           std::to_string(opt.num_splits));
  }
  if (opt.num_threads < 0) c.fail("options.num_threads", "thread count must be ≥ 0 (0: all cores)", "≥ 0", std::to_string(opt.num_threads));
}

void check_alibi(const Checker& c, const Options& opt, std::int64_t b, std::int64_t h, Device device,
                 common::AttentionParams& p) {
  const TensorView& a = opt.alibi_slopes;
  if (!a.defined()) return;
  c.well_formed("alibi_slopes", a);
  c.dtype("alibi_slopes", a, DType::f32, "ALiBi slopes must be fp32");
  c.same_device("alibi_slopes", a, device);
  c.last_dim_contiguous("alibi_slopes", a);
  if (!((a.ndim == 1 && a.shape[0] == h) || (a.ndim == 2 && a.shape[0] == b && a.shape[1] == h))) {
    c.fail("alibi_slopes", "wrong shape", shape_of({h}) + " or " + shape_of({b, h}), shape_string(a));
  }
  p.alibi_slopes = static_cast<const float*>(a.data);
  p.alibi_batch_stride = a.ndim == 2 ? a.stride[0] : 0;
}

// Attention sinks (docs/sinks.md): (h) fp32, contiguous, on q's device. Their values are not
// checked: any float is a logit (−∞: no sink; NaN and +∞ make the head's rows NaN, as a score would).
void check_sinks(const Checker& c, const char* name, const TensorView& t, std::int64_t h, Device device) {
  c.well_formed(name, t);
  c.dtype(name, t, DType::f32, "attention sinks are fp32");
  c.same_device(name, t, device);
  c.shape(name, t, {h});
  c.contiguous(name, t);
}

void set_sinks(const Checker& c, const TensorView& sinks, std::int64_t h, Device device, common::AttentionParams& p) {
  if (!sinks.defined()) return;
  check_sinks(c, "sinks", sinks, h, device);
  p.sinks = static_cast<const float*>(sinks.data);
}

// Dropout: resolve the seed and offset (from memory when rng_state is given; on the host it can
// be read now, on a GPU the kernel reads it).
void set_semantics(const Checker& c, const Options& opt, Device device, common::AttentionParams& p) {
  check_options(c, opt);
  p.softmax_scale = opt.softmax_scale > 0.0f ? opt.softmax_scale : 1.0f / std::sqrt(float(p.head_dim));
  // Every backend divides by the softcap (tanh(s / softcap)), some after folding the scale in
  // (softmax_scale / softcap): a softcap so small that either quotient overflows fp32 would give
  // ∞ · 0 = NaN scores, so it is refused. Above that bound a tiny softcap is exact: scores in
  // ±softcap, a softmax that is uniform over the visible keys to fp32 precision.
  if (opt.softcap > 0.0f && !(std::isfinite(1.0f / opt.softcap) && std::isfinite(p.softmax_scale / opt.softcap))) {
    c.fail("options.softcap",
           "softcap must be 0 (off) or large enough that 1 / softcap and softmax_scale / softcap are finite in fp32",
           "≥ " + float_string(std::max(1.0f, p.softmax_scale) / std::numeric_limits<float>::max()),
           float_string(opt.softcap));
  }
  p.softcap = opt.softcap;
  p.causal = opt.causal;
  p.window_left = opt.window_left;
  p.window_right = opt.window_right;
  p.deterministic = opt.deterministic;
  p.num_splits = opt.num_splits;
  p.dropout_p = opt.dropout_p;
  if (opt.dropout_p > 0.0f) {
    p.dropout.seed = opt.dropout_seed;
    p.dropout.offset = opt.dropout_offset;
    if (opt.dropout_rng_state != nullptr && device.type == DeviceType::cpu) {
      p.dropout.seed = opt.dropout_rng_state[0];
      p.dropout.offset = opt.dropout_rng_state[1];
    }
    p.dropout.block_row_offset = std::uint32_t(opt.dropout_row_offset / kDropoutBlock);
    p.dropout.block_col_offset = std::uint32_t(opt.dropout_col_offset / kDropoutBlock);
    p.dropout.keep_threshold = common::dropout_keep_threshold(opt.dropout_p);
    p.dropout.keep_scale = 1.0f / (1.0f - opt.dropout_p);
  }
}

const std::int32_t* int_data(const TensorView& t) { return static_cast<const std::int32_t*>(t.data); }

void check_int_vector(const Checker& c, std::string_view name, const TensorView& t, std::int64_t n, Device device) {
  c.well_formed(name, t);
  c.dtype(name, t, DType::i32, "must be int32");
  c.same_device(name, t, device);
  c.shape(name, t, {n});
  c.contiguous(name, t);
}

// The index tensors of a varlen call and the extents their values must respect. block_table
// (undefined when K/V are packed): the pages of a paged K/V, k (num_blocks, page_size, hk, d).
common::IndexBounds varlen_index_bounds(const Varlen& vl, std::int64_t batch, std::int64_t total_q,
                                        std::int64_t total_k, const TensorView& block_table = {},
                                        const TensorView& k = {}) {
  common::IndexBounds ib;
  ib.batch = int(batch);
  ib.cu_seqlens_q = int_data(vl.cu_seqlens_q);
  ib.cu_seqlens_k = vl.cu_seqlens_k.defined() ? int_data(vl.cu_seqlens_k) : nullptr;
  ib.seqused_k = vl.seqused_k.defined() ? int_data(vl.seqused_k) : nullptr;
  ib.max_seqlen_q = vl.max_seqlen_q;
  ib.max_seqlen_k = vl.max_seqlen_k;
  ib.total_q = total_q;
  ib.total_k = total_k;
  if (block_table.defined()) {
    ib.total_k = -1;  // k is not packed: cu_seqlens_k gives lengths only
    ib.block_table = int_data(block_table);
    ib.block_table_batch_stride = block_table.stride[0];
    ib.page_size = int(k.shape[1]);
    ib.cache_rows = k.shape[0];
    ib.capacity = block_table.shape[1] * k.shape[1];
  }
  return ib;
}

// The index tensors of a KV-cache call (lengths before the append of sk_new keys) and the extents
// their values must respect.
common::IndexBounds kvcache_index_bounds(const KVCacheInputs& in, std::int64_t sq, std::int64_t sk_new,
                                         std::int64_t capacity) {
  common::IndexBounds ib;
  ib.batch = int(in.q.shape[0]);
  ib.api = common::IndexApi::forward_kvcache;
  ib.cache_seqlens = in.cache_seqlens.defined() ? int_data(in.cache_seqlens) : nullptr;
  ib.cache_batch_idx = in.cache_batch_idx.defined() ? int_data(in.cache_batch_idx) : nullptr;
  ib.cache_leftpad = in.cache_leftpad.defined() ? int_data(in.cache_leftpad) : nullptr;
  if (in.block_table.defined()) {
    ib.block_table = int_data(in.block_table);
    ib.block_table_batch_stride = in.block_table.stride[0];
    ib.page_size = int(in.k_cache.shape[1]);
  }
  ib.cache_rows = in.k_cache.shape[0];
  ib.capacity = capacity;
  ib.seqlen_new = int(sk_new);
  ib.seqlen_q = int(sq);
  ib.rotary_rows = in.rotary_cos.defined() ? in.rotary_cos.shape[0] : -1;
  return ib;
}

// On the host the index values can be read now: the first broken rule throws.
void check_index_values(const Checker& c, const common::IndexBounds& ib, Device device) {
  if (device.type != DeviceType::cpu) return;
  for (int b = 0; b < ib.batch; ++b) {
    const common::IndexViolation v = common::check_sequence_indices(ib, b);
    if (v) throw Error(index_violation_message(c.api(), v));
  }
}

// Varlen: the shapes of the index tensors. cu_seqlens_k may be left out with a paged K/V, when
// seqused_k gives the key counts.
void check_varlen(const Checker& c, const Varlen& vl, bool paged, Device device, std::int64_t& batch) {
  if (!paged) c.require("varlen.cu_seqlens_k", vl.cu_seqlens_k);
  if (paged && !vl.cu_seqlens_k.defined() && !vl.seqused_k.defined()) {
    c.fail("varlen.seqused_k", "a paged K/V (block_table) needs the key count of each sequence: seqused_k or cu_seqlens_k",
           "a (b) int32 tensor", "neither");
  }
  c.well_formed("varlen.cu_seqlens_q", vl.cu_seqlens_q);
  if (vl.cu_seqlens_q.ndim != 1 || vl.cu_seqlens_q.shape[0] < 2) {
    c.fail("varlen.cu_seqlens_q", "must have length batch + 1 with batch > 0", "(b + 1) with b ≥ 1", shape_string(vl.cu_seqlens_q));
  }
  batch = vl.cu_seqlens_q.shape[0] - 1;
  check_int_vector(c, "varlen.cu_seqlens_q", vl.cu_seqlens_q, batch + 1, device);
  if (vl.cu_seqlens_k.defined()) check_int_vector(c, "varlen.cu_seqlens_k", vl.cu_seqlens_k, batch + 1, device);
  if (vl.seqused_k.defined()) check_int_vector(c, "varlen.seqused_k", vl.seqused_k, batch, device);
  if (vl.max_seqlen_q < 0) c.fail("varlen.max_seqlen_q", "must be ≥ 0", "≥ 0", std::to_string(vl.max_seqlen_q));
  if (vl.max_seqlen_k < 0) c.fail("varlen.max_seqlen_k", "must be ≥ 0", "≥ 0", std::to_string(vl.max_seqlen_k));
}

// A paged K/V of a varlen forward: k (num_blocks, page_size, hk, d), v (..., dv), block_table
// (b, max_blocks_per_seq) int32 with a contiguous last dimension.
void check_paged_kv(const Checker& c, const TensorView& k, const TensorView& v, const TensorView& block_table,
                    std::int64_t b, std::int64_t hk, std::int64_t d, std::int64_t dv, Device device) {
  c.well_formed("block_table", block_table);
  c.dtype("block_table", block_table, DType::i32, "must be int32");
  c.same_device("block_table", block_table, device);
  if (block_table.ndim != 2 || block_table.shape[0] != b) {
    c.fail("block_table", "wrong shape", "(" + std::to_string(b) + ", max_blocks_per_seq)", shape_string(block_table));
  }
  c.last_dim_contiguous("block_table", block_table);
  const std::int64_t pages = k.shape[0], page_size = k.shape[1];
  c.shape("k", k, {pages, page_size, hk, d});
  c.shape("v", v, {pages, page_size, hk, dv});
  if (page_size <= 0 || page_size > kMaxSeqlen) {
    c.fail("k", "page size (dimension 1 of a paged cache) must be positive and at most 2^30", "1 to 2^30",
           std::to_string(page_size));
  }
  const std::int64_t capacity = block_table.shape[1] * page_size;
  if (capacity > kMaxSeqlen) {
    c.fail("block_table", "keys per sequence (max_blocks_per_seq · page_size) must be at most 2^30",
           "≤ " + std::to_string(kMaxSeqlen), std::to_string(capacity));
  }
}

// The shape vocabulary of one call: batch mode (b, s, h, d) or varlen (total, h, d).
struct Dims {
  std::int64_t b = 0, sq = 0, sk = 0, h = 0, hk = 0, d = 0, dv = 0;
  std::int64_t total_q = 0, total_k = 0;
  bool varlen = false;
};

// Checks q, k, v against each other and fills dims. block_table (forward only; undefined
// otherwise): k and v are paged caches of a varlen call. fp8: float8_e4m3 inputs are allowed
// (the forward).
Dims check_qkv(const Checker& c, const TensorView& q, const TensorView& k, const TensorView& v,
               const Varlen& vl, const Options& opt, const TensorView& block_table = {}, bool fp8 = false) {
  c.require("q", q);
  c.require("k", k);
  c.require("v", v);
  c.well_formed("q", q);
  check_element_type(c, q, opt, fp8);
  check_device_served(c, q, opt);
  Dims dims;
  dims.varlen = vl.enabled();
  const bool paged = block_table.defined();
  if (paged && !dims.varlen) {
    c.fail("block_table", "a paged K/V in forward needs a varlen call (batch-mode queries: forward_kvcache)",
           "varlen.cu_seqlens_q", "none");
  }
  const int rank = dims.varlen ? 3 : 4;
  for (auto [name, t] : {std::pair<const char*, const TensorView*>{"q", &q}, {"k", &k}, {"v", &v}}) {
    c.well_formed(name, *t);
    if (paged && t != &q) {
      if (t->ndim != 4) {
        c.fail(name, "a paged cache is (num_blocks, page_size, heads, head_dim)", "rank 4",
               "rank " + std::to_string(t->ndim) + " " + shape_string(*t));
      }
    } else if (t->ndim != rank) {
      c.fail(name, dims.varlen ? "varlen tensors are (total, heads, head_dim)" : "tensors are (batch, seqlen, heads, head_dim)",
             "rank " + std::to_string(rank), "rank " + std::to_string(t->ndim) + " " + shape_string(*t));
    }
    if (t != &q) c.dtype(name, *t, q.dtype, "must have q's dtype");
    c.same_device(name, *t, q.device);
    c.last_dim_contiguous(name, *t);
  }
  const int o = dims.varlen ? 0 : 1;   // offset of the row axis of q
  const int ko = paged ? 1 : o;        // and of k / v (a paged cache: (pages, page_size, ...))
  dims.h = q.shape[o + 1];
  dims.d = q.shape[o + 2];
  dims.hk = k.shape[ko + 1];
  dims.dv = v.shape[ko + 2];
  if (dims.varlen) {
    dims.total_q = q.shape[0];
    dims.total_k = paged ? 0 : k.shape[0];
    check_varlen(c, vl, paged, q.device, dims.b);
    dims.sq = vl.max_seqlen_q;
    dims.sk = vl.max_seqlen_k;
    if (paged) {
      check_paged_kv(c, k, v, block_table, dims.b, dims.hk, dims.d, dims.dv, q.device);
    } else {
      c.shape("k", k, {dims.total_k, dims.hk, dims.d});
      c.shape("v", v, {dims.total_k, dims.hk, dims.dv});
    }
    check_index_values(c, varlen_index_bounds(vl, dims.b, dims.total_q, dims.total_k, block_table, k), q.device);
  } else {
    dims.b = q.shape[0];
    dims.sq = q.shape[1];
    dims.sk = k.shape[1];
    if (dims.b <= 0) c.fail("q", "batch size must be positive", "b ≥ 1", std::to_string(dims.b));
    c.shape("k", k, {dims.b, dims.sk, dims.hk, dims.d});
    c.shape("v", v, {dims.b, dims.sk, dims.hk, dims.dv});
  }
  if (dims.h <= 0) c.fail("q", "number of heads must be positive", "h ≥ 1", std::to_string(dims.h));
  if (dims.hk <= 0) c.fail("k", "number of heads must be positive", "hk ≥ 1", std::to_string(dims.hk));
  check_head_dim(c, "q", dims.d);
  check_head_dim(c, "v", dims.dv);
  if (dims.h % dims.hk != 0) {
    c.fail("k", "number of heads in key/value must divide number of heads in query",
           "a divisor of " + std::to_string(dims.h), std::to_string(dims.hk));
  }
  // Named by where the length comes from: the varlen maxima, or the row axis of q / k.
  if (dims.sq > kMaxSeqlen) {
    c.fail(dims.varlen ? "varlen.max_seqlen_q" : "q", "sequence lengths must be at most 2^30", "≤ 2^30",
           std::to_string(dims.sq));
  }
  if (dims.sk > kMaxSeqlen) {
    c.fail(dims.varlen ? "varlen.max_seqlen_k" : "k", "sequence lengths must be at most 2^30", "≤ 2^30",
           std::to_string(dims.sk));
  }
  return dims;
}

// Tensors laid out like q (out, dout, dq: q's rows and heads) or like k (dk, dv: k's rows and
// heads), with the given head dim and q's dtype.
enum class Rows { query, key };
void check_like(const Checker& c, std::string_view name, const TensorView& t, const Dims& dims, Rows rows,
                std::int64_t head_dim, const TensorView& q) {
  c.require(name, t);
  c.well_formed(name, t);
  c.dtype(name, t, q.dtype, "must have q's dtype");
  c.same_device(name, t, q.device);
  const std::int64_t total = rows == Rows::query ? dims.total_q : dims.total_k;
  const std::int64_t seqlen = rows == Rows::query ? dims.sq : dims.sk;
  const std::int64_t heads = rows == Rows::query ? dims.h : dims.hk;
  if (dims.varlen) {
    c.shape(name, t, {total, heads, head_dim});
  } else {
    c.shape(name, t, {dims.b, seqlen, heads, head_dim});
  }
  c.last_dim_contiguous(name, t);
}

// lse-like tensors: (b, h, sq) or varlen (h, total_q), fp32, contiguous.
void check_row_stat(const Checker& c, std::string_view name, const TensorView& t, const Dims& dims, Device device) {
  c.require(name, t);
  c.well_formed(name, t);
  c.dtype(name, t, DType::f32, "must be fp32");
  c.same_device(name, t, device);
  if (dims.varlen) {
    c.shape(name, t, {dims.h, dims.total_q});
  } else {
    c.shape(name, t, {dims.b, dims.h, dims.sq});
  }
  c.contiguous(name, t);
}

common::AttentionParams base_params(const Dims& dims, const TensorView& q, const TensorView& k,
                                    const TensorView& v, const Varlen& vl) {
  common::AttentionParams p;
  p.storage = storage_of(q.dtype);
  p.batch = int(dims.b);
  p.heads = int(dims.h);
  p.heads_k = int(dims.hk);
  p.head_dim = int(dims.d);
  p.head_dim_v = int(dims.dv);
  p.max_seqlen_q = int(dims.sq);
  p.max_seqlen_k = int(dims.sk);
  p.q = row_head(q);
  p.k = row_head(k);
  p.v = row_head(v);
  if (dims.varlen) {
    p.cu_seqlens_q = int_data(vl.cu_seqlens_q);
    p.cu_seqlens_k = vl.cu_seqlens_k.defined() ? int_data(vl.cu_seqlens_k) : nullptr;
    p.seqused_k = vl.seqused_k.defined() ? int_data(vl.seqused_k) : nullptr;
    p.lse_head_stride = dims.total_q;
    p.total_q = dims.total_q;
    p.total_k = dims.total_k;
  } else {
    p.lse_batch_stride = dims.h * dims.sq;
    p.lse_head_stride = dims.sq;
  }
  return p;
}

}  // namespace

// What out is checked against: q (its dtype and device); FP8 inputs give bf16 or f16 instead, the
// caller's choice.
TensorView out_like(const Checker& c, const TensorView& q, const TensorView& out) {
  TensorView like = q;
  if (q.dtype == DType::f8e4m3 && out.defined()) {
    if (out.dtype != DType::bf16 && out.dtype != DType::f16) {
      c.fail("out", "FP8 inputs give a bf16 or f16 output", "bf16 or f16", dtype_name(out.dtype));
    }
    like.dtype = out.dtype;
  }
  return like;
}

// FP8 descale factors (ForwardInputs::q_descale, KVCacheInputs::q_descale, ...): only with
// float8_e4m3 inputs; each (b, hk) fp32 on q's device, any strides.
template <class Inputs>
void check_descales(const Checker& c, const Inputs& in, const Dims& dims) {
  for (const auto& [name, t] : {std::pair<const char*, const TensorView*>{"q_descale", &in.q_descale},
                                {"k_descale", &in.k_descale},
                                {"v_descale", &in.v_descale}}) {
    if (!t->defined()) continue;
    if (in.q.dtype != DType::f8e4m3) {
      c.fail(name, "descale factors go with float8_e4m3 inputs", std::string("none (q is ") + dtype_name(in.q.dtype) + ")",
             "a tensor");
    }
    c.well_formed(name, *t);
    c.dtype(name, *t, DType::f32, "descale factors are fp32");
    c.same_device(name, *t, in.q.device);
    c.shape(name, *t, {dims.b, dims.hk});
  }
}

Problem validate_forward(const ForwardInputs& in, const ForwardOutputs& out, const Options& opt, const char* api) {
  const Checker c(api);
  const Dims dims = check_qkv(c, in.q, in.k, in.v, in.varlen, opt, in.block_table, true);
  check_descales(c, in, dims);
  check_like(c, "out", out.out, dims, Rows::query, dims.dv, out_like(c, in.q, out.out));
  if (opt.return_lse || out.lse.defined()) check_row_stat(c, "lse", out.lse, dims, in.q.device);
  Problem pr;
  pr.dtype = in.q.dtype;
  pr.device = in.q.device;
  pr.params = base_params(dims, in.q, in.k, in.v, in.varlen);
  pr.total_q = dims.total_q;
  pr.total_k = dims.total_k;
  if (dims.varlen) {
    pr.index_bounds = varlen_index_bounds(in.varlen, dims.b, dims.total_q, dims.total_k, in.block_table, in.k);
  }
  if (in.block_table.defined()) {
    // Paged prefill: K/V rows through the page table (AttentionParams::k_offset); the key counts
    // from seqused_k, else cu_seqlens_k (AttentionParams::seqlen_k).
    pr.params.block_table = int_data(in.block_table);
    pr.params.block_table_batch_stride = in.block_table.stride[0];
    pr.params.page_size = int(in.k.shape[1]);
    pr.params.cache_batches = in.k.shape[0];  // the pages
  }
  pr.params.out = row_head(out.out);
  pr.params.lse = out.lse.defined() ? static_cast<float*>(out.lse.data) : nullptr;
  check_alibi(c, opt, dims.b, dims.h, in.q.device, pr.params);
  set_sinks(c, in.sinks, dims.h, in.q.device, pr.params);
  set_semantics(c, opt, in.q.device, pr.params);
  return pr;
}

Problem validate_backward(const BackwardInputs& in, const BackwardOutputs& out, const Options& opt, const char* api) {
  const Checker c(api);
  const Dims dims = check_qkv(c, in.q, in.k, in.v, in.varlen, opt);
  check_like(c, "dout", in.dout, dims, Rows::query, dims.dv, in.q);
  check_like(c, "out", in.out, dims, Rows::query, dims.dv, in.q);
  check_row_stat(c, "lse", in.lse, dims, in.q.device);
  check_like(c, "dq", out.dq, dims, Rows::query, dims.d, in.q);
  check_like(c, "dk", out.dk, dims, Rows::key, dims.d, in.q);
  check_like(c, "dv", out.dv, dims, Rows::key, dims.dv, in.q);
  check_row_stat(c, "softmax_d", out.softmax_d, dims, in.q.device);
  Problem pr;
  pr.dtype = in.q.dtype;
  pr.device = in.q.device;
  pr.is_backward = true;
  common::AttentionParams& p = pr.params;
  p = base_params(dims, in.q, in.k, in.v, in.varlen);
  pr.total_q = dims.total_q;
  pr.total_k = dims.total_k;
  if (dims.varlen) {
    pr.index_bounds = varlen_index_bounds(in.varlen, dims.b, dims.total_q, dims.total_k);
    pr.index_bounds.api = common::IndexApi::backward;
  }
  p.out = row_head(in.out);
  p.dout = row_head(in.dout);
  p.lse = static_cast<float*>(in.lse.data);
  p.dq = row_head(out.dq);
  p.dk = row_head(out.dk);
  p.dv = row_head(out.dv);
  p.softmax_d = static_cast<float*>(out.softmax_d.data);
  check_alibi(c, opt, dims.b, dims.h, in.q.device, p);
  set_sinks(c, in.sinks, dims.h, in.q.device, p);
  if (out.dsinks.defined()) {
    if (!in.sinks.defined()) {
      c.fail("dsinks", "is the gradient of the sinks: give the forward's sinks too", "sinks", "none");
    }
    check_sinks(c, "dsinks", out.dsinks, dims.h, in.q.device);
    p.dsinks = static_cast<float*>(out.dsinks.data);
  }
  set_semantics(c, opt, in.q.device, p);
  return pr;
}

Problem validate_kvcache(const KVCacheInputs& in, const ForwardOutputs& out, const Options& opt, const char* api) {
  const Checker c(api);
  c.require("q", in.q);
  c.require("k_cache", in.k_cache);
  c.require("v_cache", in.v_cache);
  c.well_formed("q", in.q);
  check_element_type(c, in.q, opt, true);
  check_device_served(c, in.q, opt);
  const Device device = in.q.device;
  for (auto [name, t] : {std::pair<const char*, const TensorView*>{"q", &in.q}, {"k_cache", &in.k_cache}, {"v_cache", &in.v_cache}}) {
    c.well_formed(name, *t);
    if (t->ndim != 4) c.fail(name, "KV-cache tensors are 4-dimensional", "rank 4", "rank " + std::to_string(t->ndim));
    if (t != &in.q) c.dtype(name, *t, in.q.dtype, "must have q's dtype");
    c.same_device(name, *t, device);
    c.last_dim_contiguous(name, *t);
  }
  Dims dims;
  dims.b = in.q.shape[0];
  dims.sq = in.q.shape[1];
  dims.h = in.q.shape[2];
  dims.d = in.q.shape[3];
  dims.hk = in.k_cache.shape[2];
  dims.dv = in.v_cache.shape[3];
  if (dims.b <= 0) c.fail("q", "batch size must be positive", "b ≥ 1", std::to_string(dims.b));
  if (dims.h <= 0) c.fail("q", "number of heads must be positive", "h ≥ 1", std::to_string(dims.h));
  if (dims.hk <= 0) c.fail("k_cache", "number of heads must be positive", "hk ≥ 1", std::to_string(dims.hk));
  check_head_dim(c, "q", dims.d);
  check_head_dim(c, "v_cache", dims.dv);
  if (dims.h % dims.hk != 0) {
    c.fail("k_cache", "number of heads in key/value must divide number of heads in query",
           "a divisor of " + std::to_string(dims.h), std::to_string(dims.hk));
  }
  const bool paged = in.block_table.defined();
  const std::int64_t rows0 = in.k_cache.shape[0], rows1 = in.k_cache.shape[1];
  c.shape("k_cache", in.k_cache, {rows0, rows1, dims.hk, dims.d});
  c.shape("v_cache", in.v_cache, {rows0, rows1, dims.hk, dims.dv});
  std::int64_t capacity = rows1;  // keys a sequence can hold
  if (paged) {
    c.well_formed("block_table", in.block_table);
    c.dtype("block_table", in.block_table, DType::i32, "must be int32");
    c.same_device("block_table", in.block_table, device);
    if (in.block_table.ndim != 2 || in.block_table.shape[0] != dims.b) {
      c.fail("block_table", "wrong shape", "(" + std::to_string(dims.b) + ", max_blocks_per_seq)", shape_string(in.block_table));
    }
    c.last_dim_contiguous("block_table", in.block_table);
    if (in.cache_batch_idx.defined()) {
      c.fail("cache_batch_idx", "cannot be combined with a paged cache (block_table)", "none", "a tensor");
    }
    if (rows1 <= 0) c.fail("k_cache", "page size must be positive", "≥ 1", std::to_string(rows1));
    capacity = in.block_table.shape[1] * rows1;
  } else if (!in.cache_batch_idx.defined() && rows0 != dims.b) {
    c.fail("k_cache", "batch of the cache must equal q's batch (or give cache_batch_idx)",
           std::to_string(dims.b), std::to_string(rows0));
  }
  if (capacity > kMaxSeqlen) {
    c.fail(paged ? "block_table" : "k_cache", "cache capacity (keys per sequence) must be at most 2^30",
           "≤ " + std::to_string(kMaxSeqlen), std::to_string(capacity));
  }
  std::int64_t sk_new = 0;
  if (in.k_new.defined() != in.v_new.defined()) {
    c.fail(in.k_new.defined() ? "v_new" : "k_new", "k_new and v_new must be given together", "both or neither", "one");
  }
  if (in.k_new.defined()) {
    for (auto [name, t] : {std::pair<const char*, const TensorView*>{"k_new", &in.k_new}, {"v_new", &in.v_new}}) {
      c.well_formed(name, *t);
      c.dtype(name, *t, in.q.dtype, "must have q's dtype");
      c.same_device(name, *t, device);
      if (t->ndim != 4) c.fail(name, "wrong rank", "rank 4", "rank " + std::to_string(t->ndim));
      c.last_dim_contiguous(name, *t);
    }
    sk_new = in.k_new.shape[1];
    c.shape("k_new", in.k_new, {dims.b, sk_new, dims.hk, dims.d});
    c.shape("v_new", in.v_new, {dims.b, sk_new, dims.hk, dims.dv});
    if (!in.cache_seqlens.defined()) {
      c.fail("cache_seqlens", "is required when k_new/v_new are appended (it says where)", "a (b) int32 tensor", "none");
    }
  }
  if (in.cache_seqlens.defined()) check_int_vector(c, "cache_seqlens", in.cache_seqlens, dims.b, device);
  if (in.cache_batch_idx.defined()) check_int_vector(c, "cache_batch_idx", in.cache_batch_idx, dims.b, device);
  if (in.cache_leftpad.defined()) {
    check_int_vector(c, "cache_leftpad", in.cache_leftpad, dims.b, device);
    if (paged) c.fail("cache_leftpad", "cannot be combined with a paged cache (block_table)", "none", "a tensor");
    if (!in.cache_seqlens.defined()) {
      c.fail("cache_seqlens", "is required with cache_leftpad (the keys lie between the two)", "a (b) int32 tensor", "none");
    }
  }
  if (in.q.dtype == DType::f8e4m3 && (in.rotary_cos.defined() || in.rotary_sin.defined())) {
    c.fail(in.rotary_cos.defined() ? "rotary_cos" : "rotary_sin",
           "no rotary embedding with FP8 inputs (rotated e4m3 values would be rounded again)",
           "none (rotate before quantising)", "a tensor");
  }
  std::int64_t rotary_dim = 0;
  if (in.rotary_cos.defined() != in.rotary_sin.defined()) {
    c.fail(in.rotary_cos.defined() ? "rotary_sin" : "rotary_cos", "rotary_cos and rotary_sin must be given together", "both or neither", "one");
  }
  if (in.rotary_cos.defined()) {
    for (auto [name, t] : {std::pair<const char*, const TensorView*>{"rotary_cos", &in.rotary_cos}, {"rotary_sin", &in.rotary_sin}}) {
      c.well_formed(name, *t);
      c.dtype(name, *t, in.q.dtype, "must have q's dtype");
      c.same_device(name, *t, device);
      if (t->ndim != 2) c.fail(name, "wrong rank", "(seqlen_ro, rotary_dim / 2)", shape_string(*t));
      c.last_dim_contiguous(name, *t);
    }
    c.shape("rotary_sin", in.rotary_sin, {in.rotary_cos.shape[0], in.rotary_cos.shape[1]});
    rotary_dim = 2 * in.rotary_cos.shape[1];
    if (rotary_dim <= 0 || rotary_dim > dims.d || rotary_dim % kRotaryDimMultiple != 0) {
      c.fail("rotary_cos", "rotary_dim = 2 · shape[1] must be a positive multiple of 16 and at most d",
             "≤ " + std::to_string(dims.d), std::to_string(rotary_dim));
    }
    if (!in.cache_seqlens.defined()) {
      c.fail("cache_seqlens", "is required with rotary embedding (positions start there)", "a (b) int32 tensor", "none");
    }
  }
  dims.sk = capacity;
  check_descales(c, in, dims);
  check_like(c, "out", out.out, dims, Rows::query, dims.dv, out_like(c, in.q, out.out));
  if (opt.return_lse || out.lse.defined()) check_row_stat(c, "lse", out.lse, dims, device);

  // Values, where they can be read: every position written or read stays inside the cache (on a
  // GPU the same rules run on the device: src/cuda/index_check.cu).
  const common::IndexBounds ib = kvcache_index_bounds(in, dims.sq, sk_new, capacity);
  check_index_values(c, ib, device);

  Problem pr;
  pr.dtype = in.q.dtype;
  pr.device = device;
  pr.is_kvcache = true;
  pr.index_bounds = ib;
  common::AttentionParams& p = pr.params;
  p.storage = storage_of(in.q.dtype);
  p.batch = int(dims.b);
  p.heads = int(dims.h);
  p.heads_k = int(dims.hk);
  p.head_dim = int(dims.d);
  p.head_dim_v = int(dims.dv);
  p.max_seqlen_q = int(dims.sq);
  p.max_seqlen_k = int(capacity);
  p.q = row_head(in.q);
  p.k = row_head(in.k_cache);
  p.v = row_head(in.v_cache);
  p.out = row_head(out.out);
  p.lse = out.lse.defined() ? static_cast<float*>(out.lse.data) : nullptr;
  p.lse_batch_stride = dims.h * dims.sq;
  p.lse_head_stride = dims.sq;
  p.cache_batch_idx = in.cache_batch_idx.defined() ? int_data(in.cache_batch_idx) : nullptr;
  p.cache_batches = rows0;
  if (paged) {
    p.block_table = int_data(in.block_table);
    p.block_table_batch_stride = in.block_table.stride[0];
    p.page_size = int(rows1);
  }
  check_alibi(c, opt, dims.b, dims.h, device, p);
  set_sinks(c, in.sinks, dims.h, device, p);
  set_semantics(c, opt, device, p);
  return pr;
}

void validate_combine(const CombineInputs& in, const ForwardOutputs& out, const char* api) {
  const Checker c(api);
  c.require("out_partial", in.out_partial);
  c.require("lse_partial", in.lse_partial);
  c.require("out", out.out);
  c.well_formed("out_partial", in.out_partial);
  if (in.out_partial.ndim != 5) c.fail("out_partial", "wrong rank", "(splits, b, sq, h, dv)", shape_string(in.out_partial));
  const auto* s = in.out_partial.shape;
  const std::int64_t splits = s[0], b = s[1], sq = s[2], h = s[3], dv = s[4];
  const Device device = in.out_partial.device;
  if (device.type == DeviceType::cuda) {
#ifndef FLASHATTN_WITH_CUDA
    c.fail("out_partial", "is a CUDA tensor but this build has no CUDA backend (configure with -DFLASHATTN_CUDA=ON)",
           "a host tensor", device_string(device));
#endif
  }
  if (splits < 1) c.fail("out_partial", "needs at least one split", "splits ≥ 1", std::to_string(splits));
  c.dtype("out_partial", in.out_partial, DType::f32, "partial results are fp32");
  c.last_dim_contiguous("out_partial", in.out_partial);
  c.well_formed("lse_partial", in.lse_partial);
  c.dtype("lse_partial", in.lse_partial, DType::f32, "partial results are fp32");
  c.same_device("lse_partial", in.lse_partial, device);
  c.shape("lse_partial", in.lse_partial, {splits, b, h, sq});
  c.contiguous("lse_partial", in.lse_partial);
  c.well_formed("out", out.out);
  if (out.out.dtype == DType::i32) c.fail("out", "must be a floating-point tensor", "f16, bf16 or f32", dtype_name(out.out.dtype));
  c.same_device("out", out.out, device);
  c.shape("out", out.out, {b, sq, h, dv});
  c.last_dim_contiguous("out", out.out);
  if (out.lse.defined()) {
    c.well_formed("lse", out.lse);
    c.dtype("lse", out.lse, DType::f32, "must be fp32");
    c.same_device("lse", out.lse, device);
    c.shape("lse", out.lse, {b, h, sq});
    c.contiguous("lse", out.lse);
  }
}

}  // namespace flashattn::detail
