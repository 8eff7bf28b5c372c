// src/api/fp8_host.cpp — FP8 forward calls on the CPU backends (fp8_host.h).
#include "api/fp8_host.h"

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "common/numeric.h"

namespace flashattn::detail {
namespace {

// fn(offset of element (i0, .., i{n−1}) in t, the index array) over every element of t, row-major.
template <class Fn>
void for_each_element(const TensorView& t, Fn&& fn) {
  std::int64_t index[kMaxDims] = {};
  const std::int64_t n = t.numel();
  for (std::int64_t e = 0; e < n; ++e) {
    std::int64_t offset = 0;
    for (int d = 0; d < t.ndim; ++d) offset += index[d] * t.stride[d];
    fn(offset, static_cast<const std::int64_t*>(index));
    for (int d = t.ndim - 1; d >= 0; --d) {
      if (++index[d] < t.shape[d]) break;
      index[d] = 0;
    }
  }
}

// A contiguous fp32 view of t's shape over buf (resized to fit).
TensorView fp32_like(const TensorView& t, std::vector<float>& buf) {
  TensorView v;
  v.dtype = DType::f32;
  v.device = t.device;
  v.ndim = t.ndim;
  std::int64_t stride = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    v.shape[d] = t.shape[d];
    v.stride[d] = stride;
    stride *= t.shape[d];
  }
  buf.resize(std::size_t(stride));
  v.data = buf.data();
  return v;
}

float descale_at(const TensorView& descale, std::int64_t b, std::int64_t g) {
  if (!descale.defined()) return 1.0f;
  return static_cast<const float*>(descale.data)[b * descale.stride[0] + g * descale.stride[1]];
}

// The sequence of each query row: dense (b, sq, h, d) by its first index, varlen by cu_seqlens_q
// (rows past the last sequence, which no sequence covers, get −1).
std::vector<std::int64_t> row_sequences(const ForwardInputs& in) {
  const TensorView& q = in.q;
  if (!in.varlen.enabled()) return {};
  std::vector<std::int64_t> seq(std::size_t(q.shape[0]), -1);
  const TensorView& cu = in.varlen.cu_seqlens_q;
  const auto* bounds = static_cast<const std::int32_t*>(cu.data);
  for (std::int64_t b = 0; b + 1 < cu.shape[0]; ++b) {
    for (std::int64_t r = bounds[b * cu.stride[0]]; r < bounds[(b + 1) * cu.stride[0]]; ++r) seq[std::size_t(r)] = b;
  }
  return seq;
}

// (sequence, K/V head) of element `index` of a q-like tensor ((b, s, h, d), varlen (rows, h, d)):
// the sequence from `sequence` for varlen rows (−1: no sequence covers the row).
std::pair<std::int64_t, std::int64_t> batch_and_group(const std::int64_t* index,
                                                      const std::vector<std::int64_t>& sequence, std::int64_t group,
                                                      bool varlen) {
  return {varlen ? sequence[std::size_t(index[0])] : index[0], index[varlen ? 1 : 2] / group};
}

// q widened into q32 (a contiguous fp32 view of q's shape), each element times q_descale ·
// k_descale of its (batch, K/V head); sequence: the batch index of each leading row (empty: the
// leading index is the batch, as in a batch-mode q).
template <class Inputs>
TensorView widen_q(const Inputs& in, const std::vector<std::int64_t>& sequence, std::int64_t group, bool varlen,
                   std::vector<float>& q32) {
  const TensorView wide = fp32_like(in.q, q32);
  const auto* q8 = static_cast<const common::e4m3_t*>(in.q.data);
  std::int64_t e = 0;
  for_each_element(in.q, [&](std::int64_t offset, const std::int64_t* index) {
    const auto [b, g] = batch_and_group(index, sequence, group, varlen);
    const float s = b < 0 ? 1.0f : descale_at(in.q_descale, b, g) * descale_at(in.k_descale, b, g);
    q32[std::size_t(e++)] = s * common::to_float(q8[offset]);
  });
  return wide;
}

// x (e4m3) widened exactly into buf; an undefined x stays undefined.
TensorView widen(const TensorView& x, std::vector<float>& buf) {
  if (!x.defined()) return x;
  const TensorView wide = fp32_like(x, buf);
  const auto* x8 = static_cast<const common::e4m3_t*>(x.data);
  std::int64_t e = 0;
  for_each_element(x, [&](std::int64_t offset, const std::int64_t*) { buf[std::size_t(e++)] = common::to_float(x8[offset]); });
  return wide;
}

// The caller's out from the fp32 one: times v_descale of its (batch, K/V head), rounded.
template <class Inputs>
void narrow_out(const Inputs& in, const std::vector<std::int64_t>& sequence, std::int64_t group, bool varlen,
                const std::vector<float>& out32, const TensorView& out) {
  const bool bf16 = out.dtype == DType::bf16;
  std::int64_t e = 0;
  for_each_element(out, [&](std::int64_t offset, const std::int64_t* index) {
    const auto [b, g] = batch_and_group(index, sequence, group, varlen);
    const float value = out32[std::size_t(e++)] * (b < 0 ? 1.0f : descale_at(in.v_descale, b, g));
    if (bf16) {
      static_cast<common::bf16_t*>(out.data)[offset] = common::to_bf16(value);
    } else {
      static_cast<common::f16_t*>(out.data)[offset] = common::to_f16(value);
    }
  });
}

// Where a gathered key row comes from: its (head 0, column 0) element in an e4m3 tensor x; x null:
// no key there (zeros).
struct SourceRow {
  const TensorView* x = nullptr;
  std::int64_t offset = 0;
};

// rows × heads × cols key rows gathered into a contiguous fp32 buffer, exactly: row r from
// row_of(r). The view has `shape` (whose product is rows · heads · cols).
template <class RowOf>
TensorView gather_rows(std::int64_t rows, std::int64_t heads, std::int64_t cols, RowOf&& row_of,
                       std::vector<float>& buf, Device device, std::initializer_list<std::int64_t> shape) {
  buf.assign(std::size_t(rows * heads * cols), 0.0f);
  for (std::int64_t r = 0; r < rows; ++r) {
    const SourceRow src = row_of(r);
    if (src.x == nullptr) continue;
    const TensorView& x = *src.x;
    const auto* x8 = static_cast<const common::e4m3_t*>(x.data);
    for (std::int64_t h = 0; h < heads; ++h) {
      for (std::int64_t c = 0; c < cols; ++c) {
        buf[std::size_t((r * heads + h) * cols + c)] =
            common::to_float(x8[src.offset + h * x.stride[x.ndim - 2] + c * x.stride[x.ndim - 1]]);
      }
    }
  }
  return TensorView::contiguous(buf.data(), DType::f32, shape, device);
}

std::int32_t int_at(const TensorView& t, std::int64_t i) { return static_cast<const std::int32_t*>(t.data)[i * t.stride[0]]; }

// Element offset of key `pos` of sequence b (head 0, column 0) in a KV-cache tensor: its cache row
// (cache_batch_idx, or b) at that position, or the page block_table gives.
std::int64_t cache_offset(const TensorView& cache, const TensorView& block_table, const TensorView& batch_idx,
                          std::int64_t b, std::int64_t pos) {
  if (block_table.defined()) {
    const std::int64_t page_size = cache.shape[1];
    const std::int64_t page =
        static_cast<const std::int32_t*>(block_table.data)[b * block_table.stride[0] + (pos / page_size) * block_table.stride[1]];
    return page * cache.stride[0] + (pos % page_size) * cache.stride[1];
  }
  const std::int64_t row = batch_idx.defined() ? int_at(batch_idx, b) : b;
  return row * cache.stride[0] + pos * cache.stride[1];
}

}  // namespace

