// src/common/rotary.h — THE rotary embedding used when appending to a KV cache (and for q).
#pragma once

#include "common/macros.h"

namespace flashattn::common {

// Rotates the first rotary_dim entries of x in place at one position, given that position's
// cos/sin rows (rotary_dim / 2 entries each). Non-interleaved (GPT-NeoX) pairs x[i] with
// x[i + rotary_dim/2]; interleaved (GPT-J) pairs x[2i] with x[2i + 1]. Entries past rotary_dim
// are unchanged. Load/Store convert between the storage type and float.
template <class Acc, class Vec, class CosSin>
FA_HOST_DEVICE void rotate(Vec& x, const CosSin& cos_row, const CosSin& sin_row, int rotary_dim,
                           bool interleaved) {
  const int half = rotary_dim / 2;
  for (int i = 0; i < half; ++i) {
    const int a = interleaved ? 2 * i : i;
    const int b = interleaved ? 2 * i + 1 : i + half;
    const Acc c = cos_row(i), s = sin_row(i);
    const Acc xa = x.get(a), xb = x.get(b);
    x.set(a, xa * c - xb * s);
    x.set(b, xa * s + xb * c);
  }
}

}  // namespace flashattn::common
