// tests/cpp/test_reference_fd.cpp — the oracle checked on its own:
//   * its fp64 forward against an independent transcription of SPEC §2 written here (no
//     src/common functor except the dropout bit, which test_dropout.cpp pins down separately);
//   * its fp64 backward against central finite differences of its fp64 forward, for
//     L = Σ out ∘ dout, on tiny shapes with every feature (GQA, masks, softcap, ALiBi, dropout with
//     a fixed mask, d ≠ dv, varlen, attention sinks — whose gradient dsinks is checked the same way).
//
// Exactness of the perturbation: the storage is f32 and every input is a multiple of 2^-10 in
// [-1, 1]; x ± h with h = 2^-12 is a multiple of 2^-12 of magnitude < 2, i.e. at most 13
// significant bits, so it is stored exactly and the forward really is evaluated at x ± h.
//
// Tolerance: the central difference errs by h²/6 · |∂³L/∂x³| (truncation) plus ~ε·|L|/h from
// fp64 rounding (ε = 2^-53: ~1e-13 here). Each derivative of L with respect to one input brings
// a factor softmax_scale·|x| ≤ 0.36 (d = 8, |x| ≤ 1) — or ≤ 1/softcap through the tanh — times
// O(1) softmax constants, so |∂³L| is O(0.1) and the truncation term is O(1e-9); measured errors
// are ≤ 3e-10. We allow 1e-8 + 1e-7·|g|, 30× the measured error; a wrong term in a gradient
// formula errs by O(|g|) ≈ 1e-2, and even an fp32 rounding slip (≈ 6e-8·|g|) stands out.
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "api/validate.h"
#include "common/philox.h"
#include "cpu/cpu.h"
#include "test_util.h"

