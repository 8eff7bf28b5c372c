// src/cpu/reference.cpp — the naive reference: materialised scores, one (batch, kv-head group)
// at a time (several at once on num_threads threads; each writes only its own rows, so the
// results do not depend on the thread count). In fp64 it is the oracle of every test; in
// emulate_storage it is SPEC §7's naive_lowprec (fp32 math with every materialised intermediate
// rounded to the input dtype).
// Semantics come only from src/common (mask, score mod, dropout, layouts).
#include <cmath>
#include <limits>
#include <vector>

#include "common/numeric.h"
#include "common/sink.h"
#include "cpu/cpu.h"
#include "cpu/parallel.h"
#include "cpu/storage_dispatch.h"

namespace flashattn::cpu {
namespace {

using common::AttentionParams;
using common::RowHeadTensor;

// Storage element type T, math type Acc (double for the oracle, float for naive_lowprec).
template <class T, class Acc>
struct Ref {
  const AttentionParams& p;
  const bool emulate;  // round materialised intermediates to T
  const Fp64Outputs* sink;
  int num_threads;

  // Threads for `tasks` (batch, head) tasks of sq · sk · (d + dv) multiply-adds each, times `passes`.
  int threads_for(std::int64_t tasks, int passes) const {
    const double flops = 2.0 * passes * double(tasks) * double(p.max_seqlen_q) * double(p.max_seqlen_k) *
                         double(p.head_dim + p.head_dim_v);
    return threads_for_work(flops, num_threads);
  }

  Acc rnd(Acc x) const { return emulate ? Acc(common::round_to<T>(float(x))) : x; }

  Acc load(const RowHeadTensor& t, std::int64_t off) const {
    return Acc(common::to_float(static_cast<const T*>(t.data)[off]));
  }
  void store(const RowHeadTensor& t, double* sink_array, std::int64_t off, Acc value) const {
    if (sink_array) {
      sink_array[off] = double(value);
    } else {
      static_cast<T*>(t.data)[off] = common::from_float<T>(float(value));
    }
  }

  // One (batch, head): scores → probabilities (pre-dropout) and lse, both materialised.
  struct Probs {
    int sq = 0, sk = 0;
    std::vector<Acc> s;     // (sq, sk) final scores (−∞ where masked)
    std::vector<Acc> prob;  // (sq, sk) p_ij, rounded like a framework would
    std::vector<Acc> kept;  // (sq, sk) keep_ij · p_ij / (1 − p), rounded
    std::vector<Acc> lse;   // (sq)
  };

  Probs probabilities(int b, int hh) const {
    Probs r;
    r.sq = p.seqlen_q(b);
    r.sk = p.seqlen_k(b);
    const int hk = hh / p.group_size();
    const common::Mask mask = p.mask(b);
    const common::ScoreMod<Acc> mod = p.template score_mod<Acc>(b, hh);
    const Acc neg_inf = -std::numeric_limits<Acc>::infinity();
    const Acc sink_logit = Acc(p.sink(hh));  // −∞: none
    r.s.assign(std::size_t(r.sq) * r.sk, neg_inf);
    r.prob.assign(r.s.size(), Acc(0));
    r.kept.assign(r.s.size(), Acc(0));
    r.lse.assign(r.sq, std::numeric_limits<Acc>::infinity());
    for (int i = 0; i < r.sq; ++i) {
      Acc row_max = neg_inf;
      for (int j = 0; j < r.sk; ++j) {
        if (!mask.visible(i, j)) continue;
        Acc dot = 0;
        const std::int64_t qo = p.q_offset(p.q, b, i, hh), ko = p.k_offset(p.k, b, j, hk);
        for (int d = 0; d < p.head_dim; ++d) dot += load(p.q, qo + d) * load(p.k, ko + d);
        const Acc s = rnd(mod(rnd(dot), i, j));
        r.s[std::size_t(i) * r.sk + j] = s;
        // A NaN score sticks (std::max would drop it): the row's lse and out become NaN.
        if (!std::isnan(row_max) && (std::isnan(s) || s > row_max)) row_max = s;
      }
      // No visible key (or only scores of −∞): p = 0, lse = the sink (+∞ without one).
      if (row_max == neg_inf) {
        r.lse[i] = common::empty_row_lse(sink_logit);
        continue;
      }
      // The sink joins the denominator (common/sink.h); measured from the larger of it and the
      // row max, so that exp never overflows. A NaN sink takes the max and makes everything NaN.
      if (sink_logit > row_max || std::isnan(sink_logit)) row_max = sink_logit;
      Acc sum = std::exp(sink_logit - row_max);
      for (int j = 0; j < r.sk; ++j) {
        if (mask.visible(i, j)) sum += std::exp(r.s[std::size_t(i) * r.sk + j] - row_max);
      }
      const Acc lse = row_max + std::log(sum);
      r.lse[i] = lse;
      for (int j = 0; j < r.sk; ++j) {
        const std::size_t ij = std::size_t(i) * r.sk + j;
        // A masked pair has p = 0 even when the row's lse is NaN: it never carries a NaN.
        if (!mask.visible(i, j)) continue;
        r.prob[ij] = rnd(std::exp(r.s[ij] - lse));
        bool keep = true;
        if (p.dropout_p > 0.0f) keep = common::dropout_keep(p.dropout, p.dropout_stream(b, hh), i, j);
        r.kept[ij] = keep ? rnd(r.prob[ij] * Acc(p.dropout.keep_scale)) : Acc(0);
      }
    }
    return r;
  }

