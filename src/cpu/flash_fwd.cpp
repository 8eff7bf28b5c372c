// src/cpu/flash_fwd.cpp — the CPU flash forward: online softmax over key tiles, one task per
// (batch, kv head, block of kBlockM packed query rows), memory O(tiles).
//
// The query rows of all heads that share a kv head are packed, row-major over (i, head in the
// group): packed row ρ = i · group + g. A block of kBlockM packed rows then reads each K/V tile
// once for the whole group, which makes decoding (a few queries, GQA) cheap, and is the plain
// (i, one head) tiling when group = 1.
//
// Per task the packed query tile is stored once, transposed, as the B operand of Sᵀ = K · Qᵀ, so
// the per-key-tile work is a dtype conversion of K and V (no transpose) and the softmax statistics
// of each query are vectors across the columns of Sᵀ. The probabilities then feed O += P · V with
// P read through Sᵀ's transposed layout.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "common/params.h"
#include "common/sink.h"
#include "cpu/cpu.h"
#include "cpu/flash_common.h"
#include "cpu/parallel.h"
#include "cpu/storage_dispatch.h"
#include "cpu/tile_gemm.h"

namespace flashattn::cpu {
namespace {

using common::AttentionParams;
using flash::FloatBuffer;

constexpr int kBlockM = 64;                       // packed query rows per task: the columns of Sᵀ
constexpr int kBlockN = 64;                       // keys per inner tile: the rows of Sᵀ
constexpr int kMaxColVecs = kBlockM / kVecWidth;  // VecF per row of Sᵀ
static_assert(kBlockM % kVecWidth == 0, "a row of Sᵀ is a whole number of vectors");
static_assert(kBlockN % 16 == 0, "key tiles start on 16×16 dropout blocks");

// Per-worker scratch, all fp32 except the per-column bookkeeping. Only V's tile is zeroed at
// allocation (its padding columns stay 0); every other buffer is written by forward_block before
// it is read.
struct ForwardScratch {
  int head_dim_v_padded;
  FloatBuffer q_t;      // (d, kBlockM): the packed query tile, transposed
  FloatBuffer k;        // (kBlockN, d)
  FloatBuffer v;        // (kBlockN, dv_padded); the padding columns stay 0
  FloatBuffer s_t;      // (kBlockN, kBlockM): scores, then probabilities, keys × packed queries
  FloatBuffer keep;     // (kBlockN, kBlockM): dropout keep bits as 0 / 1
  FloatBuffer o;        // (kBlockM, dv_padded): unnormalised output accumulator
  FloatBuffer row_max;  // (kBlockM): running max of the scores in log2 units
  FloatBuffer row_sum;  // (kBlockM): running Σ 2^(y − row_max)
  FloatBuffer alpha;    // (kBlockM): this tile's rescale factor of the accumulated rows
  FloatBuffer row_tmp;  // (d): one converted query row
  std::vector<int> col_row, col_head;         // (kBlockM): query row i and head of each column
  FloatBuffer col_slope, col_base;            // (kBlockM): ALiBi slope and i + sk − sq of each column
  std::vector<common::ScoreMod<float>> mods;  // (group): the ScoreMod of each head of the group

  ForwardScratch(int d, int dv, int group)
      : head_dim_v_padded(flash::round_up(dv, kVecWidth)),
        q_t(std::size_t(d) * kBlockM, kUninit),
        k(std::size_t(kBlockN) * d, kUninit),
        v(std::size_t(kBlockN) * head_dim_v_padded),
        s_t(std::size_t(kBlockN) * kBlockM, kUninit),
        keep(std::size_t(kBlockN) * kBlockM, kUninit),
        o(std::size_t(kBlockM) * head_dim_v_padded, kUninit),
        row_max(kBlockM, kUninit),
        row_sum(kBlockM, kUninit),
        alpha(kBlockM, kUninit),
        row_tmp(std::size_t(d), kUninit),
        col_row(kBlockM),
        col_head(kBlockM),
        col_slope(kBlockM, kUninit),
        col_base(kBlockM, kUninit),
        mods(std::size_t(group)),
        d_(d),
        dv_(dv),
        group_(group) {}
  bool fits(int d, int dv, int group) const { return d_ == d && dv_ == dv && group_ == group; }

