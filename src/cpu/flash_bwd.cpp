// src/cpu/flash_bwd.cpp — the CPU flash backward: recomputes P from the forward's lse, one task per
// (batch, kv head, block of kBlockN keys), memory O(tiles) plus one fp32 dQ accumulator.
//
// A task owns dK and dV of its keys: it walks every query head of the GQA group and every query
// block that sees its keys, in a fixed order, accumulating in registers-and-L2 fp32 tiles, so the
// group sum never needs an expanded buffer. dQ rows receive one contribution per key block; the
// contributions are added to the fp32 accumulator in increasing key-block order, enforced by a
// per-task progress counter (see KeyTask), so the result is bitwise the same for any number of
// threads while all key blocks of a head still run in parallel (MQA with batch 1 included).
//
// Tiles are (queries, keys), S = Q · Kᵀ with Kᵀ and Vᵀ packed once per task; the per-query
// statistics (lse, D) are then per-row scalars and the query tiles need only a dtype conversion.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <thread>
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

constexpr int kBlockM = 64;                    // query rows per step
constexpr int kBlockN = 64;                    // keys per task
constexpr int kKeyVecs = kBlockN / kVecWidth;  // VecF per row of a (queries, keys) tile
static_assert(kBlockN % kVecWidth == 0, "a tile row is a whole number of vectors");
static_assert(kBlockN % 16 == 0 && kBlockM % 16 == 0,
              "tiles start on 16×16 dropout blocks, so a block never straddles two tiles");
constexpr int kSpinsBeforeYield = 64;  // busy-wait this often before giving the core away
// dQ contributions a task may hold while the previous key block catches up, so that a chain of
// key blocks (one per kv head with MQA and batch 1) does not move in lockstep.
constexpr int kPendingSteps = 4;

// Per-worker scratch, all fp32.
struct BackwardScratch {
  int d_padded, dv_padded;
  FloatBuffer k;     // (kBlockN, d_padded): B of dQ = dS · K
  FloatBuffer k_t;   // (d, kBlockN): B of S = Q · Kᵀ
  FloatBuffer v_t;   // (dv, kBlockN): B of dP = dO · Vᵀ
  FloatBuffer q;     // (kBlockM, d_padded)
  FloatBuffer dout;  // (kBlockM, dv_padded)
  FloatBuffer s;     // (kBlockM, kBlockN): dots, or scores when the ScoreMod is not a plain scale
  FloatBuffer p;     // (kBlockM, kBlockN): probabilities
  FloatBuffer ds;    // (kBlockM, kBlockN): dP, then dS · ds/ddot
  FloatBuffer keep;  // (kBlockM, kBlockN): dropout keep bits as 0 / 1
  FloatBuffer dq;    // (kPendingSteps, kBlockM, d_padded): held dQ contributions, a ring
  FloatBuffer dk;    // (kBlockN, d_padded): fp32 dK of the task's keys, summed over the group
  FloatBuffer dv;    // (kBlockN, dv_padded)
  FloatBuffer lse_log2;  // (kBlockM): lse · log2(e) of the step's queries
  FloatBuffer delta;     // (kBlockM): D = rowsum(dO ∘ O) of the step's queries
  FloatBuffer row_tmp;   // (max(d, dv)): one converted row

  BackwardScratch(int d, int dv)
      : d_padded(flash::round_up(d, kVecWidth)),
        dv_padded(flash::round_up(dv, kVecWidth)),
        k(std::size_t(kBlockN) * d_padded),
        k_t(std::size_t(d) * kBlockN),
        v_t(std::size_t(dv) * kBlockN),
        q(std::size_t(kBlockM) * d_padded),
        dout(std::size_t(kBlockM) * dv_padded),
        s(std::size_t(kBlockM) * kBlockN),
        p(std::size_t(kBlockM) * kBlockN),
        ds(std::size_t(kBlockM) * kBlockN),
        keep(std::size_t(kBlockM) * kBlockN),
        dq(std::size_t(kPendingSteps) * kBlockM * d_padded),
        dk(std::size_t(kBlockN) * d_padded),
        dv(std::size_t(kBlockN) * dv_padded),
        lse_log2(kBlockM),
        delta(kBlockM),
        row_tmp(std::size_t(std::max(d, dv))) {}
};

