// src/common/sink.h — THE definition of how an attention sink (docs/sinks.md) joins a row's
// softmax, for every backend: a per-head logit s_h, in the units of the scores, that adds
// exp(s_h) to the denominator and nothing to the output.
//   lse_i = log(exp(s_h) + Σ_visible exp(s_ij)),  p_ij = exp(s_ij − lse_i),  out_i = Σ_j p_ij v_j.
// A row without a visible key has out = 0 (an empty sum) and lse = s_h; a sink of −∞ is no sink
// (lse = +∞ there, SPEC §2.5). The forward's fast paths keep (row max, Σ 2^(y − max)) in log2
// units and fold the sink in once, at the end, with fold_sink.
#pragma once

#include "common/macros.h"

namespace flashattn::common {

// The lse of a row that sees no key: the sink alone, or +∞ when there is none (s_h = −∞). A NaN
// sink stays NaN.
FA_HOST_DEVICE float empty_row_lse(float sink) {
  return sink == -__builtin_huge_valf() ? __builtin_huge_valf() : sink;
}
FA_HOST_DEVICE double empty_row_lse(double sink) {
  return sink == -__builtin_huge_val() ? __builtin_huge_val() : sink;
}

// A row's softmax statistics in log2 units after the sink joined them: the new max m' and
// sum' = Σ 2^(y − m'), and `rescale` = 2^(m − m'), the factor that moves the output accumulator
// (relative to the old max m) to m'. The caller normalises out by rescale / sum' and takes
// lse = (m' + log2 sum') · ln 2.
template <class Acc>
struct SinkFold {
  Acc max_log2;
  Acc sum;
  Acc rescale;
};

// max_log2, sum: the row's statistics over its visible keys (sum > 0: a row with a key);
// sink_log2 = s_h · log2 e. The max moves to the sink when the sink is larger, so no term exceeds
// 2^0 and nothing overflows however large the sink. A NaN sink makes every result NaN; a sink of
// +∞ gives 2^(∞ − ∞) = NaN too, as a score of +∞ does. exp2: the caller's 2^x (std::exp2, or the
// GPU's exp2 unit).
template <class Acc, class Exp2>
FA_HOST_DEVICE SinkFold<Acc> fold_sink(Acc max_log2, Acc sum, Acc sink_log2, Exp2 exp2) {
  // (written so that a NaN sink wins the comparison: fmax would drop it)
  const bool sink_larger = sink_log2 > max_log2 || sink_log2 != sink_log2;
  const Acc new_max = sink_larger ? sink_log2 : max_log2;
  const Acc rescale = sink_larger ? exp2(max_log2 - new_max) : Acc(1);
  return {new_max, sum * rescale + exp2(sink_log2 - new_max), rescale};
}

}  // namespace flashattn::common
