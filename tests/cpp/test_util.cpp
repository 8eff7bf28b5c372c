// tests/cpp/test_util.cpp — the test tensor, problem builders and the SPEC §7 accuracy checker.
#include "test_util.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iomanip>
#include <limits>
#include <sstream>
#include <thread>

#include "api/validate.h"
#include "common/numeric.h"
#include "cpu/cpu.h"

namespace fa_test {

namespace c = flashattn::common;

// --- seeds --------------------------------------------------------------------------------------

namespace {

std::uint64_t splitmix64(std::uint64_t& state) {
  std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

std::uint64_t mix(std::uint64_t a, std::uint64_t b) {
  std::uint64_t s = a ^ (b * 0xD6E8FEB86659FD93ull);
  return splitmix64(s);
}

std::uint64_t fnv1a(const std::string& s) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char ch : s) {
    h ^= ch;
    h *= 0x100000001b3ull;
  }
  return h;
}

}  // namespace

// Threads of the fp64 and naive references in check_forward / check_backward: FA_TEST_REF_THREADS,
// else every hardware thread (the references give the same values for any count).
int reference_threads() {
  static const int threads = [] {
    const char* value = std::getenv("FA_TEST_REF_THREADS");
    const int asked = value != nullptr ? std::atoi(value) : 0;
    return asked > 0 ? asked : std::max(1, int(std::thread::hardware_concurrency()));
  }();
  return threads;
}

std::uint64_t test_seed(std::uint64_t salt) {
  const testing::TestInfo* info = testing::UnitTest::GetInstance()->current_test_info();
  std::string name = "no-test";
  if (info) name = std::string(info->test_suite_name()) + "." + info->name();
  return mix(fnv1a(name), salt + 1);
}

// --- dtypes -------------------------------------------------------------------------------------

double unit_roundoff(DType dtype) {
  switch (dtype) {
    case DType::bf16: return std::ldexp(1.0, -8);
    case DType::f16: return std::ldexp(1.0, -11);
    case DType::f32: return std::ldexp(1.0, -24);
    case DType::i32: return 0.0;
    case DType::f8e4m3: return std::ldexp(1.0, -4);
  }
  return 0.0;
}

float round_to(DType dtype, float x) {
  switch (dtype) {
    case DType::bf16: return c::round_to<c::bf16_t>(x);
    case DType::f16: return c::round_to<c::f16_t>(x);
    case DType::f8e4m3: return c::round_to<c::e4m3_t>(x);
    default: return x;
  }
}

std::uint32_t poison_bits(DType dtype) {
  switch (dtype) {
    case DType::f16: return 0x7E5Au;   // exponent all ones, mantissa ≠ 0: a NaN
    case DType::bf16: return 0x7FA5u;  // likewise for bf16
    case DType::f8e4m3: return 0x7Fu;  // e4m3's NaN
    case DType::f32:
    case DType::i32: return 0x7FC0DEADu;
  }
  return 0;
}

// --- Tensor -------------------------------------------------------------------------------------

namespace {

Strides contiguous_strides(const Shape& shape) {
  Strides s(shape.size());
  std::int64_t stride = 1;
  for (int i = int(shape.size()) - 1; i >= 0; --i) {
    s[std::size_t(i)] = stride;
    stride *= shape[std::size_t(i)];
  }
  return s;
}

std::int64_t span_of(const Shape& shape, const Strides& strides) {
  std::int64_t last = 0;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == 0) return 0;
    last += (shape[i] - 1) * strides[i];
  }
  return last + 1;
}

}  // namespace

Tensor::Tensor(DType dtype, Shape shape) {
  *this = with_strides(dtype, shape, contiguous_strides(shape));
}

Tensor Tensor::with_strides(DType dtype, Shape shape, Strides strides) {
  if (shape.size() != strides.size()) throw std::runtime_error("Tensor: shape/stride rank mismatch");
  Tensor t;
  t.dtype_ = dtype;
  t.shape_ = std::move(shape);
  t.strides_ = std::move(strides);
  t.storage_ = std::make_shared<Storage>();
  const std::int64_t elems = std::max<std::int64_t>(span_of(t.shape_, t.strides_), 1);
  t.storage_->bytes = std::size_t(elems) * flashattn::dtype_size(dtype);
  t.storage_->words.resize((t.storage_->bytes + 7) / 8);
  t.owns_buffer_ = true;
  t.fill_poison();
  return t;
}

Tensor Tensor::from_i32(const std::vector<std::int32_t>& values) {
  Tensor t(DType::i32, {std::int64_t(values.size())});
  for (std::size_t i = 0; i < values.size(); ++i) {
    std::memcpy(static_cast<char*>(t.data()) + 4 * i, &values[i], 4);
  }
  return t;
}

Tensor Tensor::from_f32(Shape shape, const std::vector<float>& values) {
  Tensor t(DType::f32, std::move(shape));
  if (std::int64_t(values.size()) != t.numel()) throw std::runtime_error("from_f32: size mismatch");
  std::memcpy(t.data(), values.data(), values.size() * 4);
  return t;
}

Tensor Tensor::empty_like(const Tensor& t) { return with_strides(t.dtype_, t.shape_, t.strides_); }

Tensor Tensor::view(std::int64_t offset, Shape shape, Strides strides) const {
  Tensor t = *this;
  t.base_ = base_ + offset;
  t.shape_ = std::move(shape);
  t.strides_ = std::move(strides);
  t.owns_buffer_ = false;
  return t;
}

