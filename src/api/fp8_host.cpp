// src/api/fp8_host.cpp — FP8 forward calls on the CPU backends (fp8_host.h).
#include "api/fp8_host.h"

#include <cstdint>
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
    const std::int64_t b = varlen ? sequence[std::size_t(index[0])] : index[0];
    const std::int64_t g = index[varlen ? 1 : 2] / group;
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
    const std::int64_t b = varlen ? sequence[std::size_t(index[0])] : index[0];
    const std::int64_t g = index[varlen ? 1 : 2] / group;
    const float value = out32[std::size_t(e++)] * (b < 0 ? 1.0f : descale_at(in.v_descale, b, g));
    if (bf16) {
      static_cast<common::bf16_t*>(out.data)[offset] = common::to_bf16(value);
    } else {
      static_cast<common::f16_t*>(out.data)[offset] = common::to_f16(value);
    }
  });
}

}  // namespace

void forward_fp8_on_host(const ForwardInputs& in, const ForwardOutputs& out, const Options& opt) {
  const bool varlen = in.varlen.enabled();
  const std::int64_t group = in.q.shape[in.q.ndim - 2] / in.k.shape[in.k.ndim - 2];  // query heads per K/V head
  const std::vector<std::int64_t> sequence = row_sequences(in);
  std::vector<float> q32, k32, v32, out32;
  ForwardInputs wide = in;
  wide.q_descale = wide.k_descale = wide.v_descale = {};
  wide.q = widen_q(in, sequence, group, varlen, q32);
  wide.k = widen(in.k, k32);
  wide.v = widen(in.v, v32);
  ForwardOutputs wide_out = out;
  wide_out.out = fp32_like(out.out, out32);
  forward(wide, wide_out, opt);
  narrow_out(in, sequence, group, varlen, out32, out.out);
}

void forward_kvcache_fp8_on_host(const KVCacheInputs& in, const ForwardOutputs& out, const Options& opt) {
  const std::int64_t group = in.q.shape[2] / in.k_cache.shape[2];
  std::vector<float> q32, k32, v32, kn32, vn32, out32;
  KVCacheInputs wide = in;
  wide.q_descale = wide.k_descale = wide.v_descale = {};
  wide.q = widen_q(in, {}, group, false, q32);
  wide.k_cache = widen(in.k_cache, k32);
  wide.v_cache = widen(in.v_cache, v32);
  wide.k_new = widen(in.k_new, kn32);
  wide.v_new = widen(in.v_new, vn32);
  ForwardOutputs wide_out = out;
  wide_out.out = fp32_like(out.out, out32);
  forward_kvcache(wide, wide_out, opt);
  if (in.k_new.defined()) {
    for (const auto& [cache, from] : {std::pair{&in.k_cache, &k32}, std::pair{&in.v_cache, &v32}}) {
      auto* c8 = static_cast<common::e4m3_t*>(cache->data);
      std::int64_t e = 0;
      for_each_element(*cache, [&](std::int64_t offset, const std::int64_t*) {
        c8[offset] = common::to_e4m3((*from)[std::size_t(e++)]);
      });
    }
  }
  narrow_out(in, {}, group, false, out32, out.out);
}

}  // namespace flashattn::detail
