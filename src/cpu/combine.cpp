// src/cpu/combine.cpp — merge partial attention results over disjoint key sets.
// With lse_s the log-sum-exp of split s: lse = log Σ_s exp(lse_s), out = Σ_s exp(lse_s − lse)·out_s.
// A split that saw no key has lse_s = +∞ by this library's convention (or −∞ from other
// producers): it carries no probability mass and is skipped; a row with no mass at all gets
// out = 0 and lse = +∞, like a fully masked row. A split whose lse is NaN (a NaN score in its
// keys) is not skipped: the row's out and lse become NaN, as in the unsplit attention.
#include <cmath>
#include <limits>
#include <vector>

#include "common/numeric.h"
#include "cpu/cpu.h"

namespace flashattn::cpu {

void combine(const CombineArgs& a) {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> acc(a.head_dim_v);
  for (int b = 0; b < a.batch; ++b) {
    for (int i = 0; i < a.seqlen_q; ++i) {
      for (int h = 0; h < a.heads; ++h) {
        auto lse_of = [&](int s) {
          return a.lse_partial[((std::int64_t(s) * a.batch + b) * a.heads + h) * a.seqlen_q + i];
        };
        float max_lse = -inf;
        bool nan_split = false;
        for (int s = 0; s < a.splits; ++s) {
          const float l = lse_of(s);
          nan_split = nan_split || std::isnan(l);
          if (std::isfinite(l)) max_lse = std::max(max_lse, l);
        }
        std::fill(acc.begin(), acc.end(), 0.0f);
        float lse = inf;
        if (nan_split) {
          lse = std::numeric_limits<float>::quiet_NaN();
          std::fill(acc.begin(), acc.end(), lse);
        } else if (max_lse != -inf) {
          float sum = 0.0f;
          for (int s = 0; s < a.splits; ++s) {
            if (std::isfinite(lse_of(s))) sum += std::exp(lse_of(s) - max_lse);
          }
          lse = max_lse + std::log(sum);
          for (int s = 0; s < a.splits; ++s) {
            if (!std::isfinite(lse_of(s))) continue;
            const float w = std::exp(lse_of(s) - lse);
            const float* o = a.out_partial + s * a.op_strides[0] + b * a.op_strides[1] + i * a.op_strides[2] + h * a.op_strides[3];
            for (int d = 0; d < a.head_dim_v; ++d) acc[d] += w * o[d];
          }
        }
        const std::int64_t off = b * a.out_strides[0] + i * a.out_strides[1] + h * a.out_strides[2];
        for (int d = 0; d < a.head_dim_v; ++d) {
          switch (a.out_storage) {
            case common::Storage::f16: static_cast<common::f16_t*>(a.out)[off + d] = common::to_f16(acc[d]); break;
            case common::Storage::bf16: static_cast<common::bf16_t*>(a.out)[off + d] = common::to_bf16(acc[d]); break;
            case common::Storage::f32: static_cast<float*>(a.out)[off + d] = acc[d]; break;
          }
        }
        if (a.lse) a.lse[(std::int64_t(b) * a.heads + h) * a.seqlen_q + i] = lse;
      }
    }
  }
}

}  // namespace flashattn::cpu