Tensor Tensor::clone() const {
  Tensor t = empty_like(*this);
  for_each_index([&](const Index& idx) {
    const std::int64_t src = offset(idx), dst = t.offset(idx);
    const std::size_t es = flashattn::dtype_size(dtype_);
    std::memcpy(static_cast<char*>(t.data()) + dst * std::int64_t(es),
                static_cast<const char*>(data()) + src * std::int64_t(es), es);
  });
  return t;
}

flashattn::TensorView Tensor::tv() const {
  flashattn::TensorView v;
  if (!storage_) return v;
  v.data = data();
  v.dtype = dtype_;
  v.ndim = ndim();
  for (int i = 0; i < ndim(); ++i) {
    v.shape[i] = shape_[std::size_t(i)];
    v.stride[i] = strides_[std::size_t(i)];
  }
  return v;
}

std::int64_t Tensor::numel() const {
  std::int64_t n = 1;
  for (auto s : shape_) n *= s;
  return n;
}

std::int64_t Tensor::span() const { return span_of(shape_, strides_); }

void* Tensor::data() const {
  if (!storage_) return nullptr;
  return reinterpret_cast<char*>(storage_->words.data()) +
         base_ * std::int64_t(flashattn::dtype_size(dtype_));
}

std::int64_t Tensor::offset(const Index& idx) const {
  if (idx.size() != shape_.size()) throw std::runtime_error("Tensor: index rank mismatch");
  std::int64_t off = 0;
  for (std::size_t i = 0; i < idx.size(); ++i) {
    if (idx[i] < 0 || idx[i] >= shape_[i]) throw std::runtime_error("Tensor: index out of range");
    off += idx[i] * strides_[i];
  }
  return off;
}

std::uint32_t Tensor::bits_at(std::int64_t off) const {
  const char* p = static_cast<const char*>(data());
  if (dtype_ == DType::f16 || dtype_ == DType::bf16) {
    std::uint16_t u;
    std::memcpy(&u, p + off * 2, 2);
    return u;
  }
  if (dtype_ == DType::f8e4m3) return std::uint8_t(p[off]);
  std::uint32_t u;
  std::memcpy(&u, p + off * 4, 4);
  return u;
}

float Tensor::load(std::int64_t off) const {
  const std::uint32_t u = bits_at(off);
  switch (dtype_) {
    case DType::f16: return c::to_float(c::f16_t{std::uint16_t(u)});
    case DType::bf16: return c::to_float(c::bf16_t{std::uint16_t(u)});
    case DType::f8e4m3: return c::to_float(c::e4m3_t{std::uint8_t(u)});
    case DType::f32: return c::bits_float(u);
    case DType::i32: {
      std::int32_t i;
      std::memcpy(&i, &u, 4);
      return float(i);
    }
  }
  return 0.0f;
}

void Tensor::store(std::int64_t off, float v) {
  char* p = static_cast<char*>(data());
  switch (dtype_) {
    case DType::f16: {
      const std::uint16_t u = c::to_f16(v).bits;
      std::memcpy(p + off * 2, &u, 2);
      break;
    }
    case DType::bf16: {
      const std::uint16_t u = c::to_bf16(v).bits;
      std::memcpy(p + off * 2, &u, 2);
      break;
    }
    case DType::f8e4m3: p[off] = char(c::to_e4m3(v).bits); break;
    case DType::f32: std::memcpy(p + off * 4, &v, 4); break;
    case DType::i32: {
      const std::int32_t i = std::int32_t(v);
      std::memcpy(p + off * 4, &i, 4);
      break;
    }
  }
}

void Tensor::for_each_index(const std::function<void(const Index&)>& fn) const {
  if (numel() == 0) return;
  Index idx(shape_.size(), 0);
  if (shape_.empty()) {
    fn(idx);
    return;
  }
  while (true) {
    fn(idx);
    int d = ndim() - 1;
    while (d >= 0) {
      if (++idx[std::size_t(d)] < shape_[std::size_t(d)]) break;
      idx[std::size_t(d)] = 0;
      --d;
    }
    if (d < 0) return;
  }
}

void Tensor::fill_random(std::uint64_t seed, float lo, float hi) {
  std::uint64_t state = seed;
  // The smallest magnitude a value may have, so no element is exactly 0.
  const float floor = std::max(std::abs(hi - lo) / 1024.0f, 1e-3f);
  for_each_index([&](const Index& idx) {
    const double u = double(splitmix64(state) >> 11) * std::ldexp(1.0, -53);
    float x = round_to(dtype_, float(lo + (hi - lo) * u));
    if (std::abs(x) < floor) x = round_to(dtype_, x < 0 ? -floor : floor);
    if (x < lo || x > hi) x = round_to(dtype_, 0.5f * (lo + hi));  // (only for ranges near 0)
    if (x == 0.0f) x = round_to(dtype_, hi);
    set(idx, x);
  });
}

void Tensor::fill_poison() {
  if (!storage_) return;
  const std::size_t es = flashattn::dtype_size(dtype_);
  const std::uint32_t bits = poison_bits(dtype_);
  char* p = reinterpret_cast<char*>(storage_->words.data());
  for (std::size_t i = 0; i + es <= storage_->bytes; i += es) std::memcpy(p + i, &bits, es);
}