void forward_fp8_on_host(const ForwardInputs& in, const ForwardOutputs& out, const Options& opt) {
  const bool varlen = in.varlen.enabled();
  const std::int64_t group = in.q.shape[in.q.ndim - 2] / in.k.shape[in.k.ndim - 2];  // query heads per K/V head
  const std::vector<std::int64_t> sequence = row_sequences(in);
  std::vector<float> q32, k32, v32, out32;
  std::vector<std::int32_t> cu_keys;
  ForwardInputs wide = in;
  wide.q_descale = wide.k_descale = wide.v_descale = {};
  wide.q = widen_q(in, sequence, group, varlen, q32);
  if (in.block_table.defined()) {
    // Paged: each sequence's keys gathered from its pages into a packed varlen K/V (the pool
    // itself may be far larger than the keys the call reads).
    const std::int64_t batch = in.varlen.cu_seqlens_q.shape[0] - 1;
    cu_keys.assign(std::size_t(batch + 1), 0);
    std::vector<std::pair<std::int64_t, std::int64_t>> rows;  // (sequence, position) of each packed key
    for (std::int64_t b = 0; b < batch; ++b) {
      const std::int64_t keys = in.varlen.seqused_k.defined()
                                    ? int_at(in.varlen.seqused_k, b)
                                    : int_at(in.varlen.cu_seqlens_k, b + 1) - int_at(in.varlen.cu_seqlens_k, b);
      for (std::int64_t j = 0; j < keys; ++j) rows.emplace_back(b, j);
      cu_keys[std::size_t(b + 1)] = cu_keys[std::size_t(b)] + std::int32_t(keys);
    }
    const std::int64_t total = std::int64_t(rows.size());
    auto row_of = [&](const TensorView& x) {
      return [&](std::int64_t r) {
        const auto [b, j] = rows[std::size_t(r)];
        return SourceRow{&x, cache_offset(x, in.block_table, {}, b, j)};
      };
    };
    const std::int64_t hk = in.k.shape[2];
    wide.k = gather_rows(total, hk, in.k.shape[3], row_of(in.k), k32, in.q.device, {total, hk, in.k.shape[3]});
    wide.v = gather_rows(total, hk, in.v.shape[3], row_of(in.v), v32, in.q.device, {total, hk, in.v.shape[3]});
    wide.block_table = {};
    wide.varlen.seqused_k = {};
    wide.varlen.cu_seqlens_k = TensorView::contiguous(cu_keys.data(), DType::i32, {batch + 1}, in.q.device);
  } else {
    wide.k = widen(in.k, k32);
    wide.v = widen(in.v, v32);
  }
  ForwardOutputs wide_out = out;
  wide_out.out = fp32_like(out.out, out32);
  forward(wide, wide_out, opt);
  narrow_out(in, sequence, group, varlen, out32, out.out);
}

