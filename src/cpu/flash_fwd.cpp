// src/cpu/flash_fwd.cpp — the CPU flash forward: online softmax over key tiles, one task per
// (batch, query head, block of kBlockM query rows), memory O(tiles).
//
// Per task the query tile is packed once, transposed, as the B operand of Sᵀ = K · Qᵀ, so the
// per-key-tile work is a dtype conversion of K and V (no transpose) and the softmax statistics of
// each query are vectors across the columns of Sᵀ. The probabilities then feed O += P · V with P
// read through Sᵀ's transposed layout.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common/params.h"
#include "cpu/cpu.h"
#include "cpu/flash_common.h"
#include "cpu/parallel.h"
#include "cpu/storage_dispatch.h"
#include "cpu/tile_gemm.h"

namespace flashattn::cpu {
namespace {

using common::AttentionParams;
using flash::FloatBuffer;

constexpr int kBlockM = 64;                    // query rows per task: the columns of Sᵀ
constexpr int kBlockN = 64;                    // keys per inner tile: the rows of Sᵀ
constexpr int kColVecs = kBlockM / kVecWidth;  // VecF per row of Sᵀ
static_assert(kBlockM % kVecWidth == 0, "a row of Sᵀ is a whole number of vectors");
static_assert(kBlockN % 16 == 0 && kBlockM % 16 == 0,
              "tiles start on 16×16 dropout blocks, so a block never straddles two tiles");

// Per-worker scratch, all fp32.
struct ForwardScratch {
  int head_dim, head_dim_v_padded;
  FloatBuffer q_t;      // (d, kBlockM): the query tile, transposed
  FloatBuffer k;        // (kBlockN, d)
  FloatBuffer v;        // (kBlockN, dv_padded); the padding columns stay 0
  FloatBuffer s_t;      // (kBlockN, kBlockM): scores, then probabilities, keys × queries
  FloatBuffer keep;     // (kBlockN, kBlockM): dropout keep bits as 0 / 1
  FloatBuffer o;        // (kBlockM, dv_padded): unnormalised output accumulator
  FloatBuffer row_max;  // (kBlockM): running max of the scores in log2 units
  FloatBuffer row_sum;  // (kBlockM): running Σ 2^(y − row_max)
  FloatBuffer alpha;    // (kBlockM): this tile's rescale factor of the accumulated rows
  FloatBuffer row_tmp;  // (max(d, dv)): one converted row