void Tensor::fill(float value) {
  for_each_index([&](const Index& idx) { set(idx, value); });
}

std::vector<float> Tensor::to_vector() const {
  std::vector<float> out;
  out.reserve(std::size_t(numel()));
  for_each_index([&](const Index& idx) { out.push_back(get(idx)); });
  return out;
}

std::int64_t Tensor::count_written_outside_view() const {
  if (!storage_ || !owns_buffer_) return 0;
  const std::size_t es = flashattn::dtype_size(dtype_);
  const std::int64_t total = std::int64_t(storage_->bytes / es);
  std::vector<bool> inside(std::size_t(total), false);
  for_each_index([&](const Index& idx) { inside[std::size_t(base_ + offset(idx))] = true; });
  const std::uint32_t poison = poison_bits(dtype_);
  std::int64_t written = 0;
  const char* p = reinterpret_cast<const char*>(storage_->words.data());
  for (std::int64_t e = 0; e < total; ++e) {
    if (inside[std::size_t(e)]) continue;
    std::uint32_t u = 0;
    std::memcpy(&u, p + e * std::int64_t(es), es);
    if (u != poison) ++written;
  }
  return written;
}

testing::AssertionResult bitwise_equal(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || a.shape() != b.shape()) {
    return testing::AssertionFailure() << "bitwise_equal: dtype or shape differs";
  }
  std::int64_t diffs = 0;
  std::string first;
  a.for_each_index([&](const Index& idx) {
    if (a.bits_at(a.offset(idx)) != b.bits_at(b.offset(idx))) {
      if (diffs++ == 0) {
        std::ostringstream os;
        os << "first at [";
        for (std::size_t i = 0; i < idx.size(); ++i) os << (i ? ", " : "") << idx[i];
        os << "]: " << std::setprecision(9) << a.get(idx) << " vs " << b.get(idx);
        first = os.str();
      }
    }
  });
  if (diffs == 0) return testing::AssertionSuccess();
  return testing::AssertionFailure() << diffs << " of " << a.numel() << " elements differ; "
                                     << first;
}

// --- problems -----------------------------------------------------------------------------------

std::string describe(const AttnConfig& cfg) {
  std::ostringstream os;
  os << flashattn::dtype_name(cfg.dtype);
  auto list = [&](const char* name, const std::vector<int>& v) {
    os << " " << name << "=[";
    for (std::size_t i = 0; i < v.size(); ++i) os << (i ? "," : "") << v[i];
    os << "]";
  };
  if (cfg.varlen_q.empty()) {
    os << " b=" << cfg.batch << " sq=" << cfg.seqlen_q << " sk=" << cfg.seqlen_k;
  } else {
    list("varlen_q", cfg.varlen_q);
    list("varlen_k", cfg.varlen_k);
    if (!cfg.seqused_k.empty()) list("seqused_k", cfg.seqused_k);
  }
  os << " h=" << cfg.heads << " hk=" << cfg.heads_k << " d=" << cfg.head_dim
     << " dv=" << (cfg.head_dim_v ? cfg.head_dim_v : cfg.head_dim);
  const auto& o = cfg.opt;
  if (o.causal) os << " causal";
  if (o.window_left >= 0 || o.window_right >= 0)
    os << " window=(" << o.window_left << "," << o.window_right << ")";
  if (o.softcap > 0) os << " softcap=" << o.softcap;
  if (o.softmax_scale != 0) os << " scale=" << o.softmax_scale;
  if (cfg.alibi == Alibi::per_head) os << " alibi(h)";
  if (cfg.alibi == Alibi::per_batch_head) os << " alibi(b,h)";
  if (o.dropout_p > 0) os << " dropout=" << o.dropout_p << " seed=" << o.dropout_seed;
  if (cfg.sinks) os << " sinks";
  static const char* const kLayouts[] = {"contiguous", "packed_qkv", "bhsd", "padded"};
  os << " layout=" << kLayouts[int(cfg.layout)];
  if (cfg.padded_outputs) os << " padded_outputs";
  if (cfg.qk_amplitude != 1.0f) os << " qk_amp=" << cfg.qk_amplitude;
  return os.str();
}

namespace {

// Gaps of the padded layout, in elements.
constexpr std::int64_t kHeadGap = 8, kRowGap = 24, kBatchGap = 40;

// A (b, s, h, w) tensor — or varlen (s, h, w) when b < 0 — in the given layout.
Tensor make_rows(DType dtype, std::int64_t b, std::int64_t s, std::int64_t h, std::int64_t w,
                 Layout layout) {
  const bool varlen = b < 0;
  switch (layout) {
    case Layout::bhsd:
      if (!varlen) {
        Tensor buf(dtype, {b, h, s, w});
        return buf.view(0, {b, s, h, w}, {h * s * w, w, s * w, 1});
      }
      break;  // varlen: (h, s, w) order
    case Layout::padded: {
      const std::int64_t hs = w + kHeadGap, rs = h * hs + kRowGap, bs = s * rs + kBatchGap;
      if (varlen) return Tensor::with_strides(dtype, {s, h, w}, {rs, hs, 1});
      return Tensor::with_strides(dtype, {b, s, h, w}, {bs, rs, hs, 1});
    }
    default: break;
  }
  if (varlen) {
    if (layout == Layout::bhsd) {
      Tensor buf(dtype, {h, s, w});
      return buf.view(0, {s, h, w}, {w, s * w, 1});
    }
    return Tensor(dtype, {s, h, w});
  }
  return Tensor(dtype, {b, s, h, w});
}

Tensor make_lse_like(const AttnProblem& p) {
  if (p.is_varlen()) return Tensor(DType::f32, {p.cfg.heads, p.total_q});
  return Tensor(DType::f32, {p.cfg.batch, p.cfg.heads, p.cfg.seqlen_q});
}

std::int64_t batch_dim(const AttnProblem& p) { return p.is_varlen() ? -1 : p.cfg.batch; }

}  // namespace