// One (batch, kv head, key block). Its steps are (query head of the group, query block) pairs,
// numbered step = g · query_blocks + qb. progress = n publishes "this task and every earlier key
// block of the same (batch, kv head) have added all their dQ contributions of steps < n"; a task
// adds its contribution to step t only once its predecessor's progress exceeds t.
struct KeyTask {
  int batch, kv_head, block;
  std::int64_t predecessor;  // index of the task of key block − 1, or −1
};

struct BackwardPlan {
  std::vector<std::int64_t> row_begin;  // (batch + 1): first query row of each sequence
  std::vector<KeyTask> tasks;           // ordered by (block, batch, kv head)
  std::unique_ptr<std::atomic<std::int64_t>[]> progress;  // (tasks)
  std::vector<float> delta;                               // (total_q, h): D = rowsum(dO ∘ O)
  FloatBuffer dq_accum;                                   // (total_q, h, d) fp32

  std::int64_t row_index(const AttentionParams& p, int b, int i, int hh) const {
    return (row_begin[std::size_t(b)] + i) * p.heads + hh;
  }
};

constexpr std::int64_t kAllSteps = INT64_MAX;

void wait_for_progress(const std::atomic<std::int64_t>& progress, std::int64_t value) {
  int spins = 0;
  while (progress.load(std::memory_order_acquire) < value) {
    if (++spins < kSpinsBeforeYield) {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();  // tell the core this is a spin loop
#endif
    } else {
      std::this_thread::yield();  // the predecessor may share this core
    }
  }
}

// D = rowsum(dO ∘ O) of one (batch, head, query block) into plan.delta and p.softmax_d, and the
// block's dQ accumulator rows zeroed.
template <class T>
void delta_block(const AttentionParams& p, BackwardPlan& plan, int b, int hh, int block,
                 float* row_tmp) {
  const int dv = p.head_dim_v, d = p.head_dim;
  const int i0 = block * kBlockM, i1 = std::min(p.seqlen_q(b), i0 + kBlockM);
  const auto* out = static_cast<const T*>(p.out.data);
  const auto* dout = static_cast<const T*>(p.dout.data);
  float* dout_row = row_tmp;
  float* out_row = row_tmp + dv;
  for (int i = i0; i < i1; ++i) {
    flash::load_row(dout + p.q_offset(p.dout, b, i, hh), dv, dout_row);
    flash::load_row(out + p.q_offset(p.out, b, i, hh), dv, out_row);
    // Accumulated in the order and with the fused multiply-adds of the dP = dO · Vᵀ GEMM, so
    // that dP − D is exactly 0 where out is exactly one value row (a query seeing one key).
    float sum = 0.0f;
    for (int e = 0; e < dv; ++e) sum = std::fma(dout_row[e], out_row[e], sum);
    const std::int64_t row = plan.row_index(p, b, i, hh);
    plan.delta[std::size_t(row)] = sum;
    if (p.softmax_d) p.softmax_d[p.lse_index(b, hh, i)] = sum;
    float* acc = plan.dq_accum.get() + row * d;
    std::fill(acc, acc + d, 0.0f);
  }
}

// dq = the accumulated fp32 rows of one (batch, head, query block), in the storage dtype.
template <class T>
void store_dq_block(const AttentionParams& p, const BackwardPlan& plan, int b, int hh, int block) {
  const int d = p.head_dim;
  const int i0 = block * kBlockM, i1 = std::min(p.seqlen_q(b), i0 + kBlockM);
  auto* dq = static_cast<T*>(p.dq.data);
  for (int i = i0; i < i1; ++i) {
    const float* acc = plan.dq_accum.get() + plan.row_index(p, b, i, hh) * d;
    flash::store_row(acc, 1.0f, d, dq + p.q_offset(p.dq, b, i, hh));
  }
}

