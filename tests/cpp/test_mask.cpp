// tests/cpp/test_mask.cpp — the block bounds of src/common/mask.h against Mask::visible, element by
// element, over every small shape, window and block size: the forward walks key blocks by
// block_col_*, the backward walks row blocks by block_row_*, and the deterministic CUDA backward
// orders its dQ additions by assuming the two walks are transposes of each other (or, unmasked,
// by staggering the walks: src/common/dq_order.h); the offset form of the mask and the step
// cursor the sm90 backward uses; and the order of the Hopper forward's tiles under a mask
// (src/common/tile_order.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "common/dq_order.h"
#include "common/mask.h"
#include "common/tile_order.h"

namespace {

using flashattn::common::Mask;
using flashattn::common::make_mask;

bool block_meets(const Mask& m, int r0, int r1, int c0, int c1) {
  for (int i = r0; i < r1; ++i)
    for (int j = c0; j < c1; ++j)
      if (m.visible(i, j)) return true;
  return false;
}

struct MaskCase {
  bool causal;
  int left, right;
};

const MaskCase kMasks[] = {{false, -1, -1}, {true, -1, -1}, {false, 3, 0}, {false, 0, 5}, {false, 2, 7},
                           {true, 4, -1},   {false, 0, 0},  {false, 11, -1}, {false, -1, 2}};

TEST(Mask, RowAndColumnBlockBoundsAreExact) {
  int checked = 0;
  for (const MaskCase& mc : kMasks) {
    for (int sq = 1; sq <= 23; sq += 2) {
      for (int sk = 1; sk <= 23; sk += 3) {
        const Mask m = make_mask(mc.causal, mc.left, mc.right, sk, sq, sk);
        for (int bm : {1, 4, 8}) {
          for (int bn : {1, 3, 8}) {
            for (int r0 = 0; r0 < sq; r0 += bm) {
              const int r1 = std::min(r0 + bm, sq);
              for (int c0 = 0; c0 < sk; c0 += bn) {
                const int c1 = std::min(c0 + bn, sk);
                const bool meets = block_meets(m, r0, r1, c0, c1);
                // Columns of the row block, as the forward sees them.
                const bool by_cols = m.block_col_begin(r0) < c1 && m.block_col_end(r1) > c0 &&
                                     m.block_col_begin(r0) < m.block_col_end(r1);
                // Rows of the key block, as the backward sees them.
                const bool by_rows = m.block_row_begin(c0) < r1 && m.block_row_end(c1) > r0 &&
                                     m.block_row_begin(c0) < m.block_row_end(c1);
                ASSERT_EQ(by_rows, by_cols) << "sq " << sq << " sk " << sk << " rows [" << r0 << "," << r1
                                            << ") cols [" << c0 << "," << c1 << ") causal " << mc.causal
                                            << " window " << mc.left << "," << mc.right;
                // The bounds may include blocks with no visible element (rows whose range is
                // empty), never exclude one that has.
                if (meets) ASSERT_TRUE(by_rows);
                ++checked;
              }
            }
          }
        }
      }
    }
  }
  EXPECT_GT(checked, 10000);
}

TEST(Mask, RowBoundsHoldEveryRowThatSeesTheBlock) {
  for (const MaskCase& mc : kMasks) {
    for (int sq : {1, 5, 17}) {
      for (int sk : {1, 6, 19}) {
        const Mask m = make_mask(mc.causal, mc.left, mc.right, sk, sq, sk);
        for (int c0 = 0; c0 < sk; ++c0) {
          for (int c1 = c0 + 1; c1 <= sk; ++c1) {
            for (int i = 0; i < sq; ++i) {
              if (block_meets(m, i, i + 1, c0, c1)) {
                ASSERT_GE(i, m.block_row_begin(c0));
                ASSERT_LT(i, m.block_row_end(c1));
              }
            }
          }
        }
      }
    }
  }
}

// The offset form (Mask::offset_min / offset_max), which the sm90 backward's masked steps test in
// 32 bits, against Mask::visible: every element of every small case, and rows and keys near 2^31
// where visible's 64-bit diagonal is needed (the offset itself stays small there).
TEST(Mask, OffsetFormMatchesVisible) {
  int checked = 0;
  auto agree = [&](const Mask& m, int i, int j) {
    const int off = m.offset(i, j);
    return (off >= m.offset_min() && off <= m.offset_max()) == m.visible(i, j);
  };
  for (const MaskCase& mc : kMasks) {
    for (int sq = 1; sq <= 19; sq += 3) {
      for (int sk = 1; sk <= 19; sk += 2) {
        const Mask m = make_mask(mc.causal, mc.left, mc.right, sk, sq, sk);
        // Rows and keys past the sequence too (a tile's padding): the kernels test keys against
        // seqlen_k apart, and padded rows have P = 0.
        for (int i = 0; i < sq + 8; ++i) {
          for (int j = 0; j < sk + 8; ++j) {
            ASSERT_TRUE(agree(m, i, j)) << "sq " << sq << " sk " << sk << " i " << i << " j " << j << " causal "
                                        << mc.causal << " window " << mc.left << "," << mc.right;
            ++checked;
          }
        }
      }
    }
  }
  const int big = 0x7fffffff - 256;
  for (const MaskCase& mc : kMasks) {
    for (const auto& [sq, sk] : {std::pair{big, big}, std::pair{1, big}, std::pair{big, 1}, std::pair{big / 2, big}}) {
      const Mask m = make_mask(mc.causal, mc.left, mc.right, sk, sq, sk);
      for (int i : {0, 1, sq / 2, sq - 1}) {
        for (int j : {0, 1, 7, sk / 2, sk - 2, sk - 1}) {
          ASSERT_TRUE(agree(m, i, j)) << "sq " << sq << " sk " << sk << " i " << i << " j " << j;
          ++checked;
        }
      }
    }
  }
  EXPECT_GT(checked, 20000);
}

// The deterministic sm90 backward adds a key tile's dQ to row block m at turn
// ⌊(block_col_end(m's row end) − 1) / block_n⌋ − n (BwdMainloop::write_dq, descending): that holds
// when the key tiles whose backward walk (block_row_*) reaches m are exactly the consecutive tiles
// from that of its first visible key to that of its last.
TEST(Mask, KeyTilesReachingARowBlockAreConsecutiveFromItsFirstToItsLastColumn) {
  int checked = 0;
  for (const MaskCase& mc : kMasks) {
    for (int sq = 1; sq <= 40; sq += 3) {
      for (int sk = 1; sk <= 40; sk += 4) {
        const Mask m = make_mask(mc.causal, mc.left, mc.right, sk, sq, sk);
        for (int bm : {2, 4, 8}) {
          for (int bn : {3, 4, 8}) {
            for (int r0 = 0; r0 < sq; r0 += bm) {
              const int r1 = std::min(r0 + bm, sq);
              std::vector<int> tiles;  // the key tiles whose walk takes row block [r0, r1)
              for (int c0 = 0; c0 < sk; c0 += bn) {
                const int c1 = std::min(c0 + bn, sk);
                const int row_b = m.block_row_begin(c0), row_e = m.block_row_end(c1);
                const int mb0 = row_b / bm, mb1 = row_e > row_b ? (row_e + bm - 1) / bm : mb0;
                if (r0 / bm >= mb0 && r0 / bm < mb1) tiles.push_back(c0 / bn);
              }
              if (tiles.empty()) continue;
              const int first = m.block_col_begin(r0) / bn;
              // ... and end at the tile of its last visible key (the descending turn's origin).
              ASSERT_EQ(tiles.back(), (m.block_col_end(r1) - 1) / bn)
                  << "sq " << sq << " sk " << sk << " rows [" << r0 << "," << r1 << ") tiles of " << bn;
              for (std::size_t k = 0; k < tiles.size(); ++k) {
                ASSERT_EQ(tiles[k] - first, int(k)) << "sq " << sq << " sk " << sk << " rows [" << r0 << "," << r1
                                                    << ") tiles of " << bn << " causal " << mc.causal << " window "
                                                    << mc.left << "," << mc.right;
              }
              ++checked;
            }
          }
        }
      }
    }
  }
  EXPECT_GT(checked, 1000);
}

// The staggered walks (src/common/dq_order.h): every tile takes every row block once; at each step
// the tiles are at distinct blocks; a block's turns number its tiles 0, 1, … in the order of the
// steps at which they reach it (so the tile before another reached the block at an earlier step).
TEST(Mask, StaggeredWalksGiveEachRowBlockItsTilesInTheOrderTheyArrive) {
  using flashattn::common::StaggeredWalk;
  int checked = 0;
  for (int m_blocks = 1; m_blocks <= 24; ++m_blocks) {
    for (int n_tiles = 1; n_tiles <= m_blocks; ++n_tiles) {
      const StaggeredWalk w{n_tiles, m_blocks};
      std::vector<std::vector<int>> step_of(n_tiles, std::vector<int>(m_blocks, -1));
      for (int j = 0; j < m_blocks; ++j) {
        std::vector<bool> taken(m_blocks, false);
        for (int n = 0; n < n_tiles; ++n) {
          const int m = w.block_at(n, j);
          ASSERT_TRUE(m >= 0 && m < m_blocks);
          ASSERT_FALSE(taken[m]) << "two tiles at block " << m << " at step " << j;
          taken[m] = true;
          ASSERT_EQ(step_of[n][m], -1) << "tile " << n << " takes block " << m << " twice";
          step_of[n][m] = j;
        }
      }
      for (int m = 0; m < m_blocks; ++m) {
        std::vector<int> by_turn(n_tiles, -1);
        for (int n = 0; n < n_tiles; ++n) {
          const int turn = w.turn(n, m);
          ASSERT_TRUE(turn >= 0 && turn < n_tiles);
          ASSERT_EQ(by_turn[turn], -1) << "turn " << turn << " twice at block " << m;
          by_turn[turn] = n;
        }
        for (int k = 1; k < n_tiles; ++k) {
          ASSERT_LT(step_of[by_turn[k - 1]][m], step_of[by_turn[k]][m])
              << "block " << m << " of " << m_blocks << ", " << n_tiles << " tiles: turn " << k;
        }
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 1000);
}

// The step cursor (src/common/dq_order.h), which the sm90 backward's producer, consumers and dQ
// writer advance instead of dividing each step's index: after s steps it holds s mod limit and
// ⌊s / limit⌋, and rotated(shift) is (s + shift) mod limit.
TEST(Mask, StepCursorCountsWhatTheDivisionsGive) {
  using flashattn::common::StepCursor;
  int checked = 0;
  for (int limit = 1; limit <= 17; ++limit) {
    for (int shift = 0; shift < limit; ++shift) {
      StepCursor c{limit};
      for (int s = 0; s < 5 * limit + 3; ++s, c.advance()) {
        ASSERT_EQ(c.inner, s % limit) << "limit " << limit << " step " << s;
        ASSERT_EQ(c.outer, s / limit) << "limit " << limit << " step " << s;
        ASSERT_EQ(c.rotated(shift), (s + shift) % limit) << "limit " << limit << " shift " << shift << " step " << s;
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 1000);
}

// The masked tile order (src/common/tile_order.h): every (row block, pair) exactly once; the pairs
// of one section are all taken before the next section's; inside a section the row blocks never
// rise (with alternate, every other section's never fall, the last section's falling); and one
// section of every pair is the plain order, row blocks outermost, highest first.
TEST(Mask, MaskedTileOrderTakesEveryTileOnceSectionBySectionHighestRowsFirst) {
  using flashattn::common::MaskedTileOrder;
  int checked = 0;
  for (bool alternate : {false, true}) {
    for (int m_blocks = 1; m_blocks <= 9; ++m_blocks) {
      for (int pairs = 1; pairs <= 13; ++pairs) {
        for (int section = 1; section <= pairs; ++section) {
          const MaskedTileOrder order{m_blocks, pairs, section,
                                      MaskedTileOrder::rising_parity_of(pairs, section, alternate)};
          const int sections = (pairs + section - 1) / section;
          std::vector<int> seen(m_blocks * pairs, 0);
          int last_section = -1, last_m = 0;
          for (int i = 0; i < m_blocks * pairs; ++i) {
            const auto t = order.at(i);
            ASSERT_TRUE(t.m_block >= 0 && t.m_block < m_blocks && t.pair >= 0 && t.pair < pairs)
                << m_blocks << " blocks, " << pairs << " pairs, section " << section << ": index " << i;
            ++seen[t.m_block * pairs + t.pair];
            const int s = t.pair / section;
            ASSERT_GE(s, last_section) << "index " << i << " goes back to an earlier section";
            const bool up = alternate && (sections - 1 - s) % 2 == 1;
            if (s == last_section) {
              if (up) {
                ASSERT_GE(t.m_block, last_m) << "index " << i << ": a row block falls in a rising section";
              } else {
                ASSERT_LE(t.m_block, last_m) << "index " << i << ": a row block rises inside its section";
              }
            }
            if (s == sections - 1) ASSERT_FALSE(up) << "the last section rises";
            last_section = s;
            last_m = t.m_block;
            if (section == pairs) {
              ASSERT_EQ(t.m_block, m_blocks - 1 - i / pairs);
              ASSERT_EQ(t.pair, i % pairs);
            }
          }
          for (int n : seen) ASSERT_EQ(n, 1) << m_blocks << " blocks, " << pairs << " pairs, section " << section;
          ++checked;
        }
      }
    }
  }
  EXPECT_GT(checked, 1000);
}

}  // namespace