AttnProblem make_problem(const AttnConfig& cfg_in) {
  AttnProblem p;
  p.cfg = cfg_in;
  AttnConfig& cfg = p.cfg;
  if (cfg.seed == 0) cfg.seed = test_seed();
  p.head_dim_v = cfg.head_dim_v ? cfg.head_dim_v : cfg.head_dim;
  const int h = cfg.heads, hk = cfg.heads_k, d = cfg.head_dim, dv = p.head_dim_v;
  const bool varlen = !cfg.varlen_q.empty();
  if (varlen) {
    if (cfg.varlen_k.size() != cfg.varlen_q.size())
      throw std::runtime_error("make_problem: varlen_q and varlen_k differ in length");
    cfg.batch = int(cfg.varlen_q.size());
    std::vector<std::int32_t> cq{0}, ck{0};
    for (int s : cfg.varlen_q) cq.push_back(cq.back() + s);
    for (int s : cfg.varlen_k) ck.push_back(ck.back() + s);
    p.total_q = cq.back();
    p.total_k = ck.back();
    p.cu_seqlens_q = Tensor::from_i32(cq);
    p.cu_seqlens_k = Tensor::from_i32(ck);
    p.varlen.cu_seqlens_q = p.cu_seqlens_q.tv();
    p.varlen.cu_seqlens_k = p.cu_seqlens_k.tv();
    if (!cfg.seqused_k.empty()) {
      p.seqused_k = Tensor::from_i32(std::vector<std::int32_t>(cfg.seqused_k.begin(),
                                                               cfg.seqused_k.end()));
      p.varlen.seqused_k = p.seqused_k.tv();
    }
    p.varlen.max_seqlen_q = *std::max_element(cfg.varlen_q.begin(), cfg.varlen_q.end());
    p.varlen.max_seqlen_k = *std::max_element(cfg.varlen_k.begin(), cfg.varlen_k.end());
    cfg.seqlen_q = p.varlen.max_seqlen_q;
    cfg.seqlen_k = p.varlen.max_seqlen_k;
  } else {
    p.total_q = cfg.seqlen_q;
    p.total_k = cfg.seqlen_k;
  }
  const std::int64_t bd = varlen ? -1 : cfg.batch;

  if (cfg.layout == Layout::packed_qkv) {
    if (p.total_q != p.total_k || h != hk || d != dv || cfg.varlen_q != cfg.varlen_k)
      throw std::runtime_error("make_problem: packed_qkv needs sq == sk, h == hk, d == dv");
    const std::int64_t s = p.total_q;
    if (varlen) {
      p.qkv_buffer = Tensor(cfg.dtype, {s, 3, h, d});
      const Strides st{3 * h * d, d, 1};
      p.q = p.qkv_buffer.view(0, {s, h, d}, st);
      p.k = p.qkv_buffer.view(std::int64_t(h) * d, {s, h, d}, st);
      p.v = p.qkv_buffer.view(2 * std::int64_t(h) * d, {s, h, d}, st);
    } else {
      const std::int64_t b = cfg.batch;
      p.qkv_buffer = Tensor(cfg.dtype, {b, s, 3, h, d});
      const Strides st{s * 3 * h * d, 3 * h * d, d, 1};
      p.q = p.qkv_buffer.view(0, {b, s, h, d}, st);
      p.k = p.qkv_buffer.view(std::int64_t(h) * d, {b, s, h, d}, st);
      p.v = p.qkv_buffer.view(2 * std::int64_t(h) * d, {b, s, h, d}, st);
    }
    p.dout = make_rows(cfg.dtype, bd, p.total_q, h, dv, Layout::contiguous);
  } else {
    p.q = make_rows(cfg.dtype, bd, p.total_q, h, d, cfg.layout);
    p.k = make_rows(cfg.dtype, bd, p.total_k, hk, d, cfg.layout);
    p.v = make_rows(cfg.dtype, bd, p.total_k, hk, dv, cfg.layout);
    p.dout = make_rows(cfg.dtype, bd, p.total_q, h, dv, cfg.layout);
  }
  const float a = cfg.qk_amplitude;
  p.q.fill_random(mix(cfg.seed, 1), -a, a);
  p.k.fill_random(mix(cfg.seed, 2), -a, a);
  p.v.fill_random(mix(cfg.seed, 3), -1.0f, 1.0f);
  p.dout.fill_random(mix(cfg.seed, 4), -1.0f, 1.0f);

  p.opt = cfg.opt;
  if (cfg.alibi != Alibi::none) {
    p.alibi_slopes = cfg.alibi == Alibi::per_head ? Tensor(DType::f32, {h})
                                                  : Tensor(DType::f32, {cfg.batch, h});
    p.alibi_slopes.fill_random(mix(cfg.seed, 5), 0.01f, 0.5f);
    p.opt.alibi_slopes = p.alibi_slopes.tv();
  }
  if (cfg.sinks) {
    // Sinks of the size of a row's log-sum-exp (about log sk for these scores) and around it, so
    // that exp(s_h) competes with the keys' weight instead of vanishing beside it.
    const int keys = p.is_varlen() ? *std::max_element(cfg.varlen_k.begin(), cfg.varlen_k.end()) : cfg.seqlen_k;
    p.sinks = Tensor(DType::f32, {h});
    p.sinks.fill_random(mix(cfg.seed, 6), -2.0f, 2.0f + std::log1p(float(std::max(keys, 0))));
  }
  return p;
}