// One query block against the task's key tile: P, dP, dS, then dV += Pᵀ·dO, dK += dSᵀ·Q and this
// step's dQ contribution dS·K into dq (rows, d_padded). Returns the number of valid query rows.
template <class T>
int backward_step(const AttentionParams& p, const BackwardPlan& plan, int b, int hh, int block,
                  int j0, int keys, BackwardScratch& w, float* dq) {
  const int d = p.head_dim, dv = p.head_dim_v, ldq = w.d_padded, ldo = w.dv_padded;
  const int i0 = block * kBlockM;
  const int rows = std::min(kBlockM, p.seqlen_q(b) - i0);
  const common::Mask mask = p.mask(b);
  const common::ScoreMod<float> mod = p.score_mod<float>(b, hh);
  const bool plain = flash::is_plain_scale(mod);
  const flash::VecScoreMod vmod(mod, mod.alibi_slope != 0);
  const VecF slope = splat(mod.alibi_slope);
  VecF lane{};  // 0, 1, …, kVecWidth − 1: key offsets within a vector
  for (int l = 0; l < kVecWidth; ++l) lane[l] = float(l);
  const float value_log2 = plain ? mod.scale * flash::kLog2e : flash::kLog2e;
  const bool dropout = p.dropout_p > 0.0f;
  const auto* q = static_cast<const T*>(p.q.data);
  const auto* dout = static_cast<const T*>(p.dout.data);

  float* qt = w.q.get();      // (rows, ldq)
  float* dot = w.dout.get();  // (rows, ldo)
  for (int r = 0; r < rows; ++r) {
    const int i = i0 + r;
    flash::load_row(q + p.q_offset(p.q, b, i, hh), d, qt + r * ldq);
    flash::load_row(dout + p.q_offset(p.dout, b, i, hh), dv, dot + r * ldo);
    // A row without visible keys has lse = +∞ (2^(s − ∞) = 0), or the sink, and then the mask
    // below zeroes its P and dS.
    w.lse_log2.get()[r] = p.lse[p.lse_index(b, hh, i)] * flash::kLog2e;
    w.delta.get()[r] = plan.delta[std::size_t(plan.row_index(p, b, i, hh))];
  }

  float* s = w.s.get();    // (rows, kBlockN)
  float* pr = w.p.get();   // (rows, kBlockN)
  float* ds = w.ds.get();  // (rows, kBlockN)
  tile_gemm<ALayout::row_major, false>(rows, kBlockN, d, qt, ldq, w.k_t.get(), kBlockN, s, kBlockN);
  tile_gemm<ALayout::row_major, false>(rows, kBlockN, dv, dot, ldo, w.v_t.get(), kBlockN, ds,
                                       kBlockN);
  // Softcap and ALiBi in vector form (VecScoreMod), along the keys of each row.
  auto key_index = [&](int cv) { return lane + float(j0 + cv * kVecWidth); };
  if (!plain) {
    for (int r = 0; r < rows; ++r) {
      const VecF base = splat(float(i0 + r + mod.diag_offset));
      for (int cv = 0; cv < kKeyVecs; ++cv) {
        float* x = s + r * kBlockN + cv * kVecWidth;
        store_vec(x, vmod.apply(load_vec(x), slope, base, key_index(cv)));
      }
    }
  }
  float* keep = w.keep.get();
  if (dropout) {
    flash::dropout_keep_tile(p.dropout, p.dropout_stream(b, hh), i0, rows, j0, kBlockN, keep,
                             kBlockN, 1);
  }
  const float keep_scale = p.dropout.keep_scale;
  // dS = P ∘ (dP − D) with dP = keep · keep_scale · (dO · v), then times ds/ddot: the scale
  // (plain) or the ScoreMod's derivative per element.
  for (int r = 0; r < rows; ++r) {
    const float neg_lse_log2 = -w.lse_log2.get()[r];
    const float delta = w.delta.get()[r];
    for (int cv = 0; cv < kKeyVecs; ++cv) {
      const int e = r * kBlockN + cv * kVecWidth;
      // The score in log2 units rounded as in the forward pass, so P is the forward's P.
      const VecF y = flash::rounded(load_vec(s + e) * value_log2);
      const VecF prob = flash::exp2_vec(y + neg_lse_log2);
      VecF dp = load_vec(ds + e);
      if (dropout) dp *= load_vec(keep + e) * keep_scale;
      VecF grad = prob * (dp - delta);
      if (plain) grad *= mod.scale;
      store_vec(pr + e, prob);
      store_vec(ds + e, grad);
    }
  }
  // d s / d dot: the scale, times 1 − t² under a softcap (t = (s + ALiBi term) / c, as in
  // ScoreMod::dscore_ddot).
  if (!plain) {
    for (int r = 0; r < rows; ++r) {
      const VecF base = splat(float(i0 + r + mod.diag_offset));
      for (int cv = 0; cv < kKeyVecs; ++cv) {
        float* g = ds + r * kBlockN + cv * kVecWidth;
        VecF dscore = splat(mod.scale);
        if (vmod.softcap > 0) {
          VecF capped = load_vec(s + r * kBlockN + cv * kVecWidth);
          if (vmod.alibi) capped += flash::VecScoreMod::alibi_term(slope, base, key_index(cv));
          const VecF t = capped * vmod.inv_softcap;
          dscore = mod.scale * (1.0f - t * t);
        }
        store_vec(g, load_vec(g) * dscore);
      }
    }
  }
  if (!mask.block_fully_visible(i0, i0 + rows, j0, j0 + keys)) {
    for (int r = 0; r < rows; ++r) {
      for (int c = 0; c < keys; ++c) {
        if (!mask.visible(i0 + r, j0 + c)) {
          pr[r * kBlockN + c] = 0.0f;
          ds[r * kBlockN + c] = 0.0f;
        }
      }
    }
  }
  // Both GEMM operands in the storage precision, as the GPU kernels feed their tensor cores; dS
  // from fp32 P, P for dV rounded before the dropout mask (rounding commutes with × 0 / 1).
  flash::round_row<T>(ds, rows * kBlockN);
  flash::round_row<T>(pr, rows * kBlockN);
  if (dropout) {
    for (int e = 0; e < rows * kBlockN; e += kVecWidth) {
      store_vec(pr + e, load_vec(pr + e) * load_vec(keep + e));
    }
  }

  tile_gemm<ALayout::transposed, true>(keys, ldo, rows, pr, kBlockN, dot, ldo, w.dv.get(), ldo);
  tile_gemm<ALayout::transposed, true>(keys, ldq, rows, ds, kBlockN, qt, ldq, w.dk.get(), ldq);
  tile_gemm<ALayout::row_major, false>(rows, ldq, keys, ds, kBlockN, w.k.get(), ldq, dq, ldq);
  return rows;
}