void forward_kvcache_fp8_on_host(const KVCacheInputs& in, const ForwardOutputs& out, const Options& opt) {
  const std::int64_t batch = in.q.shape[0], group = in.q.shape[2] / in.k_cache.shape[2];
  const std::int64_t capacity = in.block_table.defined() ? in.block_table.shape[1] * in.k_cache.shape[1]
                                                         : in.k_cache.shape[1];
  const std::int64_t new_rows = in.k_new.defined() ? in.k_new.shape[1] : 0;
  // Each sequence's keys after the append: its cache rows below cache_seqlens (the whole capacity
  // without it), then the new rows — gathered into a contiguous fp32 cache of one row per
  // sequence, so that the fp32 call reads only what the call attends to and writes nothing of
  // the caller's caches.
  std::vector<std::int32_t> keys(static_cast<std::size_t>(batch));
  std::int64_t longest = 1;
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::int64_t cached = in.cache_seqlens.defined() ? int_at(in.cache_seqlens, b) : capacity;
    keys[std::size_t(b)] = std::int32_t(cached + new_rows);
    longest = std::max<std::int64_t>(longest, cached + new_rows);
  }
  std::vector<float> q32, k32, v32, out32;
  KVCacheInputs wide;
  wide.q = widen_q(in, {}, group, false, q32);
  auto row_of = [&](const TensorView& cache, const TensorView& fresh) {
    return [&](std::int64_t r) {
      const std::int64_t b = r / longest, pos = r % longest, cached = keys[std::size_t(b)] - new_rows;
      if (pos >= keys[std::size_t(b)]) return SourceRow{};
      if (pos >= cached) return SourceRow{&fresh, b * fresh.stride[0] + (pos - cached) * fresh.stride[1]};
      return SourceRow{&cache, cache_offset(cache, in.block_table, in.cache_batch_idx, b, pos)};
    };
  };
  const std::int64_t hk = in.k_cache.shape[2], d = in.k_cache.shape[3], dv = in.v_cache.shape[3];
  wide.k_cache = gather_rows(batch * longest, hk, d, row_of(in.k_cache, in.k_new), k32, in.q.device,
                             {batch, longest, hk, d});
  wide.v_cache = gather_rows(batch * longest, hk, dv, row_of(in.v_cache, in.v_new), v32, in.q.device,
                             {batch, longest, hk, dv});
  const TensorView lengths = TensorView::contiguous(keys.data(), DType::i32, {batch}, in.q.device);
  wide.cache_seqlens = lengths;
  wide.cache_leftpad = in.cache_leftpad;  // positions of a cache row: the gathered rows start at 0 too
  wide.sinks = in.sinks;
  ForwardOutputs wide_out = out;
  wide_out.out = fp32_like(out.out, out32);
  forward_kvcache(wide, wide_out, opt);

  // The new rows into the caller's caches, as given (e4m3 bytes), once the call has succeeded.
  for (const auto& [cache, fresh] : {std::pair{&in.k_cache, &in.k_new}, std::pair{&in.v_cache, &in.v_new}}) {
    if (!fresh->defined()) continue;
    auto* c8 = static_cast<common::e4m3_t*>(cache->data);
    const auto* n8 = static_cast<const common::e4m3_t*>(fresh->data);
    for (std::int64_t b = 0; b < batch; ++b) {
      for (std::int64_t j = 0; j < new_rows; ++j) {
        const std::int64_t row = cache_offset(*cache, in.block_table, in.cache_batch_idx, b, keys[std::size_t(b)] - new_rows + j);
        for (std::int64_t h = 0; h < cache->shape[2]; ++h) {
          for (std::int64_t c = 0; c < cache->shape[3]; ++c) {
            c8[row + h * cache->stride[2] + c * cache->stride[3]] =
                n8[b * fresh->stride[0] + j * fresh->stride[1] + h * fresh->stride[2] + c * fresh->stride[3]];
          }
        }
      }
    }
  }
  narrow_out(in, {}, group, false, out32, out.out);
}

}  // namespace flashattn::detail
