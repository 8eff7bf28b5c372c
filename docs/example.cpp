// docs/example.cpp — causal bf16 attention with grouped-query heads, forward and backward, on
// caller-owned host memory. scripts/test compiles and runs this file.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "flashattn/flashattn.h"

using flashattn::DType;
using flashattn::TensorView;

// fp32 → bf16 bits, round to nearest even (finite inputs).
std::uint16_t to_bf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return std::uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
float from_bf16(std::uint16_t x) {
  const std::uint32_t u = std::uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

int main() {
  const int b = 2, s = 256, h = 8, hk = 2, d = 64;  // 8 query heads share 2 key/value heads

  std::mt19937 rng(0);
  std::normal_distribution<float> normal;
  auto random_bf16 = [&](std::size_t n) {
    std::vector<std::uint16_t> x(n);
    for (auto& e : x) e = to_bf16(normal(rng));
    return x;
  };
  // Every buffer belongs to the caller; the library only sees views of it.
  auto q = random_bf16(std::size_t(b) * s * h * d), dout = random_bf16(q.size());
  auto k = random_bf16(std::size_t(b) * s * hk * d), v = random_bf16(k.size());
  std::vector<std::uint16_t> out(q.size()), dq(q.size()), dk(k.size()), dv(v.size());
  std::vector<float> lse(std::size_t(b) * h * s), softmax_d(lse.size());

  auto bf16 = [](std::vector<std::uint16_t>& x, std::int64_t rows, std::int64_t heads) {
    return TensorView::contiguous(x.data(), DType::bf16, {b, rows, heads, d});  // (b, s, heads, d)
  };
  const TensorView lse_view = TensorView::contiguous(lse.data(), DType::f32, {b, h, s});

  flashattn::Options opt;  // every field has a default
  opt.causal = true;
  opt.window_left = 128;   // sliding window: each query sees at most 129 keys
  opt.dropout_p = 0.1f;    // the mask is a pure function of (seed, offset, batch, head, i, j)
  opt.dropout_seed = 42;

  try {
    const flashattn::ForwardInputs fwd_in{bf16(q, s, h), bf16(k, s, hk), bf16(v, s, hk)};
    const flashattn::ForwardOutputs fwd_out{bf16(out, s, h), lse_view};
    std::printf("served by: %s\n", flashattn::backend_name(flashattn::can_implement(fwd_in, fwd_out, opt).backend));
    std::vector<unsigned char> ws(flashattn::forward_workspace_size(fwd_in, opt));
    flashattn::forward(fwd_in, fwd_out, opt, {ws.data(), ws.size()});

    const flashattn::BackwardInputs bwd_in{bf16(dout, s, h), fwd_in.q, fwd_in.k, fwd_in.v, fwd_out.out, lse_view};
    const flashattn::BackwardOutputs bwd_out{bf16(dq, s, h), bf16(dk, s, hk), bf16(dv, s, hk),
                                             TensorView::contiguous(softmax_d.data(), DType::f32, {b, h, s})};
    ws.resize(flashattn::backward_workspace_size(bwd_in, opt));
    flashattn::backward(bwd_in, bwd_out, opt, {ws.data(), ws.size()});
  } catch (const flashattn::Error& e) {  // a bad call names the argument and the rule
    std::fprintf(stderr, "flashattn: %s\n", e.what());
    return 1;
  }
  double dq_norm = 0;
  for (const auto x : dq) dq_norm += double(from_bf16(x)) * from_bf16(x);
  std::printf("lse[0] = %.4f, |dq| = %.4f\n", lse[0], std::sqrt(dq_norm));
  return std::isfinite(dq_norm) ? 0 : 1;
}