template <class T>
void backward_key_block(const AttentionParams& p, BackwardPlan& plan, std::int64_t task_index,
                        BackwardScratch& w) {
  const KeyTask& task = plan.tasks[std::size_t(task_index)];
  const int b = task.batch, hk = task.kv_head;
  const int d = p.head_dim, dv = p.head_dim_v, ldq = w.d_padded, ldo = w.dv_padded;
  const int j0 = task.block * kBlockN;
  const int keys = std::min(kBlockN, p.seqlen_k(b) - j0);
  const auto* k = static_cast<const T*>(p.k.data);
  const auto* v = static_cast<const T*>(p.v.data);

  float* k_t = w.k_t.get();  // (d, kBlockN)
  float* v_t = w.v_t.get();  // (dv, kBlockN)
  float* row = w.row_tmp.get();
  for (int c = 0; c < kBlockN; ++c) {
    if (c < keys) {
      flash::load_row(k + p.k_offset(p.k, b, j0 + c, hk), d, w.k.get() + c * ldq);
      for (int e = 0; e < d; ++e) k_t[e * kBlockN + c] = w.k.get()[c * ldq + e];
      flash::load_row(v + p.k_offset(p.v, b, j0 + c, hk), dv, row);
      for (int e = 0; e < dv; ++e) v_t[e * kBlockN + c] = row[e];
    } else {
      // Keys past the sequence: zero columns keep S and dP finite; the GEMMs that produce
      // gradients never read them.
      for (int e = 0; e < d; ++e) k_t[e * kBlockN + c] = 0.0f;
      for (int e = 0; e < dv; ++e) v_t[e * kBlockN + c] = 0.0f;
    }
  }
  std::fill(w.dk.get(), w.dk.get() + std::size_t(kBlockN) * ldq, 0.0f);
  std::fill(w.dv.get(), w.dv.get() + std::size_t(kBlockN) * ldo, 0.0f);

  const std::atomic<std::int64_t>* before =
      task.predecessor >= 0 ? &plan.progress[std::size_t(task.predecessor)] : nullptr;
  std::atomic<std::int64_t>& mine = plan.progress[std::size_t(task_index)];
  const common::Mask mask = p.mask(b);
  const auto [row_lo, row_hi] = flash::rows_seeing_keys(mask, j0, j0 + keys);
  // Held dQ contributions, oldest first: ring slots [first, first + held) of w.dq.
  struct Contribution {
    std::int64_t step;
    int head, block, rows;
  };
  Contribution held_steps[kPendingSteps];
  int first = 0, held = 0;
  const auto slot = [&](int index) {
    return w.dq.get() + std::size_t(index % kPendingSteps) * kBlockM * ldq;
  };
  // Adds the oldest held contribution to the accumulator once the previous key block (and so
  // every earlier one) is past its step; returns false instead of waiting unless may_wait.
  const auto add_oldest = [&](bool may_wait) {
    const Contribution& c = held_steps[first % kPendingSteps];
    if (before) {
      if (may_wait) {
        wait_for_progress(*before, c.step + 1);
      } else if (before->load(std::memory_order_acquire) < c.step + 1) {
        return false;
      }
    }
    const float* part = slot(first);
    float* acc = plan.dq_accum.get() + plan.row_index(p, b, c.block * kBlockM, c.head) * d;
    const std::int64_t acc_row_stride = std::int64_t(p.heads) * d;
    for (int r = 0; r < c.rows; ++r) {
      for (int e = 0; e < d; ++e) acc[r * acc_row_stride + e] += part[r * ldq + e];
    }
    mine.store(c.step + 1, std::memory_order_release);
    ++first;
    --held;
    return true;
  };

  const int group = p.group_size();
  const int query_blocks = flash::ceil_div(p.seqlen_q(b), kBlockM);
  for (int g = 0; g < group; ++g) {
    const int hh = hk * group + g;
    for (int qb = row_lo / kBlockM; qb * kBlockM < row_hi; ++qb) {
      if (held == kPendingSteps) add_oldest(true);
      const int rows = backward_step<T>(p, plan, b, hh, qb, j0, keys, w, slot(first + held));
      held_steps[(first + held) % kPendingSteps] = {std::int64_t(g) * query_blocks + qb, hh, qb,
                                                    rows};
      ++held;
      while (held > 0 && add_oldest(false)) {
      }
    }
  }
  while (held > 0) add_oldest(true);
  if (before) wait_for_progress(*before, kAllSteps);
  mine.store(kAllSteps, std::memory_order_release);

  auto* dk = static_cast<T*>(p.dk.data);
  auto* dvp = static_cast<T*>(p.dv.data);
  for (int c = 0; c < keys; ++c) {
    flash::store_row(w.dk.get() + c * ldq, 1.0f, d, dk + p.k_offset(p.dk, b, j0 + c, hk));
    // Dropout's 1 / (1 − p) of dV = Σ keep · P · dO / (1 − p), applied once here.
    flash::store_row(w.dv.get() + c * ldo, p.dropout.keep_scale, dv,
                     dvp + p.k_offset(p.dv, b, j0 + c, hk));
  }
}