  // out_i = Σ_j kept_ij v_j (rounded to T in emulation), into o (sq, dv).
  std::vector<Acc> output(int b, int hh, const Probs& r) const {
    const int hk = hh / p.group_size();
    std::vector<Acc> o(std::size_t(r.sq) * p.head_dim_v, Acc(0));
    for (int i = 0; i < r.sq; ++i) {
      for (int j = 0; j < r.sk; ++j) {
        const Acc w = r.kept[std::size_t(i) * r.sk + j];
        if (w == Acc(0)) continue;
        const std::int64_t vo = p.k_offset(p.v, b, j, hk);
        for (int d = 0; d < p.head_dim_v; ++d) o[std::size_t(i) * p.head_dim_v + d] += w * load(p.v, vo + d);
      }
      for (int d = 0; d < p.head_dim_v; ++d) o[std::size_t(i) * p.head_dim_v + d] = rnd(o[std::size_t(i) * p.head_dim_v + d]);
    }
    return o;
  }

  void forward() const {
    const std::int64_t tasks = std::int64_t(p.batch) * p.heads;
    parallel_for(tasks, threads_for(tasks, 1), [&](std::int64_t task, int) {
      const int b = int(task / p.heads), hh = int(task % p.heads);
      const Probs r = probabilities(b, hh);
      const std::vector<Acc> o = output(b, hh, r);
      for (int i = 0; i < r.sq; ++i) {
        const std::int64_t oo = p.q_offset(p.out, b, i, hh);
        for (int d = 0; d < p.head_dim_v; ++d) store(p.out, sink ? sink->out : nullptr, oo + d, o[std::size_t(i) * p.head_dim_v + d]);
        if (p.lse) {
          const std::int64_t li = p.lse_index(b, hh, i);
          if (sink && sink->lse) {
            sink->lse[li] = double(r.lse[i]);
          } else if (!sink) {
            p.lse[li] = float(r.lse[i]);
          }
        }
      }
    });
  }

