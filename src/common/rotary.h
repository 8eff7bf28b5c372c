// src/common/rotary.h — THE rotary embedding used when appending to a KV cache (and for q).
#pragma once

#include <math.h>

#include "common/macros.h"
#include "common/numeric.h"

namespace flashattn::common {

// The two entries that rotation i (0 ≤ i < rotary_dim / 2) turns: non-interleaved (GPT-NeoX)
// pairs x[i] with x[i + rotary_dim/2]; interleaved (GPT-J) pairs x[2i] with x[2i + 1].
struct RotaryPair {
  int a, b;
};
FA_HOST_DEVICE RotaryPair rotary_pair(int i, int rotary_dim, bool interleaved) {
  return interleaved ? RotaryPair{2 * i, 2 * i + 1} : RotaryPair{i, i + rotary_dim / 2};
}

// A product that stays a separate, rounded product: nvcc would otherwise be free to fuse it into
// a neighbouring add.
FA_HOST_DEVICE float rounded_product(float x, float y) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(x, y);
#else
  return x * y;
#endif
}

// (xa, xb) → (xa·cos − xb·sin, xa·sin + xb·cos) in fp32, with the fused multiply-add written out.
// Why: compilers contract a·b ± c·d into an FMA at will (nvcc always, GCC under -march=native),
// and which of the two products gets fused changes the last bit. Spelled out, every backend and
// every host build rounds alike — the second product once, then one FMA — so the CUDA append is
// bit-identical to the CPU's.
FA_HOST_DEVICE void rotate_pair(float& xa, float& xb, float cos, float sin) {
  const float ya = fmaf(xa, cos, -rounded_product(xb, sin));
  const float yb = fmaf(xa, sin, rounded_product(xb, cos));
  xa = ya;
  xb = yb;
}

// Rotates the first rotary_dim entries of x at one position, given that position's cos/sin rows
// (rotary_dim / 2 entries each, read as float). Entries past rotary_dim are unchanged. x has
// get(i) → float and set(i, float) (the storage conversions are x's business). Rotations
// first_pair, first_pair + pair_step, … are done, so that the lanes of a GPU warp can share one
// vector; the defaults do them all.
template <class Vec, class CosSin>
FA_HOST_DEVICE void rotate(Vec& x, const CosSin& cos_row, const CosSin& sin_row, int rotary_dim,
                           bool interleaved, int first_pair = 0, int pair_step = 1) {
  for (int i = first_pair; i < rotary_dim / 2; i += pair_step) {
    const RotaryPair pair = rotary_pair(i, rotary_dim, interleaved);
    float xa = x.get(pair.a), xb = x.get(pair.b);
    rotate_pair(xa, xb, cos_row(i), sin_row(i));
    x.set(pair.a, xa);
    x.set(pair.b, xb);
  }
}

// One position's row of rotary_cos or rotary_sin, in storage T, read as float.
template <class T>
struct RotaryTableRow {
  const T* row;
  FA_HOST_DEVICE float operator()(int i) const { return to_float(row[i]); }
};

}  // namespace flashattn::common
