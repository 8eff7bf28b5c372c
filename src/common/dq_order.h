// src/common/dq_order.h — the order in which a deterministic backward's key tiles add their dQ to
// a row block, where it is not simply descending (the sm90 backward: BwdMainloop::write_dq), and
// the cursor that walks a key tile's steps.
#pragma once

#include "common/macros.h"

namespace flashattn::common {

// Staggered walks. When every key tile's walk covers every row block of its sequence (no causal or
// sliding-window mask) and the sequence has no more key tiles than row blocks, key tile n walks the
// row blocks cyclically from block n: at its j-th step it is at block (n + j) mod m_blocks. At every
// step the tiles are then at distinct row blocks, and the tile before n in a block's order reached
// the block one step before n did, so in steady state no tile waits for its turn. (All tiles
// starting at block 0, each waited for the one before it at every block: a chain of L2 round trips
// as long as the tiles are many, which cost 12–15 % at 1k–4k keys.)
struct StaggeredWalk {
  int n_tiles;   // key tiles of the sequence, ≤ m_blocks
  int m_blocks;  // row blocks of the sequence

  // The row block of tile n (< n_tiles) at step j (< m_blocks).
  FA_HOST_DEVICE int block_at(int n, int j) const {
    const int m = n + j;
    return m >= m_blocks ? m - m_blocks : m;
  }
  // Tile n's turn at row block m: its place among the tiles by the step at which each reaches m
  // (tile m first where m < n_tiles, then m − 1, …, 0, n_tiles − 1, …, m + 1; descending from the
  // last tile for the blocks at or past it).
  FA_HOST_DEVICE int turn(int n, int m) const {
    const int first = m < n_tiles - 1 ? m : n_tiles - 1;
    const int t = first - n;
    return t < 0 ? t + n_tiles : t;
  }
};

// Step s of a walk that takes `limit` inner positions per outer one (the sm90 backward: a GQA
// group's heads at each row block, or a head's row blocks for each head), kept by counting, as
// inner = s mod limit and outer = ⌊s / limit⌋, instead of dividing s at every step on the
// kernel's path. rotated(shift) is (s + shift) mod limit for 0 ≤ shift < limit.
struct StepCursor {
  int limit;  // ≥ 1 wherever a step is taken
  int inner = 0;
  int outer = 0;

  FA_HOST_DEVICE void advance() {
    if (++inner == limit) {
      inner = 0;
      ++outer;
    }
  }
  FA_HOST_DEVICE int rotated(int shift) const {
    const int r = inner + shift;
    return r >= limit ? r - limit : r;
  }
};

}  // namespace flashattn::common