// Keys that belong to a varlen sequence but lie past seqused_k get zero gradients.
template <class T>
void zero_unused_keys(const AttentionParams& p) {
  if (!p.seqused_k) return;
  auto* dk = static_cast<T*>(p.dk.data);
  auto* dv = static_cast<T*>(p.dv.data);
  const T zero = common::from_float<T>(0.0f);
  for (int b = 0; b < p.batch; ++b) {
    const int rows = p.is_varlen() ? p.cu_seqlens_k[b + 1] - p.cu_seqlens_k[b] : p.max_seqlen_k;
    for (int j = std::max(0, p.seqlen_k(b)); j < rows; ++j) {
      for (int hk = 0; hk < p.heads_k; ++hk) {
        T* dk_row = dk + p.k_offset(p.dk, b, j, hk);
        T* dv_row = dv + p.k_offset(p.dv, b, j, hk);
        std::fill(dk_row, dk_row + p.head_dim, zero);
        std::fill(dv_row, dv_row + p.head_dim_v, zero);
      }
    }
  }
}

struct QueryBlock {
  int batch, head, block;
};

// The sinks' gradient (common/sink.h): dsinks_h = −Σ_{b,i} exp(s_h − lse_i) · D_i over the rows
// of head h, in fp64 and a fixed order (deterministic for any thread count), from the forward's
// lse (which includes the sink) and plan.delta.
void sink_gradient(const AttentionParams& p, const BackwardPlan& plan) {
  for (int hh = 0; hh < p.heads; ++hh) {
    const double sink = p.sinks[hh];
    double sum = 0.0;
    for (int b = 0; b < p.batch; ++b) {
      for (int i = 0; i < p.seqlen_q(b); ++i) {
        const double lse = p.lse[p.lse_index(b, hh, i)];
        sum += std::exp(sink - lse) * double(plan.delta[std::size_t(plan.row_index(p, b, i, hh))]);
      }
    }
    p.dsinks[hh] = float(-sum);
  }
}

}  // namespace