  ForwardScratch(int d, int dv)
      : head_dim(d),
        head_dim_v_padded(flash::round_up(dv, kVecWidth)),
        q_t(std::size_t(d) * kBlockM),
        k(std::size_t(kBlockN) * d),
        v(std::size_t(kBlockN) * head_dim_v_padded),
        s_t(std::size_t(kBlockN) * kBlockM),
        keep(std::size_t(kBlockN) * kBlockM),
        o(std::size_t(kBlockM) * head_dim_v_padded),
        row_max(kBlockM),
        row_sum(kBlockM),
        alpha(kBlockM),
        row_tmp(std::size_t(std::max(d, dv))) {}
};

struct ForwardTask {
  int batch, head, block;  // query rows [block · kBlockM, …)
  int key_tiles;           // work estimate, for scheduling the longest tasks first
};

// One (batch, head, query block): writes out rows and lse entries [i0, i0 + rows).
template <class T>
void forward_block(const AttentionParams& p, const ForwardTask& task, ForwardScratch& w) {
  const int b = task.batch, hh = task.head, hk = hh / p.group_size();
  const int d = p.head_dim, dv = p.head_dim_v, ldv = w.head_dim_v_padded;
  const int i0 = task.block * kBlockM;
  const int rows = std::min(kBlockM, p.seqlen_q(b) - i0);
  const common::Mask mask = p.mask(b);
  const common::ScoreMod<float> mod = p.score_mod<float>(b, hh);
  const bool plain = flash::is_plain_scale(mod);
  // Tile values x are dots (plain) or scores, y = x · value_log2 the score in log2 units, and
  // the softmax weight exp(s − max s) = 2^(y − max y).
  const float value_log2 = plain ? mod.scale * flash::kLog2e : flash::kLog2e;
  const bool dropout = p.dropout_p > 0.0f;
  const auto* q = static_cast<const T*>(p.q.data);
  const auto* k = static_cast<const T*>(p.k.data);
  const auto* v = static_cast<const T*>(p.v.data);

  float* q_t = w.q_t.get();  // (d, kBlockM)
  for (int c = 0; c < kBlockM; ++c) {
    float* row = w.row_tmp.get();
    if (c < rows) {
      flash::load_row(q + p.q_offset(p.q, b, i0 + c, hh), d, row);
    } else {
      std::fill(row, row + d, 0.0f);  // padding queries: finite dots, never stored
    }
    for (int e = 0; e < d; ++e) q_t[e * kBlockM + c] = row[e];
  }
  std::fill(w.o.get(), w.o.get() + std::size_t(kBlockM) * ldv, 0.0f);
  std::fill(w.row_max.get(), w.row_max.get() + kBlockM, -flash::kInfinity);
  std::fill(w.row_sum.get(), w.row_sum.get() + kBlockM, 0.0f);

  const int key_begin = mask.block_col_begin(i0);
  const int key_end = mask.block_col_end(i0 + rows);
  for (int j0 = key_begin / kBlockN * kBlockN; j0 < key_end; j0 += kBlockN) {
    const int keys = std::min(kBlockN, key_end - j0);
    float* kt = w.k.get();     // (keys, d)
    float* vt = w.v.get();     // (keys, ldv)
    float* s_t = w.s_t.get();  // (keys, kBlockM)
    for (int r = 0; r < keys; ++r) {
      flash::load_row(k + p.k_offset(p.k, b, j0 + r, hk), d, kt + r * d);
      flash::load_row(v + p.k_offset(p.v, b, j0 + r, hk), dv, vt + r * ldv);
    }
    tile_gemm<ALayout::row_major, false>(keys, kBlockM, d, kt, d, q_t, kBlockM, s_t, kBlockM);

    if (!plain) {
      for (int r = 0; r < keys; ++r) {
        for (int c = 0; c < rows; ++c)
          s_t[r * kBlockM + c] = mod(s_t[r * kBlockM + c], i0 + c, j0 + r);
      }
    }
    if (!mask.block_fully_visible(i0, i0 + rows, j0, j0 + keys)) {
      for (int r = 0; r < keys; ++r) {
        for (int c = 0; c < rows; ++c) {
          if (!mask.visible(i0 + c, j0 + r)) s_t[r * kBlockM + c] = -flash::kInfinity;
        }
      }
    }

    // Online softmax, one VecF of queries at a time. y is rounded to fp32 before the max is
    // subtracted (no fused multiply-add), so a row's max element weighs exactly 2^0 = 1: a query
    // that sees one key gets exactly that key's value row, as the exact softmax does.
    VecF tile_max[kColVecs];
    for (int cv = 0; cv < kColVecs; ++cv) tile_max[cv] = splat(-flash::kInfinity);
    for (int r = 0; r < keys; ++r) {
      for (int cv = 0; cv < kColVecs; ++cv) {
        float* x = s_t + r * kBlockM + cv * kVecWidth;
        const VecF y = load_vec(x) * value_log2;
        store_vec(x, y);
        tile_max[cv] = flash::max_vec(tile_max[cv], y);
      }
    }
    VecF alpha[kColVecs], safe_max[kColVecs], tile_sum[kColVecs];
    for (int cv = 0; cv < kColVecs; ++cv) {
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
      for (int cv = 0; cv < kColVecs; ++cv) {
        float* x = s_t + r * kBlockM + cv * kVecWidth;
        const VecF prob = flash::exp2_vec(load_vec(x) - safe_max[cv]);
        tile_sum[cv] += prob;
        store_vec(x, prob);
      }
    }
    for (int cv = 0; cv < kColVecs; ++cv) {
      float* sum = w.row_sum.get() + cv * kVecWidth;
      store_vec(sum, load_vec(sum) * alpha[cv] + tile_sum[cv]);
      store_vec(w.alpha.get() + cv * kVecWidth, alpha[cv]);
    }
    // P enters P · V in the storage precision, as on the GPU; the row sums keep fp32 P.
    flash::round_row<T>(s_t, keys * kBlockM);
    if (dropout) {
      float* keep = w.keep.get();
      flash::dropout_keep_tile(p.dropout, p.dropout_stream(b, hh), i0, kBlockM, j0, keys, keep, 1,
                               kBlockM);
      for (int e = 0; e < keys * kBlockM; e += kVecWidth) {
        store_vec(s_t + e, load_vec(s_t + e) * load_vec(keep + e));
      }
    }

    float* o = w.o.get();  // (kBlockM, ldv)
    for (int c = 0; c < rows; ++c) {
      const float a = w.alpha.get()[c];
      if (a == 1.0f) continue;  // the max did not move: nothing to rescale
      for (int e = 0; e < ldv; e += kVecWidth) {
        store_vec(o + c * ldv + e, load_vec(o + c * ldv + e) * a);
      }
    }
    tile_gemm<ALayout::transposed, true>(rows, ldv, keys, s_t, kBlockM, vt, ldv, o, ldv);
  }

  auto* out = static_cast<T*>(p.out.data);
  for (int c = 0; c < rows; ++c) {
    const int i = i0 + c;
    const float sum = w.row_sum.get()[c];
    T* out_row = out + p.q_offset(p.out, b, i, hh);
    if (sum > 0.0f) {
      flash::store_row(w.o.get() + c * ldv, p.dropout.keep_scale / sum, dv, out_row);
    } else {
      // No visible key: out = 0, lse = +∞ (SPEC §2.5).
      std::fill(out_row, out_row + dv, common::from_float<T>(0.0f));
    }
    if (p.lse) {
      p.lse[p.lse_index(b, hh, i)] =
          sum > 0.0f ? (w.row_max.get()[c] + std::log2(sum)) * flash::kLn2 : flash::kInfinity;
    }
  }
}

}  // namespace

void flash_forward(const AttentionParams& p, int num_threads) {
  std::vector<ForwardTask> tasks;
  for (int b = 0; b < p.batch; ++b) {
    const int sq = p.seqlen_q(b);
    const common::Mask mask = p.mask(b);
    for (int block = 0; block * kBlockM < sq; ++block) {
      const int i0 = block * kBlockM, i1 = std::min(sq, i0 + kBlockM);
      const int key_begin = mask.block_col_begin(i0), key_end = mask.block_col_end(i1);
      const int key_tiles =
          key_end > key_begin ? flash::ceil_div(key_end, kBlockN) - key_begin / kBlockN : 0;
      for (int hh = 0; hh < p.heads; ++hh) tasks.push_back({b, hh, block, key_tiles});
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
    std::vector<ForwardScratch> scratch;
    scratch.reserve(std::size_t(workers));
    for (int wk = 0; wk < workers; ++wk) scratch.emplace_back(p.head_dim, p.head_dim_v);
    parallel_for(std::int64_t(tasks.size()), num_threads, [&](std::int64_t t, int worker) {
      forward_block<T>(p, tasks[std::size_t(t)], scratch[std::size_t(worker)]);
    });
  });
}

}  // namespace flashattn::cpu
