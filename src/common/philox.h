// src/common/philox.h — Philox-4x32-10 (Salmon et al., SC'11) and THE dropout mask (SPEC §3).
// The counter layout is documented in docs/dropout.md; keep the two in step.
#pragma once

#include <cstdint>

#include "common/macros.h"

namespace flashattn::common {

struct Philox4 {
  std::uint32_t x, y, z, w;
};

FA_HOST_DEVICE void mul_hi_lo(std::uint32_t a, std::uint32_t b, std::uint32_t& hi,
                              std::uint32_t& lo) {
  const std::uint64_t p = std::uint64_t(a) * b;
  hi = std::uint32_t(p >> 32);
  lo = std::uint32_t(p);
}

// Philox-4x32 with 10 rounds; key = (k0, k1).
FA_HOST_DEVICE Philox4 philox4x32_10(Philox4 ctr, std::uint32_t k0, std::uint32_t k1) {
  constexpr std::uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;    // round multipliers
  constexpr std::uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;  // key schedule increments
  constexpr int kRounds = 10;
  for (int round = 0; round < kRounds; ++round) {
    std::uint32_t hi0, lo0, hi1, lo1;
    mul_hi_lo(kMul0, ctr.x, hi0, lo0);
    mul_hi_lo(kMul1, ctr.z, hi1, lo1);
    ctr = Philox4{hi1 ^ ctr.y ^ k0, lo1, hi0 ^ ctr.w ^ k1, lo0};
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return ctr;
}

// --- the dropout mask -------------------------------------------------------------------------
//
// The score matrix of one (batch, head) is cut into 16×16 blocks. Inside a block, "lane"
// ℓ = 4·(i mod 8) + ((j mod 8) div 2) owns the 8 elements
//     (i0 + a·8, j0 + b + c·8),  a, b, c ∈ {0, 1},  i0 = 16⌊i/16⌋ + (i mod 8), j0 = 16⌊j/16⌋ + 2·((j mod 8) div 2)
// — exactly what one thread of an sm80 m16n8k16 (or sm90 wgmma) accumulator holds for a 16×16
// tile. One Philox call per (block, lane) gives 128 bits = 8 uniform 16-bit values, element
// e = 4c + 2a + b taking the (e mod 2)-th half (low first) of 32-bit word ⌊e/2⌋.
//   key     = (seed mod 2^32, seed div 2^32)
//   counter = (32·⌊j/16⌋ + ℓ,  ⌊i/16⌋,  lo32(offset + batch·h + head),  hi32(...))
// An element is kept iff its 16-bit value < keep_threshold = round((1 − p) · 65536).

struct DropoutParams {
  std::uint64_t seed = 0;
  std::uint64_t offset = 0;
  // Options::dropout_row_offset / dropout_col_offset in 16×16 blocks, added to every block index.
  std::uint32_t block_row_offset = 0;
  std::uint32_t block_col_offset = 0;
  std::uint32_t keep_threshold = 65536;  // of 65536: keep probability in units of 2^-16
  float keep_scale = 1.0f;               // 1 / (1 − p)
};

FA_HOST_DEVICE std::uint32_t dropout_keep_threshold(float p) {
  constexpr float kUnits = 65536.0f;
  return std::uint32_t((1.0f - p) * kUnits + 0.5f);
}

// The 8 keep bits (bit e = element e above) of one lane of one 16×16 block.
// stream = batch·h + head.
FA_HOST_DEVICE std::uint32_t dropout_keep_bits(const DropoutParams& dp, std::uint64_t stream,
                                               int block_i, int block_j, int lane) {
  const std::uint64_t sub = dp.offset + stream;
  block_i += int(dp.block_row_offset);
  block_j += int(dp.block_col_offset);
  const Philox4 r = philox4x32_10(
      Philox4{std::uint32_t(block_j) * 32u + std::uint32_t(lane), std::uint32_t(block_i),
              std::uint32_t(sub), std::uint32_t(sub >> 32)},
      std::uint32_t(dp.seed), std::uint32_t(dp.seed >> 32));
  const std::uint32_t words[4] = {r.x, r.y, r.z, r.w};
  std::uint32_t bits = 0;
  for (int e = 0; e < 8; ++e) {
    const std::uint32_t v = (words[e >> 1] >> ((e & 1) * 16)) & 0xffffu;
    bits |= std::uint32_t(v < dp.keep_threshold) << e;
  }
  return bits;
}

// Element (i, j) of a 16×16 block: its lane and its bit within the lane's 8.
FA_HOST_DEVICE constexpr int dropout_lane(int i, int j) { return 4 * (i & 7) + ((j & 7) >> 1); }
FA_HOST_DEVICE constexpr int dropout_element(int i, int j) {
  return 4 * ((j >> 3) & 1) + 2 * ((i >> 3) & 1) + (j & 1);
}
// The element number of (i0 + di, j0 + dj) for a lane's first element (i0, j0) — i0 mod 16 < 8,
// j0 mod 16 < 8 and even, the corner where a thread's MMA fragment of the block starts — and the
// offsets of its other elements, di ∈ {0, 8}, dj ∈ {0, 1, 8, 9}: it depends on the offsets alone,
// so a kernel whose offsets are compile-time constants gets a constant instead of computing it
// from each element's coordinates.
FA_HOST_DEVICE constexpr int dropout_element_at(int di, int dj) { return dropout_element(di, dj); }

// The transposed fragment (the backward's Sᵀ, keys × query rows, in the same MMA layout): the
// thread in lane L = 4g + t holds, of block (bi, bj), the elements
//     (i, j) = (16·bi + 2t + b + 8c, 16·bj + g + 8a),  a, b, c ∈ {0, 1}
// — the forward layout's roles of i and j swapped. Each comes from forward lane 4·(2t + b) + g/2,
// element 4a + 2c + (g mod 2): two lanes per thread (b = 0, 1), whose bits a kernel fetches from
// the threads that drew them (each thread draws its own lane's).
struct DropoutSource {
  int lane;
  int element;
};
FA_HOST_DEVICE constexpr DropoutSource dropout_transposed_source(int lane, int a, int b, int c) {
  return DropoutSource{8 * (lane % 4) + 4 * b + (lane / 4) / 2, 4 * a + 2 * c + ((lane / 4) & 1)};
}

// keep_ij for one element (the reference's way: one Philox call per element, 7 of 8 bits unused).
FA_HOST_DEVICE bool dropout_keep(const DropoutParams& dp, std::uint64_t stream, int i, int j) {
  const std::uint32_t bits = dropout_keep_bits(dp, stream, i >> 4, j >> 4, dropout_lane(i, j));
  return (bits >> dropout_element(i, j)) & 1u;
}

}  // namespace flashattn::common