namespace fa_test {
namespace {

namespace c = flashattn::common;
namespace cpu = flashattn::cpu;

constexpr double kGrid = 1.0 / 1024;   // inputs are multiples of 2^-10
constexpr double kStep = 1.0 / 4096;   // h = 2^-12: x ± h exact in f32
constexpr double kAbsTol = 1e-8, kRelTol = 1e-7;

// Moves every element of t to the 2^-10 grid (never 0).
void quantize(Tensor& t) {
  t.for_each_index([&](const Index& idx) {
    double x = std::round(t.get(idx) / kGrid) * kGrid;
    if (x == 0) x = kGrid;
    t.set(idx, float(x));
  });
}

AttnConfig tiny(int b, int sq, int sk, int h, int hk, int d, int dv) {
  AttnConfig cfg;
  cfg.dtype = DType::f32;
  cfg.batch = b;
  cfg.seqlen_q = sq;
  cfg.seqlen_k = sk;
  cfg.heads = h;
  cfg.heads_k = hk;
  cfg.head_dim = d;
  cfg.head_dim_v = dv;
  return cfg;
}

struct FdCase {
  std::string name;
  AttnConfig cfg;
};

std::vector<FdCase> fd_cases() {
  std::vector<FdCase> cs;
  const AttnConfig base = tiny(2, 5, 7, 2, 1, 8, 8);
  cs.push_back({"plain", base});
  AttnConfig x = base;
  x.opt.causal = true;
  cs.push_back({"causal", x});
  x = tiny(1, 9, 4, 2, 2, 8, 8);
  x.opt.causal = true;  // sq > sk: rows 0..4 fully masked
  cs.push_back({"causal_masked_rows", x});
  x = base;
  x.opt.softcap = 1.0f;
  x.qk_amplitude = 1.0f;
  cs.push_back({"softcap", x});
  x = base;
  x.alibi = Alibi::per_head;
  cs.push_back({"alibi_h", x});
  x.alibi = Alibi::per_batch_head;
  cs.push_back({"alibi_bh", x});
  x = tiny(1, 5, 7, 4, 2, 8, 8);
  cs.push_back({"gqa", x});
  x = tiny(1, 6, 6, 3, 1, 8, 16);
  cs.push_back({"mqa_d8_dv16", x});
  x = base;
  x.opt.window_left = 2;
  x.opt.window_right = 1;
  cs.push_back({"window", x});
  x = base;
  x.opt.dropout_p = 0.3f;
  x.opt.dropout_seed = 1234;
  x.opt.dropout_offset = 5;
  cs.push_back({"dropout", x});
  x = tiny(0, 0, 0, 2, 1, 16, 8);
  x.varlen_q = {3, 0, 4};
  x.varlen_k = {5, 2, 6};
  x.seqused_k = {4, 2, 6};
  x.opt.causal = true;
  cs.push_back({"varlen_seqused", x});
  x = tiny(2, 6, 8, 4, 2, 8, 16);
  x.opt.causal = true;
  x.opt.window_left = 3;
  x.opt.softcap = 2.0f;
  x.alibi = Alibi::per_batch_head;
  x.opt.dropout_p = 0.25f;
  x.opt.dropout_seed = 99;
  cs.push_back({"everything", x});
  // Attention sinks (docs/sinks.md): alone, with rows that see no key (lse = the sink), with GQA,
  // in varlen batches with an empty sequence, and with every other feature.
  const AttnConfig everything = x;
  x = base;
  x.sinks = true;
  cs.push_back({"sinks", x});
  x = tiny(1, 9, 4, 2, 2, 8, 8);
  x.opt.causal = true;
  x.sinks = true;
  cs.push_back({"sinks_masked_rows", x});
  x = tiny(1, 5, 7, 4, 2, 8, 8);
  x.sinks = true;
  cs.push_back({"sinks_gqa", x});
  x = tiny(0, 0, 0, 2, 1, 16, 8);
  x.varlen_q = {3, 0, 4};
  x.varlen_k = {5, 2, 6};
  x.seqused_k = {4, 2, 6};
  x.opt.causal = true;
  x.sinks = true;
  cs.push_back({"sinks_varlen_seqused", x});
  x = everything;
  x.sinks = true;
  cs.push_back({"sinks_everything", x});
  return cs;
}

AttnProblem make_grid_problem(const AttnConfig& cfg) {
  AttnProblem p = make_problem(cfg);
  quantize(p.q);
  quantize(p.k);
  quantize(p.v);
  quantize(p.dout);
  if (p.sinks.defined()) quantize(p.sinks);
  return p;
}

// L = Σ out ∘ dout with out from the fp64 reference (sink) at the problem's current inputs.
double loss(const AttnProblem& p, const ForwardResult& fwd) {
  const auto prob = flashattn::detail::validate_forward(p.forward_inputs(), {fwd.out.tv(), fwd.lse.tv()}, p.opt);
  std::vector<double> out(std::size_t(fwd.out.span()), std::numeric_limits<double>::quiet_NaN());
  std::vector<double> lse(std::size_t(std::max<std::int64_t>(fwd.lse.span(), 1)));
  cpu::Fp64Outputs sink;
  sink.out = out.data();
  sink.lse = lse.data();
  cpu::reference_forward(prob.params, cpu::RefPrecision::fp64, &sink);
  double l = 0;
  fwd.out.for_each_index([&](const Index& idx) { l += out[std::size_t(fwd.out.offset(idx))] * p.dout.get(idx); });
  return l;
}

class ReferenceFd : public testing::TestWithParam<FdCase> {};

TEST_P(ReferenceFd, BackwardMatchesFiniteDifferences) {
  AttnProblem p = make_grid_problem(GetParam().cfg);
  SCOPED_TRACE(describe(p.cfg));
  const ForwardResult fwd = make_forward_outputs(p);
  const BackwardResult bwd = make_backward_outputs(p);
  flashattn::BackwardOutputs bouts{bwd.dq.tv(), bwd.dk.tv(), bwd.dv.tv(), bwd.softmax_d.tv()};
  if (bwd.dsinks.defined()) bouts.dsinks = bwd.dsinks.tv();
  const auto prob = flashattn::detail::validate_backward(p.backward_inputs(fwd), bouts, p.opt);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  std::vector<double> dq(std::size_t(bwd.dq.span()), nan), dk(std::size_t(bwd.dk.span()), nan),
      dv(std::size_t(bwd.dv.span()), nan), sd(std::size_t(std::max<std::int64_t>(bwd.softmax_d.span(), 1)), nan);
  cpu::Fp64Outputs sink;
  sink.dq = dq.data();
  sink.dk = dk.data();
  sink.dv = dv.data();
  sink.softmax_d = sd.data();
  std::vector<double> dsinks(std::size_t(p.cfg.heads), nan);
  if (bwd.dsinks.defined()) sink.dsinks = dsinks.data();
  cpu::reference_backward(prob.params, cpu::RefPrecision::fp64, &sink);

  // Keys past seqused_k do not enter the function: their finite difference is 0, and the
  // reference writes 0 there (the SPEC leaves them undefined, so they are not required).
  auto key_used = [&](const Index& idx) {
    if (!p.is_varlen() || !p.seqused_k.defined()) return true;
    for (int b = 0; b < p.cfg.batch; ++b) {
      const int start = int(p.cu_seqlens_k.load(b));
      if (idx[0] >= start && idx[0] < int(p.cu_seqlens_k.load(b + 1)))
        return idx[0] - start < int(p.seqused_k.load(b));
    }
    return false;
  };

  double worst = 0;
  std::string worst_at;
  int checked = 0;
  auto check = [&](const char* name, Tensor& x, const Tensor& grad_t, const std::vector<double>& grad,
                   bool key_like) {
    x.for_each_index([&](const Index& idx) {
      if (key_like && !key_used(idx)) return;
      const float x0 = x.get(idx);
      x.set(idx, float(x0 + kStep));
      const double lp = loss(p, fwd);
      x.set(idx, float(x0 - kStep));
      const double lm = loss(p, fwd);
      x.set(idx, x0);
      const double fd = (lp - lm) / (2 * kStep);
      const double g = grad[std::size_t(grad_t.offset(idx))];
      const double err = std::abs(fd - g), tol = kAbsTol + kRelTol * std::abs(g);
      ++checked;
      if (err / tol > worst) {
        worst = err / tol;
        worst_at = std::string(name) + " fd=" + std::to_string(fd) + " analytic=" + std::to_string(g);
      }
      EXPECT_LE(err, tol) << name << " element offset " << x.offset(idx) << ": fd " << fd
                          << " vs analytic " << g;
    });
  };
  check("dq", p.q, bwd.dq, dq, false);
  check("dk", p.k, bwd.dk, dk, true);
  check("dv", p.v, bwd.dv, dv, true);
  if (p.sinks.defined()) {
    const int before = checked;
    check("dsinks", p.sinks, bwd.dsinks, dsinks, false);
    EXPECT_EQ(checked - before, p.cfg.heads);
  }
  EXPECT_GT(checked, 0);
  RecordProperty("worst_err_over_tol", std::to_string(worst));
  if (worst > 1) ADD_FAILURE() << "worst: " << worst_at;

  // softmax_d = rowsum(dout ∘ out), out from the fp64 forward.
  {
    const auto fprob = flashattn::detail::validate_forward(p.forward_inputs(), {fwd.out.tv(), fwd.lse.tv()}, p.opt);
    std::vector<double> out(std::size_t(fwd.out.span()), nan), lse(std::size_t(std::max<std::int64_t>(fwd.lse.span(), 1)), nan);
    cpu::Fp64Outputs fs;
    fs.out = out.data();
    fs.lse = lse.data();
    cpu::reference_forward(fprob.params, cpu::RefPrecision::fp64, &fs);
    const auto& fp = fprob.params;
    const auto& bp = prob.params;  // the backward's params hold dout
    for (int b = 0; b < fp.batch; ++b)
      for (int hh = 0; hh < fp.heads; ++hh)
        for (int i = 0; i < fp.seqlen_q(b); ++i) {
          const std::int64_t oo = fp.q_offset(fp.out, b, i, hh), go = bp.q_offset(bp.dout, b, i, hh);
          double want = 0;
          for (int col = 0; col < fp.head_dim_v; ++col)
            want += out[std::size_t(oo + col)] * double(static_cast<const float*>(bp.dout.data)[go + col]);
          EXPECT_NEAR(sd[std::size_t(fp.lse_index(b, hh, i))], want, 1e-12 * (1 + std::abs(want)))
              << "softmax_d b=" << b << " h=" << hh << " i=" << i;
        }
  }
}

INSTANTIATE_TEST_SUITE_P(Features, ReferenceFd, testing::ValuesIn(fd_cases()),
                         [](const testing::TestParamInfo<FdCase>& info) { return info.param.name; });

// --- the same values on any number of threads ---------------------------------------------------

// The references split their work over (batch, head) pairs — (batch, kv head) in the backward —
// and sum the sinks' gradient over the batch in order: 1 and 3 threads give the same bits, in
// fp64 (into the sinks) and emulating bf16 storage (into the tensors), forward and backward.
TEST(ReferenceThreads, SameValuesForAnyThreadCount) {
  AttnConfig cfg = tiny(3, 96, 160, 8, 2, 64, 64);  // tasks long enough for every worker to take some
  cfg.dtype = DType::bf16;
  cfg.sinks = true;
  cfg.opt.causal = true;
  const AttnProblem p = make_problem(cfg);
  const ForwardResult fwd = make_forward_outputs(p);
  for (const cpu::RefPrecision precision : {cpu::RefPrecision::fp64, cpu::RefPrecision::emulate_storage}) {
    SCOPED_TRACE(precision == cpu::RefPrecision::fp64 ? "fp64" : "emulate_storage");
    struct Run {
      std::vector<double> out, lse, dq, dk, dv, sd, dsinks;
      ForwardResult f;
      BackwardResult b;
    };
    auto run = [&](int threads) {
      Run r{};
      r.f = make_forward_outputs(p);
      r.b = make_backward_outputs(p);
      const auto fprob = flashattn::detail::validate_forward(p.forward_inputs(), {r.f.out.tv(), r.f.lse.tv()}, p.opt);
      flashattn::BackwardOutputs bouts{r.b.dq.tv(), r.b.dk.tv(), r.b.dv.tv(), r.b.softmax_d.tv()};
      bouts.dsinks = r.b.dsinks.tv();
      const auto bprob = flashattn::detail::validate_backward(p.backward_inputs(fwd), bouts, p.opt);
      const bool fp64 = precision == cpu::RefPrecision::fp64;
      const double nan = std::numeric_limits<double>::quiet_NaN();
      auto sized = [&](std::int64_t span) { return std::vector<double>(std::size_t(std::max<std::int64_t>(span, 1)), nan); };
      r.out = sized(r.f.out.span()), r.lse = sized(r.f.lse.span()), r.dq = sized(r.b.dq.span());
      r.dk = sized(r.b.dk.span()), r.dv = sized(r.b.dv.span()), r.sd = sized(r.b.softmax_d.span());
      r.dsinks = sized(cfg.heads);
      cpu::Fp64Outputs fs, bs;
      fs.out = r.out.data(), fs.lse = r.lse.data();
      bs.dq = r.dq.data(), bs.dk = r.dk.data(), bs.dv = r.dv.data(), bs.softmax_d = r.sd.data();
      bs.dsinks = r.dsinks.data();
      cpu::reference_forward(fprob.params, precision, fp64 ? &fs : nullptr, threads);
      cpu::reference_backward(bprob.params, precision, fp64 ? &bs : nullptr, threads);
      return r;
    };
    const Run one = run(1), three = run(3);
    auto same = [](const std::vector<double>& a, const std::vector<double>& b) {
      return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
    };
    for (const auto& [name, a, b] : {std::tuple{"out", &one.out, &three.out}, std::tuple{"lse", &one.lse, &three.lse},
                                     std::tuple{"dq", &one.dq, &three.dq}, std::tuple{"dk", &one.dk, &three.dk},
                                     std::tuple{"dv", &one.dv, &three.dv}, std::tuple{"softmax_d", &one.sd, &three.sd},
                                     std::tuple{"dsinks", &one.dsinks, &three.dsinks}}) {
      EXPECT_TRUE(same(*a, *b)) << name;
    }
    EXPECT_TRUE(bitwise_equal(one.f.out, three.f.out));
    EXPECT_TRUE(bitwise_equal(one.f.lse, three.f.lse));
    EXPECT_TRUE(bitwise_equal(one.b.dq, three.b.dq));
    EXPECT_TRUE(bitwise_equal(one.b.dk, three.b.dk));
    EXPECT_TRUE(bitwise_equal(one.b.dv, three.b.dv));
    EXPECT_TRUE(bitwise_equal(one.b.softmax_d, three.b.softmax_d));
    EXPECT_TRUE(bitwise_equal(one.b.dsinks, three.b.dsinks));
    if (precision == cpu::RefPrecision::fp64) {
      // The fp64 run wrote the sinks: finite values, so the comparison above compared numbers.
      EXPECT_TRUE(std::isfinite(one.dq[0]) && std::isfinite(one.dsinks[0]));
    }
  }
}

// --- the forward against SPEC §2, transcribed independently -------------------------------------

struct SpecResult {
  std::vector<double> out;  // (b, sq, h, dv)
  std::vector<double> lse;  // (b, h, sq)
};

// SPEC §2 for a dense problem, line by line. softmax_scale is the fp32 value the call carries
// (Options::softmax_scale, or 1/sqrt(d) rounded to fp32), as every backend sees it.
SpecResult spec_forward(const AttnProblem& p, double scale) {
  const auto& cfg = p.cfg;
  const int B = cfg.batch, SQ = cfg.seqlen_q, SK = cfg.seqlen_k, H = cfg.heads, HK = cfg.heads_k,
            D = cfg.head_dim, DV = p.head_dim_v;
  int wl = p.opt.window_left, wr = p.opt.window_right;
  if (p.opt.causal) wr = 0;       // causal is window_right = 0
  if (wl >= SK) wl = -1;          // a window ≥ sk is unbounded
  if (wr >= SK) wr = -1;
  const double dropout = p.opt.dropout_p;
  c::DropoutParams dp;
  dp.seed = p.opt.dropout_seed;
  dp.offset = p.opt.dropout_offset;
  dp.keep_threshold = c::dropout_keep_threshold(p.opt.dropout_p);
  const double keep_scale = double(1.0f / (1.0f - p.opt.dropout_p));  // computed in fp32
  SpecResult r;
  r.out.assign(std::size_t(B) * SQ * H * DV, 0.0);
  r.lse.assign(std::size_t(B) * H * SQ, std::numeric_limits<double>::infinity());
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h) {
      const int hk = h / (H / HK);
      const double slope = cfg.alibi == Alibi::none ? 0.0
                           : cfg.alibi == Alibi::per_head ? p.alibi_slopes.get({h})
                                                          : p.alibi_slopes.get({b, h});
      for (int i = 0; i < SQ; ++i) {
        const long r_diag = long(i) + SK - SQ;
        std::vector<double> s(std::size_t(SK), -std::numeric_limits<double>::infinity());
        double m = -std::numeric_limits<double>::infinity();
        for (int j = 0; j < SK; ++j) {
          const bool visible = (wl < 0 || j >= r_diag - wl) && (wr < 0 || j <= r_diag + wr);
          if (!visible) continue;
          double dot = 0;
          for (int x = 0; x < D; ++x) dot += double(p.q.get({b, i, h, x})) * p.k.get({b, j, hk, x});
          double sc = scale * dot;
          if (p.opt.softcap > 0) sc = p.opt.softcap * std::tanh(sc / p.opt.softcap);
          sc -= slope * std::abs(double(r_diag - j));
          s[std::size_t(j)] = sc;
          m = std::max(m, sc);
        }
        // The sink (docs/sinks.md): one more term of the denominator, none of the output; a row
        // without keys has lse = the sink.
        const double sink = p.sinks.defined() ? double(p.sinks.get({h})) : -std::numeric_limits<double>::infinity();
        if (m == -std::numeric_limits<double>::infinity()) {  // out 0, lse +inf (or the sink)
          if (p.sinks.defined()) r.lse[(std::size_t(b) * H + h) * SQ + i] = sink;
          continue;
        }
        m = std::max(m, sink);
        double sum = std::exp(sink - m);
        for (double v : s) sum += std::exp(v - m);
        const double lse = m + std::log(sum);
        r.lse[(std::size_t(b) * H + h) * SQ + i] = lse;
        for (int j = 0; j < SK; ++j) {
          double pij = std::exp(s[std::size_t(j)] - lse);
          if (dropout > 0) {
            const bool keep = c::dropout_keep(dp, std::uint64_t(b) * H + h, i, j);
            pij = keep ? pij * keep_scale : 0.0;
          }
          for (int x = 0; x < DV; ++x)
            r.out[((std::size_t(b) * SQ + i) * H + h) * DV + x] += pij * p.v.get({b, j, hk, x});
        }
      }
    }
  return r;
}

class ReferenceSpec : public testing::TestWithParam<FdCase> {};

TEST_P(ReferenceSpec, ForwardMatchesSpecTranscription) {
  AttnConfig cfg = GetParam().cfg;  // dense (the transcription indexes (b, s, h, d))
  cfg.seqlen_q *= 3;  // a bit larger than the FD shapes
  cfg.seqlen_k *= 3;
  const AttnProblem p = make_problem(cfg);
  SCOPED_TRACE(describe(p.cfg));
  const ForwardResult fwd = make_forward_outputs(p);
  const auto prob = flashattn::detail::validate_forward(p.forward_inputs(), {fwd.out.tv(), fwd.lse.tv()}, p.opt);
  std::vector<double> out(std::size_t(fwd.out.span())), lse(std::size_t(std::max<std::int64_t>(fwd.lse.span(), 1)));
  cpu::Fp64Outputs sink;
  sink.out = out.data();
  sink.lse = lse.data();
  cpu::reference_forward(prob.params, cpu::RefPrecision::fp64, &sink);
  const double scale = p.opt.softmax_scale > 0 ? p.opt.softmax_scale : 1.0 / std::sqrt(double(p.cfg.head_dim));
  ASSERT_NEAR(prob.params.softmax_scale, scale, 1e-7 * scale);
  const SpecResult want = spec_forward(p, prob.params.softmax_scale);
  std::int64_t bad = 0;
  fwd.out.for_each_index([&](const Index& idx) {
    const double got = out[std::size_t(fwd.out.offset(idx))];
    const double w = want.out[std::size_t(((idx[0] * p.cfg.seqlen_q + idx[1]) * p.cfg.heads + idx[2]) * p.head_dim_v + idx[3])];
    if (!(std::abs(got - w) <= 1e-12 * (1 + std::abs(w)))) {
      if (bad++ < 5) ADD_FAILURE() << "out at " << fwd.out.offset(idx) << ": reference " << got << " spec " << w;
    }
  });
  fwd.lse.for_each_index([&](const Index& idx) {
    const double got = lse[std::size_t(fwd.lse.offset(idx))];
    const double w = want.lse[std::size_t(fwd.lse.offset(idx))];
    const bool same = std::isinf(w) ? got == w : std::abs(got - w) <= 1e-12 * (1 + std::abs(w));
    if (!same && bad++ < 5) ADD_FAILURE() << "lse at " << fwd.lse.offset(idx) << ": reference " << got << " spec " << w;
  });
  EXPECT_EQ(bad, 0);
}

// The dense cases of the FD grid (the varlen one is covered by the accuracy grids).
std::vector<FdCase> dense_cases() {
  std::vector<FdCase> cs;
  for (const FdCase& f : fd_cases())
    if (f.cfg.varlen_q.empty()) cs.push_back(f);
  FdCase scaled = cs.front();
  scaled.name = "explicit_scale_wide_window";
  scaled.cfg.opt.softmax_scale = 0.7f;
  scaled.cfg.opt.window_left = 100;  // ≥ sk: unbounded
  scaled.cfg.opt.window_right = 2;
  cs.push_back(scaled);
  return cs;
}

INSTANTIATE_TEST_SUITE_P(Features, ReferenceSpec, testing::ValuesIn(dense_cases()),
                         [](const testing::TestParamInfo<FdCase>& info) { return info.param.name; });

}  // namespace
}  // namespace fa_test