flashattn::ForwardInputs AttnProblem::forward_inputs() const {
  flashattn::ForwardInputs in;
  in.q = q.tv();
  in.k = k.tv();
  in.v = v.tv();
  in.varlen = varlen;
  if (sinks.defined()) in.sinks = sinks.tv();
  return in;
}

flashattn::BackwardInputs AttnProblem::backward_inputs(const ForwardResult& fwd) const {
  flashattn::BackwardInputs in;
  in.dout = dout.tv();
  in.q = q.tv();
  in.k = k.tv();
  in.v = v.tv();
  in.out = fwd.out.tv();
  in.lse = fwd.lse.tv();
  in.varlen = varlen;
  if (sinks.defined()) in.sinks = sinks.tv();
  return in;
}

ForwardResult make_forward_outputs(const AttnProblem& p) {
  const Layout lay = p.cfg.padded_outputs ? Layout::padded : Layout::contiguous;
  ForwardResult r;
  r.out = make_rows(p.cfg.dtype, batch_dim(p), p.total_q, p.cfg.heads, p.head_dim_v, lay);
  r.lse = make_lse_like(p);
  return r;
}

BackwardResult make_backward_outputs(const AttnProblem& p) {
  const Layout lay = p.cfg.padded_outputs ? Layout::padded : Layout::contiguous;
  const auto& cfg = p.cfg;
  BackwardResult r;
  r.dq = make_rows(cfg.dtype, batch_dim(p), p.total_q, cfg.heads, cfg.head_dim, lay);
  r.dk = make_rows(cfg.dtype, batch_dim(p), p.total_k, cfg.heads_k, cfg.head_dim, lay);
  r.dv = make_rows(cfg.dtype, batch_dim(p), p.total_k, cfg.heads_k, p.head_dim_v, lay);
  r.softmax_d = make_lse_like(p);
  if (cfg.sinks) r.dsinks = Tensor(DType::f32, {cfg.heads});
  return r;
}

ForwardResult run_forward(const AttnProblem& p, Backend backend, int num_threads) {
  ForwardResult r = make_forward_outputs(p);
  flashattn::Options opt = p.opt;
  opt.backend = backend;
  opt.num_threads = num_threads;
  const auto in = p.forward_inputs();
  const flashattn::ForwardOutputs outs{r.out.tv(), r.lse.tv()};
  std::vector<std::uint64_t> ws((flashattn::forward_workspace_size(in, opt) + 7) / 8 + 1);
  flashattn::forward(in, outs, opt, {ws.data(), ws.size() * 8});
  return r;
}

BackwardResult run_backward(const AttnProblem& p, const ForwardResult& fwd, Backend backend,
                            int num_threads) {
  BackwardResult r = make_backward_outputs(p);
  flashattn::Options opt = p.opt;
  opt.backend = backend;
  opt.num_threads = num_threads;
  const auto in = p.backward_inputs(fwd);
  flashattn::BackwardOutputs outs{r.dq.tv(), r.dk.tv(), r.dv.tv(), r.softmax_d.tv()};
  if (r.dsinks.defined()) outs.dsinks = r.dsinks.tv();
  std::vector<std::uint64_t> ws((flashattn::backward_workspace_size(in, opt) + 7) / 8 + 1);
  flashattn::backward(in, outs, opt, {ws.data(), ws.size() * 8});
  return r;
}

// --- the accuracy checker -----------------------------------------------------------------------

namespace {

struct Comparison {
  std::string name;
  std::int64_t checked = 0;
  double err_kernel = 0, err_naive = 0, max_ref = 0, bound = 0;
  std::int64_t kernel_nan = 0;       // NaN (incl. still-poisoned) where a value was due
  std::int64_t inf_mismatch = 0;     // ref ±inf but kernel not, or kernel inf where ref finite
  std::int64_t ref_bad = 0;          // the fp64 reference left the element unwritten / NaN
  std::int64_t naive_bad = 0;        // naive_lowprec NaN/inf where ref is not, or vice versa
  std::int64_t gap_writes = 0;       // writes outside the output view
  std::int64_t worst_off = -1;
  double worst_kernel = 0, worst_ref = 0;
  std::int64_t first_bad_off = -1;
  double first_bad_kernel = 0, first_bad_ref = 0;