 private:
  static constexpr FloatBuffer::Uninitialized kUninit{};
  int d_, dv_, group_;
};

// The scratch of a one-worker call (decoding steps, small problems) on the calling thread: kept
// from the previous such call with the same head dims and group, so that a small call allocates
// nothing (allocation was a fifth of a 16-key decoding call's time).
ForwardScratch& single_worker_scratch(int d, int dv, int group) {
  thread_local std::unique_ptr<ForwardScratch> kept;
  if (!kept || !kept->fits(d, dv, group)) kept = std::make_unique<ForwardScratch>(d, dv, group);
  return *kept;
}

struct ForwardTask {
  int batch, kv_head, block;  // packed query rows [block · kBlockM, …)
  int key_tiles;              // work estimate, for scheduling the longest tasks first
};

// One (batch, kv head, packed query block): writes the out rows and lse entries of its columns.
template <class T>
void forward_block(const AttentionParams& p, const ForwardTask& task, ForwardScratch& w) {
  const int b = task.batch, hk = task.kv_head, group = p.group_size();
  const int d = p.head_dim, dv = p.head_dim_v, ldv = w.head_dim_v_padded;
  const int packed0 = task.block * kBlockM;
  const int cols = std::min(kBlockM, group * p.seqlen_q(b) - packed0);  // valid columns
  const int col_vecs = flash::ceil_div(cols, kVecWidth);
  const int i_first = packed0 / group, i_end = (packed0 + cols - 1) / group + 1;  // query rows
  const common::Mask mask = p.mask(b);
  bool plain = true, any_alibi = false;
  for (int g = 0; g < group; ++g) {
    w.mods[std::size_t(g)] = p.score_mod<float>(b, hk * group + g);
    plain = plain && flash::is_plain_scale(w.mods[std::size_t(g)]);
    any_alibi = any_alibi || w.mods[std::size_t(g)].alibi_slope != 0;
  }
  const flash::VecScoreMod vmod(w.mods[0], any_alibi);  // scale and softcap are the same for every head
  // Tile values x are dots (plain) or scores, y = x · value_log2 the score in log2 units, and
  // the softmax weight exp(s − max s) = 2^(y − max y).
  const float value_log2 = plain ? w.mods[0].scale * flash::kLog2e : flash::kLog2e;
  const bool dropout = p.dropout_p > 0.0f;
  const auto* q = static_cast<const T*>(p.q.data);
  const auto* k = static_cast<const T*>(p.k.data);
  const auto* v = static_cast<const T*>(p.v.data);

  float* q_t = w.q_t.get();  // (d, kBlockM)
  for (int c = 0; c < col_vecs * kVecWidth; ++c) {
    if (c < cols) {
      const int packed = packed0 + c;
      w.col_row[std::size_t(c)] = packed / group;
      w.col_head[std::size_t(c)] = hk * group + packed % group;
      const common::ScoreMod<float>& mod = w.mods[std::size_t(packed % group)];
      w.col_slope.get()[c] = mod.alibi_slope;
      w.col_base.get()[c] = float(packed / group + mod.diag_offset);
      float* row = w.row_tmp.get();
      flash::load_row(q + p.q_offset(p.q, b, packed / group, hk * group + packed % group), d, row);
      for (int e = 0; e < d; ++e) q_t[e * kBlockM + c] = row[e];
    } else {
      for (int e = 0; e < d; ++e) q_t[e * kBlockM + c] = 0.0f;  // padding: finite, never stored
      w.col_slope.get()[c] = 0.0f;
      w.col_base.get()[c] = 0.0f;
    }
  }
  // The block's columns only: O's rows, the statistics' vectors and the keep tile beyond them
  // are never read.
  std::fill(w.o.get(), w.o.get() + std::size_t(cols) * ldv, 0.0f);
  std::fill(w.row_max.get(), w.row_max.get() + col_vecs * kVecWidth, -flash::kInfinity);
  std::fill(w.row_sum.get(), w.row_sum.get() + col_vecs * kVecWidth, 0.0f);
  if (dropout) std::fill(w.keep.get(), w.keep.get() + std::size_t(kBlockN) * kBlockM, 0.0f);

  const int key_begin = mask.block_col_begin(i_first);
  const int key_end = mask.block_col_end(i_end);
  for (int j0 = key_begin / kBlockN * kBlockN; j0 < key_end; j0 += kBlockN) {
    const int keys = std::min(kBlockN, key_end - j0);
    float* kt = w.k.get();     // (keys, d)
    float* vt = w.v.get();     // (keys, ldv)
    float* s_t = w.s_t.get();  // (keys, kBlockM)
    for (int r = 0; r < keys; ++r) {
      flash::load_row(k + p.k_offset(p.k, b, j0 + r, hk), d, kt + r * d);
      flash::load_row(v + p.k_offset(p.v, b, j0 + r, hk), dv, vt + r * ldv);
    }
    tile_gemm<ALayout::row_major, false>(keys, col_vecs * kVecWidth, d, kt, d, q_t, kBlockM, s_t,
                                         kBlockM);

    if (!plain) {
      for (int r = 0; r < keys; ++r) {
        const VecF j = splat(float(j0 + r));
        for (int cv = 0; cv < col_vecs; ++cv) {
          float* x = s_t + r * kBlockM + cv * kVecWidth;
          store_vec(x, vmod.apply(load_vec(x), load_vec(w.col_slope.get() + cv * kVecWidth),
                                  load_vec(w.col_base.get() + cv * kVecWidth), j));
        }
      }
    }
    if (!mask.block_fully_visible(i_first, i_end, j0, j0 + keys)) {
      for (int r = 0; r < keys; ++r) {
        for (int c = 0; c < cols; ++c) {
          if (!mask.visible(w.col_row[c], j0 + r)) s_t[r * kBlockM + c] = -flash::kInfinity;
        }
      }
    }

    // Online softmax, one VecF of queries at a time. y is rounded to fp32 before the max is
    // subtracted (no fused multiply-add), so a row's max element weighs exactly 2^0 = 1: a query
    // that sees one key gets exactly that key's value row, as the exact softmax does.
    VecF tile_max[kMaxColVecs];
    for (int cv = 0; cv < col_vecs; ++cv) tile_max[cv] = splat(-flash::kInfinity);
    for (int r = 0; r < keys; ++r) {
      for (int cv = 0; cv < col_vecs; ++cv) {
        float* x = s_t + r * kBlockM + cv * kVecWidth;
        const VecF y = load_vec(x) * value_log2;
        store_vec(x, y);
        tile_max[cv] = flash::max_vec(tile_max[cv], y);
      }
    }
    VecF alpha[kMaxColVecs], safe_max[kMaxColVecs], tile_sum[kMaxColVecs];
    for (int cv = 0; cv < col_vecs; ++cv) {
      const VecF old_max = load_vec(w.row_max.get() + cv * kVecWidth);
      const VecF new_max = flash::max_vec(old_max, tile_max[cv]);
      // A query that has seen only masked keys has max −∞: measure against 0 instead, so that
      // (−∞) − (−∞) never makes a NaN; its probabilities are then exactly 2^−∞ = 0.
      safe_max[cv] = new_max == -flash::kInfinity ? VecF{} : new_max;
      // A previous max of −∞ means nothing was accumulated: the factor is 0.
      alpha[cv] = old_max == -flash::kInfinity ? VecF{} : flash::exp2_vec(old_max - new_max);
      tile_sum[cv] = VecF{};
      store_vec(w.row_max.get() + cv * kVecWidth, new_max);
    }
    for (int r = 0; r < keys; ++r) {
      for (int cv = 0; cv < col_vecs; ++cv) {
        float* x = s_t + r * kBlockM + cv * kVecWidth;
        const VecF prob = flash::exp2_vec(load_vec(x) - safe_max[cv]);
        tile_sum[cv] += prob;
        store_vec(x, prob);
      }
    }
    for (int cv = 0; cv < col_vecs; ++cv) {
      float* sum = w.row_sum.get() + cv * kVecWidth;
      store_vec(sum, load_vec(sum) * alpha[cv] + tile_sum[cv]);
      store_vec(w.alpha.get() + cv * kVecWidth, alpha[cv]);
    }
    // P enters P · V in the storage precision, as on the GPU; the row sums keep fp32 P.
    for (int r = 0; r < keys; ++r) flash::round_row<T>(s_t + r * kBlockM, col_vecs * kVecWidth);
    if (dropout) {
      // The columns of head g are those of rows i with i · group + g in the block, every
      // group-th column; the padding columns keep 0.
      float* keep = w.keep.get();
      for (int g = 0; g < group; ++g) {
        const int i_lo = std::max(i_first, flash::ceil_div(packed0 - g, group));
        const int i_hi = (packed0 + cols - 1 - g) / group + 1;
        if (packed0 + cols - 1 - g < 0 || i_lo >= i_hi) continue;
        flash::dropout_keep_tile(p.dropout, p.dropout_stream(b, hk * group + g), i_lo, i_hi - i_lo,
                                 j0, keys, keep + (i_lo * group + g - packed0), group, kBlockM);
      }
      for (int r = 0; r < keys; ++r) {
        for (int cv = 0; cv < col_vecs; ++cv) {
          const int e = r * kBlockM + cv * kVecWidth;
          store_vec(s_t + e, load_vec(s_t + e) * load_vec(keep + e));
        }
      }
    }

    float* o = w.o.get();  // (kBlockM, ldv)
    for (int c = 0; c < cols; ++c) {
      const float a = w.alpha.get()[c];
      if (a == 1.0f) continue;  // the max did not move: nothing to rescale
      for (int e = 0; e < ldv; e += kVecWidth) {
        store_vec(o + c * ldv + e, load_vec(o + c * ldv + e) * a);
      }
    }
    tile_gemm<ALayout::transposed, true>(cols, ldv, keys, s_t, kBlockM, vt, ldv, o, ldv);
  }

  auto* out = static_cast<T*>(p.out.data);
  for (int c = 0; c < cols; ++c) {
    const int i = w.col_row[std::size_t(c)], hh = w.col_head[std::size_t(c)];
    float sum = w.row_sum.get()[c];
    float max_log2 = w.row_max.get()[c];
    T* out_row = out + p.q_offset(p.out, b, i, hh);
    // No visible key: out = 0, lse = the sink, +∞ without one (SPEC §2.5, common/sink.h). A NaN
    // sum (a visible score was NaN, or +∞) is not "no key": it goes through, making out and lse
    // NaN as in the reference.
    const bool no_key = sum == 0.0f;
    float rescale = 1.0f;
    if (p.sinks && !no_key) {
      const common::SinkFold<float> f =
          common::fold_sink(max_log2, sum, p.sinks[hh] * flash::kLog2e, [](float x) { return std::exp2(x); });
      max_log2 = f.max_log2;
      sum = f.sum;
      rescale = f.rescale;
    }
    if (!no_key) {
      flash::store_row(w.o.get() + c * ldv, p.dropout.keep_scale * rescale / sum, dv, out_row);
    } else {
      std::fill(out_row, out_row + dv, common::from_float<T>(0.0f));
    }
    if (p.lse) {
      p.lse[p.lse_index(b, hh, i)] =
          no_key ? common::empty_row_lse(p.sink(hh)) : (max_log2 + std::log2(sum)) * flash::kLn2;
    }
  }
}

}  // namespace

void flash_forward(const AttentionParams& p, int num_threads) {
  num_threads = threads_for_work(flash::attention_flops(p), num_threads);
  const int group = p.group_size();
  std::vector<ForwardTask> tasks;
  for (int b = 0; b < p.batch; ++b) {
    const int packed_rows = group * p.seqlen_q(b);
    const common::Mask mask = p.mask(b);
    for (int block = 0; block * kBlockM < packed_rows; ++block) {
      const int packed0 = block * kBlockM;
      const int packed1 = std::min(packed_rows, packed0 + kBlockM);
      const int key_begin = mask.block_col_begin(packed0 / group);
      const int key_end = mask.block_col_end((packed1 - 1) / group + 1);
      const int key_tiles =
          key_end > key_begin ? flash::ceil_div(key_end, kBlockN) - key_begin / kBlockN : 0;
      for (int hk = 0; hk < p.heads_k; ++hk) tasks.push_back({b, hk, block, key_tiles});
    }
  }
  // Longest first, so that the causal mask's short tail tasks fill in at the end. Each task owns
  // its output rows, so the order changes no result.
  std::stable_sort(tasks.begin(), tasks.end(), [](const ForwardTask& x, const ForwardTask& y) {
    return x.key_tiles > y.key_tiles;
  });
  const int workers = parallel_workers(std::int64_t(tasks.size()), num_threads);
  with_storage(p.storage, [&](auto type_tag) {
    using T = decltype(type_tag);
    if (workers == 1) {
      ForwardScratch& w = single_worker_scratch(p.head_dim, p.head_dim_v, group);
      for (const ForwardTask& task : tasks) forward_block<T>(p, task, w);
      return;
    }
    std::vector<ForwardScratch> scratch;
    scratch.reserve(std::size_t(workers));
    for (int wk = 0; wk < workers; ++wk) scratch.emplace_back(p.head_dim, p.head_dim_v, group);
    parallel_for(std::int64_t(tasks.size()), num_threads, [&](std::int64_t t, int worker) {
      forward_block<T>(p, tasks[std::size_t(t)], scratch[std::size_t(worker)]);
    });
  });
}

}  // namespace flashattn::cpu
