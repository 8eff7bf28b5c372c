// src/cpu/kvcache.cpp — host side of the KV-cache entry point: append new keys/values into the
// cache in place (rotating keys), and rotate the queries, with the one rotary definition of
// src/common/rotary.h.
#include <vector>

#include "common/numeric.h"
#include "common/rotary.h"
#include "cpu/cpu.h"
#include "cpu/storage_dispatch.h"

namespace flashattn::cpu {
namespace {

// A head_dim vector of storage T held in fp32 while it is rotated.
struct RowVec {
  std::vector<float> x;
  float get(int i) const { return x[i]; }
  void set(int i, float v) { x[i] = v; }
};

template <class T>
void copy_row(const T* src, T* dst, int n, const AppendArgs& a, int position) {
  if (a.rotary_dim == 0) {
    for (int i = 0; i < n; ++i) dst[i] = src[i];
    return;
  }
  RowVec v{std::vector<float>(n)};
  for (int i = 0; i < n; ++i) v.x[i] = common::to_float(src[i]);
  const T* cos = static_cast<const T*>(a.rotary_cos) + std::int64_t(position) * a.rotary_cos_stride;
  const T* sin = static_cast<const T*>(a.rotary_sin) + std::int64_t(position) * a.rotary_sin_stride;
  common::rotate(v, common::RotaryTableRow<T>{cos}, common::RotaryTableRow<T>{sin}, a.rotary_dim,
                 a.rotary_interleaved);
  for (int i = 0; i < n; ++i) dst[i] = common::from_float<T>(v.x[i]);
}

template <class T>
void append(const common::AttentionParams& p, const AppendArgs& a) {
  for (int b = 0; b < p.batch; ++b) {
    for (int t = 0; t < a.seqlen_new; ++t) {
      const int j = a.cache_seqlens[b] + t;  // cache row written, also the rotary position
      for (int hk = 0; hk < p.heads_k; ++hk) {
        const T* k_src = static_cast<const T*>(a.k_new) + b * a.k_new_strides[0] + t * a.k_new_strides[1] + hk * a.k_new_strides[2];
        const T* v_src = static_cast<const T*>(a.v_new) + b * a.v_new_strides[0] + t * a.v_new_strides[1] + hk * a.v_new_strides[2];
        T* k_dst = static_cast<T*>(p.k.data) + p.k_offset(p.k, b, j, hk);
        T* v_dst = static_cast<T*>(p.v.data) + p.k_offset(p.v, b, j, hk);
        copy_row(k_src, k_dst, p.head_dim, a, j);
        AppendArgs plain = a;
        plain.rotary_dim = 0;  // values are never rotated
        copy_row(v_src, v_dst, p.head_dim_v, plain, j);
      }
    }
  }
}

template <class T>
void rotate_queries(const common::AttentionParams& p, const AppendArgs& a, bool per_row, T* out) {
  for (int b = 0; b < p.batch; ++b) {
    for (int i = 0; i < p.max_seqlen_q; ++i) {
      const int position = common::rotary_q_position(a, b, i, per_row);
      for (int hh = 0; hh < p.heads; ++hh) {
        const T* src = static_cast<const T*>(p.q.data) + p.q_offset(p.q, b, i, hh);
        T* dst = out + ((std::int64_t(b) * p.max_seqlen_q + i) * p.heads + hh) * p.head_dim;
        copy_row(src, dst, p.head_dim, a, position);
      }
    }
  }
}

}  // namespace

void append_kv(const common::AttentionParams& p, const AppendArgs& a) {
  with_storage(p.storage, [&](auto tag) { append<decltype(tag)>(p, a); });
}

void rotate_q(const common::AttentionParams& p, const AppendArgs& a, bool positions_per_row, void* q_rotated) {
  with_storage(p.storage, [&](auto tag) {
    using T = decltype(tag);
    rotate_queries<T>(p, a, positions_per_row, static_cast<T*>(q_rotated));
  });
}

}  // namespace flashattn::cpu