  bool ok() const {
    return kernel_nan == 0 && inf_mismatch == 0 && ref_bad == 0 && naive_bad == 0 &&
           gap_writes == 0 && err_kernel <= bound;
  }
};

// Compares the kernel's tensor (loaded through `kernel`) against the fp64 sink `ref` and the
// naive tensor at the given element offsets.
Comparison compare(const std::string& name, const std::vector<std::int64_t>& offsets,
                   const Tensor& kernel, const std::vector<double>& ref, const Tensor& naive,
                   double u, double factor, double cancel_scale = 0) {
  Comparison cmp;
  cmp.name = name;
  auto note_bad = [&](std::int64_t off, double k, double r) {
    if (cmp.first_bad_off < 0) {
      cmp.first_bad_off = off;
      cmp.first_bad_kernel = k;
      cmp.first_bad_ref = r;
    }
  };
  for (std::int64_t off : offsets) {
    ++cmp.checked;
    const double r = ref[std::size_t(off)];
    const double k = kernel.load(off);
    const double n = naive.load(off);
    if (std::isnan(r)) {
      ++cmp.ref_bad;
      note_bad(off, k, r);
      continue;
    }
    if (std::isnan(k)) {
      ++cmp.kernel_nan;
      note_bad(off, k, r);
      continue;
    }
    if (std::isinf(r)) {
      if (k != r) {
        ++cmp.inf_mismatch;
        note_bad(off, k, r);
      }
      if (n != r) ++cmp.naive_bad;
      continue;
    }
    if (std::isinf(k)) {
      ++cmp.inf_mismatch;
      note_bad(off, k, r);
      continue;
    }
    if (!std::isfinite(n)) {
      ++cmp.naive_bad;
      continue;
    }
    const double ek = std::abs(k - r);
    if (ek > cmp.err_kernel) {
      cmp.err_kernel = ek;
      cmp.worst_off = off;
      cmp.worst_kernel = k;
      cmp.worst_ref = r;
    }
    cmp.err_naive = std::max(cmp.err_naive, std::abs(n - r));
    cmp.max_ref = std::max(cmp.max_ref, std::abs(r));
  }
  // rounding(ref): the rounding of the value, or of the terms that cancel to produce it when
  // that is larger (see cancellation_scale below).
  cmp.bound = factor * cmp.err_naive + 2.0 * std::max(cmp.max_ref, cancel_scale) * u;
  if (kernel.defined()) cmp.gap_writes = kernel.count_written_outside_view();
  return cmp;
}

std::string report(const std::vector<Comparison>& cmps, double factor, double u) {
  std::ostringstream os;
  os << std::setprecision(4) << std::scientific;
  os << "SPEC §7: max|kernel-ref| <= " << std::defaultfloat << factor << std::scientific
     << "*max|naive-ref| + 2*max|ref|*" << u << "\n";
  for (const auto& c : cmps) {
    os << "  " << std::left << std::setw(10) << c.name << (c.ok() ? " ok   " : " FAIL ")
       << "kernel_err=" << c.err_kernel << " naive_err=" << c.err_naive
       << " max|ref|=" << c.max_ref << " bound=" << c.bound << " (n=" << c.checked << ")";
    if (c.err_kernel > c.bound && c.worst_off >= 0)
      os << " worst@" << c.worst_off << ": kernel=" << c.worst_kernel << " ref=" << c.worst_ref;
    if (c.kernel_nan) os << " kernel_NaN_or_unwritten=" << c.kernel_nan;
    if (c.inf_mismatch) os << " inf_mismatch=" << c.inf_mismatch;
    if (c.ref_bad) os << " REFERENCE_unwritten_or_NaN=" << c.ref_bad;
    if (c.naive_bad) os << " NAIVE_nonfinite_mismatch=" << c.naive_bad;
    if (c.gap_writes) os << " writes_outside_view=" << c.gap_writes;
    if (c.first_bad_off >= 0)
      os << " first_bad@" << c.first_bad_off << ": kernel=" << c.first_bad_kernel
         << " ref=" << c.first_bad_ref;
    os << "\n";
  }
  return os.str();
}

bool verbose() {
  const char* v = std::getenv("FA_TEST_VERBOSE");
  return v && *v && *v != '0';
}

testing::AssertionResult verdict(const std::vector<Comparison>& cmps, double factor, double u,
                                 const AttnConfig& cfg) {
  bool ok = true;
  for (const auto& c : cmps) ok = ok && c.ok();
  const std::string text = describe(cfg) + "\n" + report(cmps, factor, u);
  if (verbose()) std::printf("%s", text.c_str());
  if (ok) return testing::AssertionSuccess();
  return testing::AssertionFailure() << text;
}

// Offsets (from the data pointer) of every element of a q-like tensor (q, out, dq) the SPEC
// defines: rows i < seqlen_q(b) of each sequence, all heads, `width` columns.
std::vector<std::int64_t> q_like_offsets(const c::AttentionParams& p, const c::RowHeadTensor& t,
                                         int heads, int width) {
  std::vector<std::int64_t> offs;
  for (int b = 0; b < p.batch; ++b)
    for (int i = 0; i < p.seqlen_q(b); ++i)
      for (int hh = 0; hh < heads; ++hh) {
        const std::int64_t o = p.q_offset(t, b, i, hh);
        for (int col = 0; col < width; ++col) offs.push_back(o + col);
      }
  return offs;
}

// Likewise for a k-like tensor (dk, dv): keys j < seqlen_k(b) (keys past seqused_k are left
// undefined by the SPEC and not compared).
std::vector<std::int64_t> k_like_offsets(const c::AttentionParams& p, const c::RowHeadTensor& t,
                                         int width) {
  std::vector<std::int64_t> offs;
  for (int b = 0; b < p.batch; ++b)
    for (int j = 0; j < p.seqlen_k(b); ++j)
      for (int hk = 0; hk < p.heads_k; ++hk) {
        const std::int64_t o = p.k_offset(t, b, j, hk);
        for (int col = 0; col < width; ++col) offs.push_back(o + col);
      }
  return offs;
}

std::vector<std::int64_t> lse_offsets(const c::AttentionParams& p) {
  std::vector<std::int64_t> offs;
  for (int b = 0; b < p.batch; ++b)
    for (int hh = 0; hh < p.heads; ++hh)
      for (int i = 0; i < p.seqlen_q(b); ++i) offs.push_back(p.lse_index(b, hh, i));
  return offs;
}

std::vector<double> nan_sink(std::int64_t n) {
  return std::vector<double>(std::size_t(std::max<std::int64_t>(n, 1)),
                             std::numeric_limits<double>::quiet_NaN());
}

double factor_of(const flashattn::Options& opt) { return opt.softcap > 0 ? 3.0 : 2.0; }

}  // namespace

