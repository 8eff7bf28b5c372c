// src/common/mask.h — THE definition of which keys a query sees (SPEC §2.4). Every backend and the
// reference call this; nothing else in the tree decides visibility.
#pragma once

#include "common/macros.h"

namespace flashattn::common {

// Causal and sliding-window masks, aligned to the bottom-right corner: query row i of a sequence
// with seqlen_q queries and seqlen_k keys sits on diagonal r = i + seqlen_k − seqlen_q.
// Key j is visible iff (left < 0 or j ≥ r − left) and (right < 0 or j ≤ r + right).
struct Mask {
  int window_left = -1;   // −1: unbounded
  int window_right = -1;  // −1: unbounded; causal is right = 0
  int seqlen_q = 0;
  int seqlen_k = 0;

  FA_HOST_DEVICE long long diagonal(int i) const {
    return (long long)i + seqlen_k - seqlen_q;
  }
  FA_HOST_DEVICE bool visible(int i, int j) const {
    const long long r = diagonal(i);
    return (window_left < 0 || j >= r - window_left) && (window_right < 0 || j <= r + window_right);
  }
  // The visible keys of row i form the range [col_begin(i), col_end(i)) — possibly empty.
  FA_HOST_DEVICE int col_begin(int i) const {
    if (window_left < 0) return 0;
    const long long b = diagonal(i) - window_left;
    return b < 0 ? 0 : (b > seqlen_k ? seqlen_k : int(b));
  }
  FA_HOST_DEVICE int col_end(int i) const {
    if (window_right < 0) return seqlen_k;
    const long long e = diagonal(i) + window_right + 1;
    return e < 0 ? 0 : (e > seqlen_k ? seqlen_k : int(e));
  }
  // Keys visible to at least one row of [row_begin, row_end): the union of the row ranges, which
  // is [col_begin(row_begin), col_end(row_end − 1)) because both bounds grow with i.
  FA_HOST_DEVICE int block_col_begin(int row_begin) const { return col_begin(row_begin); }
  FA_HOST_DEVICE int block_col_end(int row_end) const { return col_end(row_end - 1); }
  // The transpose, for the backward's walk over query rows: the rows that see at least one key
  // of [col_b, col_e) (col_b < col_e ≤ seqlen_k) are [block_row_begin(col_b), block_row_end(col_e)):
  // row i qualifies iff col_end(i) > col_b and col_begin(i) < col_e, and both bounds grow with i.
  // Row block m and key block n meet in one direction exactly when they meet in the other.
  FA_HOST_DEVICE int block_row_begin(int col_b) const {
    if (window_right < 0) return 0;
    return clamp_row((long long)col_b - window_right - seqlen_k + seqlen_q);
  }
  FA_HOST_DEVICE int block_row_end(int col_e) const {
    if (window_left < 0) return seqlen_q;
    return clamp_row((long long)col_e + window_left - seqlen_k + seqlen_q);
  }
  FA_HOST_DEVICE int clamp_row(long long i) const { return i < 0 ? 0 : (i > seqlen_q ? seqlen_q : int(i)); }
  // The same rule in offsets from the diagonal: key j of row i is visible iff its offset
  // j − diagonal(i) = j − i + seqlen_q − seqlen_k lies in [offset_min(), offset_max()]. For rows and
  // keys below 2^31 − 256 (a tile's padding included) the offset fits an int, and so do both bounds:
  // a kernel's per-element test is one subtraction and two comparisons in 32 bits. (The sum is
  // taken as (j − i) + (seqlen_q − seqlen_k): left to right, j − i + seqlen_q overflows first.)
  FA_HOST_DEVICE int offset_min() const { return window_left < 0 ? -0x7fffffff - 1 : -window_left; }
  FA_HOST_DEVICE int offset_max() const { return window_right < 0 ? 0x7fffffff : window_right; }
  FA_HOST_DEVICE int offset(int i, int j) const { return (j - i) + (seqlen_q - seqlen_k); }
  // Whether every (i, j) of the block is visible, so per-element masking can be skipped.
  FA_HOST_DEVICE bool block_fully_visible(int row_begin, int row_end, int col_b, int col_e) const {
    return col_begin(row_end - 1) <= col_b && col_end(row_begin) >= col_e;
  }
};

// The reference API's normalisation: causal is window_right = 0, and a window at least as long as
// the keys is unbounded (−1).
FA_HOST_DEVICE Mask make_mask(bool causal, int window_left, int window_right, int max_seqlen_k,
                              int seqlen_q, int seqlen_k) {
  if (causal) window_right = 0;
  if (window_left >= max_seqlen_k) window_left = -1;
  if (window_right >= max_seqlen_k) window_right = -1;
  return Mask{window_left, window_right, seqlen_q, seqlen_k};
}

}  // namespace flashattn::common
