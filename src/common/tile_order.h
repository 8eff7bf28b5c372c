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
//
// Alternating: the sections take turns going up and down (the last one down), so that where one
// section ends and the next begins, the tiles side by side in a round are of about the same
// length (with every section highest first, a section's shortest tiles meet the next one's
// longest there).
struct MaskedTileOrder {
  int m_blocks;        // row blocks per pair, ≥ 1
  int pairs;           // (head, batch) pairs, ≥ 1
  int section;         // pairs per section, 1 ≤ section ≤ pairs
  int rising_parity;   // sections k with k mod 2 == rising_parity go lowest row block first; −1: none

  // rising_parity for the given sections, alternating or not: the last section falls.
  FA_HOST_DEVICE static int rising_parity_of(int pairs, int section, bool alternate) {
    return alternate ? (pairs + section - 1) / section % 2 : -1;
  }

  struct Tile {
    int m_block;
    int pair;
  };
  // The tile at position index (< m_blocks · pairs).
  FA_HOST_DEVICE Tile at(int index) const {
    const int k = index / (section * m_blocks);  // the section
    const int first = k * section;               // its first pair
    const int in_section = pairs - first < section ? pairs - first : section;
    const int local = index - first * m_blocks;
    const int step = local / in_section;
    return {(k & 1) == rising_parity ? step : m_blocks - 1 - step, first + local % in_section};
  }
};

}  // namespace flashattn::common