// The relative rounding of a result: the storage dtype's unit roundoff, plus the fp32
// accumulation over the longest reduction (SPEC §2: products accumulate in fp32). The second
// term matters only for fp32 inputs, where the kernel's and naive_lowprec's summation orders
// differ and both errors are of the size of fp32 accumulation itself.
double rounding_unit(const AttnProblem& p, const c::AttentionParams& params) {
  constexpr double kFp32Unit = 5.9604644775390625e-08;  // 2^-24
  const double longest = std::max({double(params.max_seqlen_k),
                                   double(params.max_seqlen_q) * params.group_size(),
                                   double(params.head_dim), double(params.head_dim_v)});
  return unit_roundoff(p.cfg.dtype) + longest * kFp32Unit;
}

// The size of the terms that cancel inside dq and dk: dS_ij = P_ij·(dP_ij − D_i), and when a row
// sees one key (P ≡ 1) the exact gradient is 0 while dP_ij and D_i are of size |D|. SPEC §7's
// rounding(ref) is then read as the rounding of those terms, u·scale·max|D|·max|k or q|; otherwise
// a bound of 0 would demand that every kernel cancel exactly, which no fp32 summation order
// guarantees.
double cancellation_scale(const std::vector<double>& ref_d, const Tensor& operand, double softmax_scale) {
  double max_d = 0;
  for (double x : ref_d) {
    if (std::isfinite(x)) max_d = std::max(max_d, std::abs(x));
  }
  double max_x = 0;
  for (std::int64_t off = 0; off < operand.span(); ++off) {
    const double x = operand.load(off);
    if (std::isfinite(x)) max_x = std::max(max_x, std::abs(x));
  }
  return softmax_scale * max_d * max_x;
}

testing::AssertionResult check_forward(const AttnProblem& p, const ForwardResult& fwd) {
  if (fwd.not_run) return testing::AssertionSuccess() << "not run (skip recorded)";
  const flashattn::ForwardOutputs outs{fwd.out.tv(), fwd.lse.tv()};
  flashattn::detail::Problem prob;
  try {
    prob = flashattn::detail::validate_forward(p.forward_inputs(), outs, p.opt);
  } catch (const std::exception& e) {
    return testing::AssertionFailure() << "check_forward: validate_forward threw: " << e.what();
  }
  const c::AttentionParams& params = prob.params;

  // The fp64 oracle, writing into the sink; its own output pointers aim at scratch copies so a
  // reference that ignores the sink cannot touch the kernel's results.
  Tensor scratch_out = Tensor::empty_like(fwd.out), scratch_lse = Tensor::empty_like(fwd.lse);
  std::vector<double> ref_out = nan_sink(fwd.out.span()), ref_lse = nan_sink(fwd.lse.span());
  c::AttentionParams p64 = params;
  p64.out.data = scratch_out.data();
  p64.lse = static_cast<float*>(scratch_lse.data());
  flashattn::cpu::Fp64Outputs sink;
  sink.out = ref_out.data();
  sink.lse = ref_lse.data();
  flashattn::cpu::reference_forward(p64, flashattn::cpu::RefPrecision::fp64, &sink, reference_threads());

  // naive_lowprec into outputs laid out like the kernel's.
  Tensor naive_out = Tensor::empty_like(fwd.out), naive_lse = Tensor::empty_like(fwd.lse);
  c::AttentionParams pn = params;
  pn.out.data = naive_out.data();
  pn.lse = static_cast<float*>(naive_lse.data());
  flashattn::cpu::reference_forward(pn, flashattn::cpu::RefPrecision::emulate_storage, nullptr, reference_threads());

  const double u = rounding_unit(p, params), f = factor_of(p.opt);
  std::vector<Comparison> cmps;
  cmps.push_back(compare("out", q_like_offsets(params, params.out, params.heads, params.head_dim_v),
                         fwd.out, ref_out, naive_out, u, f));
  if (p.opt.return_lse)
    cmps.push_back(compare("lse", lse_offsets(params), fwd.lse, ref_lse, naive_lse, u, f));
  return verdict(cmps, f, u, p.cfg);
}