  void backward() const {
    const int group = p.group_size();
    // d lse_i / d s_h = exp(s_h − lse_i), and d loss / d lse_i = −D_i (the softmax's Jacobian): the
    // sinks' gradient sums −exp(s_h − lse_i) · D_i over every row of the head — per sequence by the
    // task of its (batch, kv head), then over the batch in order.
    std::vector<Acc> dsinks_of(p.sinks ? std::size_t(p.batch) * p.heads : 0, Acc(0));  // (batch, h)
    const std::int64_t tasks = std::int64_t(p.batch) * p.heads_k;
    parallel_for(tasks, threads_for(tasks * group, 3), [&](std::int64_t task, int) {
      const int b = int(task / p.heads_k), hk = int(task % p.heads_k);
      const int sq = p.seqlen_q(b), sk = p.seqlen_k(b);
      // Keys of the sequence that exist but are unused (varlen seqused_k) get zero gradients too.
      const int sk_rows = p.is_varlen() ? p.cu_seqlens_k[b + 1] - p.cu_seqlens_k[b] : sk;
      std::vector<Acc> dk(std::size_t(sk_rows) * p.head_dim, Acc(0));   // (sk, d), summed over the group
      std::vector<Acc> dv(std::size_t(sk_rows) * p.head_dim_v, Acc(0));  // (sk, dv)
      for (int hh = hk * group; hh < (hk + 1) * group; ++hh) {
        const Probs r = probabilities(b, hh);
        const std::vector<Acc> o = output(b, hh, r);
        const common::ScoreMod<Acc> mod = p.template score_mod<Acc>(b, hh);
        for (int i = 0; i < sq; ++i) {
          const std::int64_t go = p.q_offset(p.dout, b, i, hh), qo = p.q_offset(p.q, b, i, hh);
          Acc dsum = 0;  // D_i = dout_i · out_i
          for (int d = 0; d < p.head_dim_v; ++d) dsum += load(p.dout, go + d) * o[std::size_t(i) * p.head_dim_v + d];
          std::vector<Acc> dq(p.head_dim, Acc(0));
          for (int j = 0; j < sk; ++j) {
            const std::size_t ij = std::size_t(i) * sk + j;
            if (r.prob[ij] == Acc(0)) continue;  // masked or underflowed: no gradient
            const std::int64_t ko = p.k_offset(p.k, b, j, hk), vo = p.k_offset(p.v, b, j, hk);
            Acc dp = 0;  // dout_i · v_j
            for (int d = 0; d < p.head_dim_v; ++d) dp += load(p.dout, go + d) * load(p.v, vo + d);
            const bool keep = !(p.dropout_p > 0.0f) || common::dropout_keep(p.dropout, p.dropout_stream(b, hh), i, j);
            const Acc dp_kept = keep ? rnd(rnd(dp) * Acc(p.dropout.keep_scale)) : Acc(0);
            const Acc ds = rnd(rnd(r.prob[ij] * (dp_kept - dsum)) * mod.dscore_ddot(r.s[ij], i, j));
            for (int d = 0; d < p.head_dim_v; ++d) dv[std::size_t(j) * p.head_dim_v + d] += r.kept[ij] * load(p.dout, go + d);
            for (int d = 0; d < p.head_dim; ++d) {
              dq[d] += ds * load(p.k, ko + d);
              dk[std::size_t(j) * p.head_dim + d] += ds * load(p.q, qo + d);
            }
          }
          const std::int64_t dqo = p.q_offset(p.dq, b, i, hh);
          for (int d = 0; d < p.head_dim; ++d) store(p.dq, sink ? sink->dq : nullptr, dqo + d, dq[d]);
          const std::int64_t li = p.lse_index(b, hh, i);
          if (p.sinks) dsinks_of[std::size_t(b) * p.heads + hh] -= std::exp(Acc(p.sinks[hh]) - r.lse[i]) * dsum;
          if (sink && sink->softmax_d) {
            sink->softmax_d[li] = double(dsum);
          } else if (!sink) {
            p.softmax_d[li] = float(dsum);
          }
        }
      }
      for (int j = 0; j < sk_rows; ++j) {
        const std::int64_t dko = p.k_offset(p.dk, b, j, hk), dvo = p.k_offset(p.dv, b, j, hk);
        for (int d = 0; d < p.head_dim; ++d) store(p.dk, sink ? sink->dk : nullptr, dko + d, dk[std::size_t(j) * p.head_dim + d]);
        for (int d = 0; d < p.head_dim_v; ++d) store(p.dv, sink ? sink->dv : nullptr, dvo + d, dv[std::size_t(j) * p.head_dim_v + d]);
      }
    });
    for (int hh = 0; p.dsinks && hh < p.heads; ++hh) {
      Acc dsink = 0;
      for (int b = 0; p.sinks && b < p.batch; ++b) dsink += dsinks_of[std::size_t(b) * p.heads + hh];
      if (sink && sink->dsinks) {
        sink->dsinks[hh] = double(dsink);
      } else if (!sink) {
        p.dsinks[hh] = float(dsink);
      }
    }
  }
};

}  // namespace

void reference_forward(const AttentionParams& p, RefPrecision precision, const Fp64Outputs* sink, int num_threads) {
  with_storage(p.storage, [&](auto tag) {
    using T = decltype(tag);
    if (precision == RefPrecision::fp64) {
      Ref<T, double>{p, false, sink, num_threads}.forward();
    } else {
      Ref<T, float>{p, true, sink, num_threads}.forward();
    }
  });
}

void reference_backward(const AttentionParams& p, RefPrecision precision, const Fp64Outputs* sink, int num_threads) {
  with_storage(p.storage, [&](auto tag) {
    using T = decltype(tag);
    if (precision == RefPrecision::fp64) {
      Ref<T, double>{p, false, sink, num_threads}.backward();
    } else {
      Ref<T, float>{p, true, sink, num_threads}.backward();
    }
  });
}

}  // namespace flashattn::cpu