void flash_backward(const AttentionParams& p, int num_threads) {
  // The backward does 2.5 × the forward's products.
  num_threads = threads_for_work(2.5 * flash::attention_flops(p), num_threads);
  BackwardPlan plan;
  plan.row_begin.assign(std::size_t(p.batch) + 1, 0);
  std::vector<QueryBlock> query_blocks;
  int max_key_blocks = 0;
  for (int b = 0; b < p.batch; ++b) {
    const int sq = p.seqlen_q(b);
    plan.row_begin[std::size_t(b) + 1] = plan.row_begin[std::size_t(b)] + sq;
    for (int hh = 0; hh < p.heads; ++hh) {
      for (int block = 0; block * kBlockM < sq; ++block) query_blocks.push_back({b, hh, block});
    }
    max_key_blocks = std::max(max_key_blocks, flash::ceil_div(p.seqlen_k(b), kBlockN));
  }
  // Key block outermost: long causal tasks (low blocks) start first, and the task of key block
  // kb − 1 always precedes that of kb, as the progress protocol needs.
  std::vector<std::int64_t> task_of(std::size_t(p.batch) * p.heads_k, -1);
  for (int block = 0; block < max_key_blocks; ++block) {
    for (int b = 0; b < p.batch; ++b) {
      if (block * kBlockN >= p.seqlen_k(b)) continue;
      for (int hk = 0; hk < p.heads_k; ++hk) {
        std::int64_t& last = task_of[std::size_t(b) * p.heads_k + hk];
        plan.tasks.push_back({b, hk, block, last});
        last = std::int64_t(plan.tasks.size()) - 1;
      }
    }
  }
  const std::int64_t total_rows = plan.row_begin.back() * p.heads;
  plan.delta.assign(std::size_t(total_rows), 0.0f);
  // Zeroed block by block, in parallel, by delta_block.
  plan.dq_accum = FloatBuffer(std::size_t(total_rows) * p.head_dim, FloatBuffer::Uninitialized{});
  plan.progress.reset(new std::atomic<std::int64_t>[plan.tasks.size()]);
  for (std::size_t t = 0; t < plan.tasks.size(); ++t) plan.progress[t].store(0);

  const std::int64_t num_blocks = std::int64_t(query_blocks.size());
  const std::int64_t num_tasks = std::int64_t(plan.tasks.size());
  with_storage(p.storage, [&](auto type_tag) {
    using T = decltype(type_tag);
    zero_unused_keys<T>(p);
    const int row_workers = parallel_workers(num_blocks, num_threads);
    std::vector<FloatBuffer> rows_tmp;
    for (int wk = 0; wk < row_workers; ++wk) rows_tmp.emplace_back(2 * std::size_t(p.head_dim_v));
    parallel_for(num_blocks, num_threads, [&](std::int64_t t, int worker) {
      const QueryBlock& qb = query_blocks[std::size_t(t)];
      delta_block<T>(p, plan, qb.batch, qb.head, qb.block, rows_tmp[std::size_t(worker)].get());
    });
    if (p.dsinks) sink_gradient(p, plan);

    const int key_workers = parallel_workers(num_tasks, num_threads);
    std::vector<BackwardScratch> scratch;
    scratch.reserve(std::size_t(key_workers));
    for (int wk = 0; wk < key_workers; ++wk) scratch.emplace_back(p.head_dim, p.head_dim_v);
    // Tasks must not throw once started (a successor could wait forever): nothing below
    // allocates.
    parallel_for(num_tasks, num_threads, [&](std::int64_t t, int worker) {
      backward_key_block<T>(p, plan, t, scratch[std::size_t(worker)]);
    });

    parallel_for(num_blocks, num_threads, [&](std::int64_t t, int /*worker*/) {
      const QueryBlock& qb = query_blocks[std::size_t(t)];
      store_dq_block<T>(p, plan, qb.batch, qb.head, qb.block);
    });
  });
}

}  // namespace flashattn::cpu