testing::AssertionResult check_backward(const AttnProblem& p, const ForwardResult& fwd,
                                        const BackwardResult& bwd) {
  if (fwd.not_run || bwd.not_run) return testing::AssertionSuccess() << "not run (skip recorded)";
  flashattn::BackwardOutputs outs{bwd.dq.tv(), bwd.dk.tv(), bwd.dv.tv(), bwd.softmax_d.tv()};
  if (bwd.dsinks.defined()) outs.dsinks = bwd.dsinks.tv();
  flashattn::detail::Problem prob;
  try {
    prob = flashattn::detail::validate_backward(p.backward_inputs(fwd), outs, p.opt);
  } catch (const std::exception& e) {
    return testing::AssertionFailure() << "check_backward: validate_backward threw: " << e.what();
  }
  const c::AttentionParams& params = prob.params;

  Tensor s_dq = Tensor::empty_like(bwd.dq), s_dk = Tensor::empty_like(bwd.dk),
         s_dv = Tensor::empty_like(bwd.dv), s_d = Tensor::empty_like(bwd.softmax_d);
  std::vector<double> ref_dq = nan_sink(bwd.dq.span()), ref_dk = nan_sink(bwd.dk.span()),
                      ref_dv = nan_sink(bwd.dv.span()), ref_d = nan_sink(bwd.softmax_d.span());
  c::AttentionParams p64 = params;
  p64.dq.data = s_dq.data();
  p64.dk.data = s_dk.data();
  p64.dv.data = s_dv.data();
  p64.softmax_d = static_cast<float*>(s_d.data());
  flashattn::cpu::Fp64Outputs sink;
  sink.dq = ref_dq.data();
  sink.dk = ref_dk.data();
  sink.dv = ref_dv.data();
  sink.softmax_d = ref_d.data();
  Tensor s_ds, n_ds;
  std::vector<double> ref_ds = nan_sink(bwd.dsinks.defined() ? bwd.dsinks.span() : 0);
  if (bwd.dsinks.defined()) {
    s_ds = Tensor::empty_like(bwd.dsinks);
    n_ds = Tensor::empty_like(bwd.dsinks);
    p64.dsinks = static_cast<float*>(s_ds.data());
    sink.dsinks = ref_ds.data();
  }
  flashattn::cpu::reference_backward(p64, flashattn::cpu::RefPrecision::fp64, &sink, reference_threads());

  Tensor n_dq = Tensor::empty_like(bwd.dq), n_dk = Tensor::empty_like(bwd.dk),
         n_dv = Tensor::empty_like(bwd.dv), n_d = Tensor::empty_like(bwd.softmax_d);
  c::AttentionParams pn = params;
  pn.dq.data = n_dq.data();
  pn.dk.data = n_dk.data();
  pn.dv.data = n_dv.data();
  pn.softmax_d = static_cast<float*>(n_d.data());
  if (bwd.dsinks.defined()) pn.dsinks = static_cast<float*>(n_ds.data());
  flashattn::cpu::reference_backward(pn, flashattn::cpu::RefPrecision::emulate_storage, nullptr, reference_threads());

  const double u = rounding_unit(p, params), f = factor_of(p.opt);
  std::vector<Comparison> cmps;
  cmps.push_back(compare("dq", q_like_offsets(params, params.dq, params.heads, params.head_dim),
                         bwd.dq, ref_dq, n_dq, u, f,
                         cancellation_scale(ref_d, p.k, params.softmax_scale)));
  cmps.push_back(compare("dk", k_like_offsets(params, params.dk, params.head_dim), bwd.dk, ref_dk,
                         n_dk, u, f, cancellation_scale(ref_d, p.q, params.softmax_scale)));
  cmps.push_back(compare("dv", k_like_offsets(params, params.dv, params.head_dim_v), bwd.dv,
                         ref_dv, n_dv, u, f));
  cmps.push_back(compare("softmax_d", lse_offsets(params), bwd.softmax_d, ref_d, n_d, u, f));
  if (bwd.dsinks.defined()) {
    // dsinks_h sums exp(s_h − lse_i) · D_i over every row of the head, terms of both signs: its
    // rounding is that of the partial sums, at most Σ|terms| (taken from the kernel's lse), with
    // the relative rounding each D_i carries (u, as for softmax_d) and that of the fp32 reduction
    // over all rows.
    const std::vector<std::int64_t> rows = lse_offsets(params);
    double terms = 0;
    for (int hh = 0; hh < params.heads; ++hh) {
      double abs_sum = 0;
      for (int b = 0; b < params.batch; ++b)
        for (int i = 0; i < params.seqlen_q(b); ++i) {
          const std::int64_t li = params.lse_index(b, hh, i);
          const double weight = std::exp(double(p.sinks.load(hh)) - double(fwd.lse.load(li)));
          const double w = weight * std::abs(ref_d[std::size_t(li)]);
          if (std::isfinite(w)) abs_sum += w;
        }
      terms = std::max(terms, abs_sum);
    }
    const double u_sum = u + double(rows.size()) / params.heads * 5.9604644775390625e-08;
    std::vector<std::int64_t> heads(std::size_t(params.heads));
    for (int hh = 0; hh < params.heads; ++hh) heads[std::size_t(hh)] = hh;
    cmps.push_back(compare("dsinks", heads, bwd.dsinks, ref_ds, n_ds, u_sum, f, terms));
  }
  return verdict(cmps, f, u, p.cfg);
}

}  // namespace fa_test
