// src/common/tile_order.h — the order in which the Hopper forward's persistent CTAs take the
// output tiles of a masked call (causal or a window): PersistentTileScheduler::tile.
#pragma once

#include "common/macros.h"

namespace flashattn::common {

// Tiles are (row block, (head, batch) pair); under a mask the highest row blocks cost the most and
// go first (longest first shortens the last wave's tail). The pairs are taken in sections of
// `section` pairs (the last may hold fewer); inside one, the highest row block of each pair in
// turn, then the next lower, and so on. One section of every pair is the plain longest-first
// order; sections sized to the K/V that fit in L2 keep each round reading K/V that the section's
// earlier rounds left there.
struct MaskedTileOrder {
  int m_blocks;  // row blocks per pair, ≥ 1
  int pairs;     // (head, batch) pairs, ≥ 1
  int section;   // pairs per section, 1 ≤ section ≤ pairs

  struct Tile {
    int m_block;
    int pair;
  };
  // The tile at position index (< m_blocks · pairs).
  FA_HOST_DEVICE Tile at(int index) const {
    const int first = index / (section * m_blocks) * section;  // the section's first pair
    const int in_section = pairs - first < section ? pairs - first : section;
    const int local = index - first * m_blocks;
    return {m_blocks - 1 - local / in_section, first + local % in_section};
  }
};

}  // namespace flashattn::common
