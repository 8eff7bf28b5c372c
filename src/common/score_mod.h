// src/common/score_mod.h — THE definition of the score s_ij (SPEC §2.1–2.3): scaling, soft-capping
// and ALiBi, and the derivative the backward pass needs.
#pragma once

#include <cmath>

#include "common/macros.h"

namespace flashattn::common {

// Acc is float in the fast backends and double in the reference.
template <class Acc>
struct ScoreMod {
  Acc scale = 1;        // softmax_scale
  Acc softcap = 0;      // 0: off
  Acc alibi_slope = 0;  // of this (batch, head); 0: off
  long long diag_offset = 0;  // seqlen_k − seqlen_q, for ALiBi's distance |i + sk − sq − j|

  // s = cap(scale · dot) − slope · |i + sk − sq − j|
  FA_HOST_DEVICE Acc operator()(Acc dot, int i, int j) const {
    Acc s = scale * dot;
    if (softcap > 0) s = softcap * std::tanh(s / softcap);
    if (alibi_slope != 0) s -= alibi_slope * alibi_distance(i, j);
    return s;
  }
  FA_HOST_DEVICE Acc alibi_distance(int i, int j) const {
    const long long dist = (long long)i + diag_offset - j;
    return Acc(dist < 0 ? -dist : dist);
  }
  // d s / d dot, given the final score s (ALiBi adds a constant, so it does not matter; for the
  // softcap, d/dx [c·tanh(x/c)] = 1 − tanh² = 1 − ((s + alibi) / c)²).
  FA_HOST_DEVICE Acc dscore_ddot(Acc s, int i, int j) const {
    if (!(softcap > 0)) return scale;
    const Acc t = (s + alibi_slope * alibi_distance(i, j)) / softcap;
    return scale * (Acc(1) - t * t);
  }
};

}  // namespace flashattn::common
