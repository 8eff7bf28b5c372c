// tests/cpp/test_fuzz.cpp — randomized calls of the public API (forward, backward, forward with KV
// cache) on both CPU backends. Each iteration draws shapes (b 0..3, seqlens 0..70, heads with
// valid and invalid ratios, head dims incl. invalid ones), layouts (padding, packed qkv, (b,h,s,d)
// order, now and then a non-unit last stride), dtypes (incl. i32), options (causal, windows incl.
// −2, softcap incl. negative, ALiBi incl. wrong shapes, dropout incl. 1.0), varlen (sometimes with
// corrupt cu_seqlens) and KV caches (dense, indexed, paged; appends, rotary; sometimes corrupt).
//
// The generator knows which arguments it made invalid. Every call must then either
//   - throw flashattn::Error naming one of those arguments, leaving every output (and the KV
//     caches) bit for bit untouched, when the generator broke something, or
//   - succeed when it did not, match the fp64 reference within SPEC §7 (fa_test::check_forward /
//     check_backward), write nothing outside the output views and leave the inputs untouched.
// Every tensor lives in a buffer that ends exactly where the view ends, so AddressSanitizer (the
// asan preset, CI) catches reads and writes past a view; the gaps and the bytes before a view hold
// NaN poison, so stray reads show up as NaN and stray writes as changed poison.
//
// FLASHATTN_FUZZ_SEED (decimal or 0x-hex) and FLASHATTN_FUZZ_ITERS override the defaults;
// FLASHATTN_FUZZ_FIRST starts at a later iteration (each iteration is reproducible on its own:
// a failure prints the three values that replay it alone).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "test_util.h"

namespace fa_test {
namespace {

namespace fa = flashattn;

constexpr std::uint64_t kDefaultSeed = 0xF1A5A77E57ull;
constexpr int kDefaultIters = 1500;  // ~6 s Release, ~35 s ASan+UBSan on 2 shared cores

std::uint64_t env_u64(const char* name, std::uint64_t fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  return std::strtoull(v, nullptr, 0);
}

// --- randomness ---------------------------------------------------------------------------------

class Rng {
 public:
  explicit Rng(std::uint64_t seed) : s_(seed) {}
  std::uint64_t next() {
    std::uint64_t z = (s_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double unit() { return double(next() >> 11) * (1.0 / 9007199254740992.0); }
  int range(int lo, int hi) { return hi <= lo ? lo : lo + int(next() % std::uint64_t(hi - lo + 1)); }
  bool chance(double p) { return unit() < p; }
  float real(float lo, float hi) { return float(lo + (hi - lo) * unit()); }
  template <class T>
  T pick(std::initializer_list<T> xs) {
    return *(xs.begin() + range(0, int(xs.size()) - 1));
  }
  template <class T>
  void shuffle(std::vector<T>& v) {
    for (std::size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[std::size_t(range(0, int(i) - 1))]);
  }

 private:
  std::uint64_t s_;
};

// --- buffers that end exactly where their view ends ---------------------------------------------

std::int64_t span_of(const Shape& shape, const Strides& strides) {
  std::int64_t last = 0;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == 0) return 0;
    last += (shape[i] - 1) * strides[i];
  }
  return last + 1;
}

// A 1-D poisoned owner and a view placed so that its last element is the last element of the
// allocation (std::vector<uint64_t> storage: sizes are padded to 8 bytes, so the owner's element
// count is rounded up and the view shifted by the remainder). Copies share storage.
struct Buf {
  Tensor owner;
  Tensor view;
  std::int64_t offset = 0;
  bool null_data = false;  // an empty view passed with data == nullptr (allowed)

  bool defined() const { return view.defined(); }
  fa::TensorView tv() const {
    fa::TensorView t = view.tv();
    if (null_data) t.data = nullptr;
    return t;
  }
  // A sub-view at `extra` elements past this view's start (packed qkv).
  Tensor sub(std::int64_t extra, Shape shape, Strides strides) const {
    return owner.view(offset + extra, std::move(shape), std::move(strides));
  }
  std::vector<unsigned char> bytes() const {
    if (!owner.defined()) return {};
    const auto* p = static_cast<const unsigned char*>(owner.data());
    return std::vector<unsigned char>(p, p + owner.numel() * std::int64_t(fa::dtype_size(owner.dtype())));
  }
};

Buf make_buf(DType dtype, const Shape& shape, const Strides& strides, Rng* rng = nullptr) {
  Buf b;
  const std::int64_t span = span_of(shape, strides);
  const std::int64_t per_word = 8 / std::int64_t(fa::dtype_size(dtype));
  const std::int64_t n = std::max<std::int64_t>((span + per_word - 1) / per_word * per_word, per_word);
  b.owner = Tensor(dtype, {n});
  b.offset = span == 0 ? 0 : n - span;
  b.view = b.owner.view(b.offset, shape, strides);
  if (span == 0 && rng && rng->chance(0.5)) b.null_data = true;
  return b;
}

Strides contiguous_strides(const Shape& shape) {
  Strides s(shape.size());
  std::int64_t st = 1;
  for (int i = int(shape.size()) - 1; i >= 0; --i) {
    s[std::size_t(i)] = st;
    st *= shape[std::size_t(i)];
  }
  return s;
}

Buf make_contiguous(DType dtype, const Shape& shape, Rng* rng = nullptr) {
  return make_buf(dtype, shape, contiguous_strides(shape), rng);
}

Buf make_i32(const std::vector<std::int32_t>& values) {
  Buf b = make_contiguous(DType::i32, {std::int64_t(values.size())});
  for (std::size_t i = 0; i < values.size(); ++i) b.view.set({std::int64_t(i)}, float(values[i]));
  return b;
}

// Elements of the owner outside the logical view that no longer hold the poison pattern.
std::int64_t writes_outside(const Buf& b) {
  if (!b.owner.defined()) return 0;
  const std::int64_t n = b.owner.numel();
  std::vector<bool> inside(std::size_t(n), false);
  b.view.for_each_index([&](const Index& idx) { inside[std::size_t(b.offset + b.view.offset(idx))] = true; });
  const std::uint32_t poison = poison_bits(b.owner.dtype());
  std::int64_t written = 0;
  for (std::int64_t e = 0; e < n; ++e) {
    if (!inside[std::size_t(e)] && b.owner.bits_at(e) != poison) ++written;
  }
  return written;
}

// Memory layouts of a (b, s, h, w) tensor (or varlen (s, h, w)).
enum class Lay { contiguous, padded, bhsd, strided_last };
const char* lay_name(Lay l) {
  switch (l) {
    case Lay::contiguous: return "contiguous";
    case Lay::padded: return "padded";
    case Lay::bhsd: return "bhsd";
    case Lay::strided_last: return "last-stride-2";
  }
  return "?";
}

Buf make_rows(DType dtype, bool varlen, std::int64_t b, std::int64_t s, std::int64_t h, std::int64_t w, Lay lay,
              Rng& rng) {
  Shape shape = varlen ? Shape{s, h, w} : Shape{b, s, h, w};
  Strides st;
  switch (lay) {
    case Lay::contiguous: st = contiguous_strides(shape); break;
    case Lay::padded: {
      const std::int64_t hs = w + rng.range(0, 9), rs = h * hs + rng.range(0, 13), bs = s * rs + rng.range(0, 21);
      st = varlen ? Strides{rs, hs, 1} : Strides{bs, rs, hs, 1};
      break;
    }
    case Lay::bhsd:
      st = varlen ? Strides{w, s * w, 1} : Strides{h * s * w, w, s * w, 1};
      break;
    case Lay::strided_last: {
      st = contiguous_strides(shape);
      for (auto& x : st) x *= 2;
      break;
    }
  }
  return make_buf(dtype, shape, st, &rng);
}

// --- the generated call -------------------------------------------------------------------------

enum class Dir { fwd, bwd, kv };
const char* dir_name(Dir d) { return d == Dir::fwd ? "forward" : d == Dir::bwd ? "backward" : "forward_kvcache"; }
const char* api_of(Dir d) {
  return d == Dir::fwd ? "flashattn::forward" : d == Dir::bwd ? "flashattn::backward" : "flashattn::forward_kvcache";
}

struct Stats {
  int accepted[3] = {0, 0, 0};
  int rejected[3] = {0, 0, 0};
  std::map<std::string, int> rejected_by;  // argument named by the error
  int total_accepted() const { return accepted[0] + accepted[1] + accepted[2]; }
  int total_rejected() const { return rejected[0] + rejected[1] + rejected[2]; }
};

// What one iteration built: the description, the arguments it broke, and the buffers to watch.
struct Call {
  Dir dir = Dir::fwd;
  std::ostringstream desc;
  std::set<std::string> bad;      // arguments the generator made invalid (the error must name one)
  std::vector<Buf> outputs;       // must stay untouched when rejected; no writes outside the views
  std::vector<Buf> inputs;        // must stay untouched, always
  std::vector<Buf> caches;        // KV caches: untouched when rejected
  void broke(const std::string& arg, const std::string& how) {
    bad.insert(arg);
    desc << " !" << arg << "(" << how << ")";
  }
};

struct Snap {
  std::vector<std::vector<unsigned char>> bytes;
  explicit Snap(const std::vector<Buf>& bufs) {
    for (const Buf& b : bufs) bytes.push_back(b.bytes());
  }
  // Index of the first buffer that changed, or -1.
  int changed(const std::vector<Buf>& bufs) const {
    for (std::size_t i = 0; i < bufs.size(); ++i)
      if (bufs[i].bytes() != bytes[i]) return int(i);
    return -1;
  }
};

// Runs `call`; checks the verdict against what the generator broke. Returns true when it ran.
template <class F>
bool run_checked(Call& c, Stats& stats, F&& call) {
  const Snap out_snap(c.outputs), in_snap(c.inputs), cache_snap(c.caches);
  std::string error;
  bool threw = false;
  try {
    call();
  } catch (const fa::Error& e) {
    threw = true;
    error = e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw an exception that is not flashattn::Error: " << e.what();
    return false;
  }
  const int d = int(c.dir);
  if (threw) {
    ++stats.rejected[d];
    const std::string api = std::string(api_of(c.dir)) + ": ";
    std::string named = "?";
    if (error.compare(0, api.size(), api) == 0) {
      const std::size_t end = error.find(": ", api.size());
      if (end != std::string::npos) named = error.substr(api.size(), end - api.size());
    }
    ++stats.rejected_by[named];
    if (c.bad.empty()) {
      ADD_FAILURE() << "a valid call was rejected: " << error;
    } else if (!c.bad.count(named)) {
      std::string list;
      for (const auto& b : c.bad) list += " " + b;
      ADD_FAILURE() << "the error names \"" << named << "\", but the generator broke:" << list << "\n  error: " << error;
    }
    if (error.find("; expected ") == std::string::npos || error.find(", got ") == std::string::npos) {
      ADD_FAILURE() << "the message lacks \"; expected <x>, got <y>\": " << error;
    }
    int i = out_snap.changed(c.outputs);
    EXPECT_EQ(i, -1) << "a rejected call wrote into output #" << i;
    i = cache_snap.changed(c.caches);
    EXPECT_EQ(i, -1) << "a rejected call wrote into KV cache #" << i;
    i = in_snap.changed(c.inputs);
    EXPECT_EQ(i, -1) << "a rejected call wrote into input #" << i;
    return false;
  }
  ++stats.accepted[d];
  if (!c.bad.empty()) {
    std::string list;
    for (const auto& b : c.bad) list += " " + b;
    ADD_FAILURE() << "an invalid call was accepted; the generator broke:" << list;
  }
  const int i = in_snap.changed(c.inputs);
  EXPECT_EQ(i, -1) << "the call wrote into input #" << i;
  for (std::size_t o = 0; o < c.outputs.size(); ++o) {
    EXPECT_EQ(writes_outside(c.outputs[o]), 0) << "writes outside the view of output #" << o;
  }
  return true;
}

// --- draws --------------------------------------------------------------------------------------

int draw_len(Rng& r) {
  const double u = r.unit();
  if (u < 0.08) return 0;
  if (u < 0.18) return 1;
  if (u < 0.26) return r.pick({63, 64, 65, 70});
  if (u < 0.62) return r.range(2, 17);
  return r.range(2, 70);
}

int draw_dim(Rng& r, double p_bad, bool* bad) {
  if (r.chance(p_bad)) {
    *bad = true;
    return r.pick({12, 4, 264, 20, 0, 257, 36});
  }
  const double u = r.unit();
  if (u < 0.5) return r.pick({8, 16, 24, 32});
  if (u < 0.85) return r.pick({40, 48, 64, 72, 80, 96});
  return r.pick({128, 160, 192, 256});
}

DType draw_dtype(Rng& r, Call& c) {
  const double u = r.unit();
  if (u < 0.025) {
    c.broke("q", "i32");
    return DType::i32;
  }
  if (u < 0.42) return DType::f16;
  if (u < 0.78) return DType::bf16;
  return DType::f32;
}

void draw_heads(Rng& r, Call& c, int* h, int* hk, const char* hk_arg) {
  *h = r.pick({1, 2, 3, 4, 6, 8});
  if (r.chance(0.04)) {
    do {
      *hk = r.range(2, 8);
    } while (*h % *hk == 0);
    c.broke(hk_arg, "h % hk != 0");
    return;
  }
  std::vector<int> divs;
  for (int x = 1; x <= *h; ++x)
    if (*h % x == 0) divs.push_back(x);
  *hk = divs[std::size_t(r.range(0, int(divs.size()) - 1))];
}

// Options shared by all directions; alibi shapes are drawn by the caller (they need b and h).
fa::Options draw_options(Rng& r, Call& c) {
  fa::Options o;
  o.causal = r.chance(0.3);
  auto window = [&](const char* arg) {
    const double u = r.unit();
    if (u < 0.025) {
      const int w = r.pick({-2, -3, -100});
      c.broke(arg, std::to_string(w));
      return w;
    }
    if (u < 0.72) return -1;
    return r.chance(0.3) ? r.range(0, 4) : r.range(0, 80);
  };
  o.window_left = window("options.window_left");
  o.window_right = window("options.window_right");
  const double sc = r.unit();
  if (sc < 0.02) {
    o.softcap = r.pick({-1.0f, -0.01f, std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()});
    c.broke("options.softcap", std::to_string(o.softcap));
  } else if (sc < 0.25) {
    o.softcap = r.real(0.3f, 8.0f);
  }
  const double ss = r.unit();
  if (ss < 0.02) {
    o.softmax_scale = r.pick({-0.1f, std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()});
    c.broke("options.softmax_scale", std::to_string(o.softmax_scale));
  } else if (ss < 0.2) {
    o.softmax_scale = r.real(0.01f, 0.6f);
  }
  const double dp = r.unit();
  if (dp < 0.02) {
    o.dropout_p = r.pick({1.0f, 1.5f, -0.1f, std::numeric_limits<float>::quiet_NaN()});
    c.broke("options.dropout_p", std::to_string(o.dropout_p));
  } else if (dp < 0.2) {
    o.dropout_p = r.real(0.05f, 0.9f);
  }
  o.dropout_seed = r.next();
  o.dropout_offset = r.next() >> r.range(0, 63);
  if (r.chance(0.01)) {
    o.num_threads = -1;
    c.broke("options.num_threads", "-1");
  } else {
    o.num_threads = r.range(0, 3);
  }
  o.deterministic = r.chance(0.3);
  o.backend = r.chance(0.65) ? Backend::cpu : Backend::cpu_reference;
  c.desc << " backend=" << fa::backend_name(o.backend) << " threads=" << o.num_threads;
  if (o.causal) c.desc << " causal";
  if (o.window_left != -1 || o.window_right != -1) c.desc << " window=(" << o.window_left << "," << o.window_right << ")";
  if (o.softcap != 0) c.desc << " softcap=" << o.softcap;
  if (o.softmax_scale != 0) c.desc << " scale=" << o.softmax_scale;
  if (o.dropout_p != 0) c.desc << " dropout=" << o.dropout_p;
  return o;
}

// ALiBi slopes: (h), (b, h), or (sometimes) a wrong shape.
Buf draw_alibi(Rng& r, Call& c, int b, int h, Alibi* kind) {
  const double u = r.unit();
  *kind = Alibi::none;
  if (u < 0.7) return {};
  Shape shape;
  if (u < 0.84) {
    shape = {h};
    *kind = Alibi::per_head;
  } else if (u < 0.96) {
    shape = {b, h};
    *kind = Alibi::per_batch_head;
  } else {  // 4 %
    shape = r.pick({Shape{h + 1}, Shape{b + 1, h}, Shape{b, h + 1}, Shape{1, b, h}});
    c.broke("alibi_slopes", fa::shape_string(Tensor(DType::f32, shape).tv()));
  }
  Buf a = make_contiguous(DType::f32, shape);
  a.view.fill_random(r.next(), 0.01f, 1.0f);
  c.desc << " alibi" << fa::shape_string(a.view.tv());
  return a;
}

// Attention sinks (docs/sinks.md): none (75 %), (h) fp32 in [−2, 4], or (sometimes) a wrong shape.
// Drawn from `sr`, a generator of their own, so that the rest of an iteration's call is what it
// was before sinks existed (the replays below keep their cases); off while fuzz_sinks is false.
bool fuzz_sinks = true;
Buf draw_sinks(Rng& sr, Call& c, int h) {
  if (!fuzz_sinks || sr.unit() < 0.75) return {};
  Shape shape{h};
  if (sr.chance(0.06)) {
    shape = sr.pick({Shape{h + 1}, Shape{1, h}});
    c.broke("sinks", fa::shape_string(Tensor(DType::f32, shape).tv()));
  }
  Buf s = make_contiguous(DType::f32, shape);
  s.view.fill_random(sr.next(), -2.0f, 4.0f);
  c.desc << " sinks" << fa::shape_string(s.view.tv());
  return s;
}

// Shrinks the lengths until the reference's work (Σ sq·sk·h·(d+dv)) fits the budget.
void fit_budget(std::vector<int>& lq, std::vector<int>& lk, int h, int d, int dv, double budget) {
  for (int guard = 0; guard < 12; ++guard) {
    double cost = 0;
    for (std::size_t i = 0; i < lq.size(); ++i) cost += double(lq[i]) * double(std::max(lk[i], 1)) * h * (d + dv + 8);
    if (cost <= budget) return;
    for (int& x : lq) x /= 2;
    for (int& x : lk) x /= 2;
  }
}

// ================================================================================================
// forward / backward
// ================================================================================================

void fuzz_attention(Rng& r, Dir dir, Stats& stats) {
  Call c;
  c.dir = dir;
  Rng peek = r;  // a copy: r itself does not advance
  Rng sinks_rng(peek.next() ^ 0x6A09E667F3BCC909ull);
  const DType dtype = draw_dtype(r, c);
  const bool varlen = r.chance(0.3);
  const int b = r.chance(0.025) ? 0 : r.range(1, 3);
  if (b == 0) c.broke(varlen ? "varlen.cu_seqlens_q" : "q", "b = 0");
  int h = 0, hk = 0;
  draw_heads(r, c, &h, &hk, "k");
  bool bad_d = false, bad_dv = false;
  const int d = draw_dim(r, 0.03, &bad_d);
  const int dv = r.chance(0.65) ? d : draw_dim(r, 0.03, &bad_dv);
  if (bad_d) c.broke("q", "d=" + std::to_string(d));
  if (bad_dv) c.broke("v", "dv=" + std::to_string(dv));
  std::vector<int> lq(std::size_t(std::max(b, varlen ? b : 1))), lk(lq.size());
  const bool same_lengths = r.chance(0.3);
  for (std::size_t i = 0; i < lq.size(); ++i) {
    lq[i] = draw_len(r);
    lk[i] = same_lengths ? lq[i] : draw_len(r);
  }
  if (!varlen) {  // one length for all sequences
    for (std::size_t i = 1; i < lq.size(); ++i) lq[i] = lq[0], lk[i] = lk[0];
  }
  fit_budget(lq, lk, h, std::max(d, 8), std::max(dv, 8), dir == Dir::bwd ? 1.5e6 : 4e6);
  const int sq = lq.empty() ? 0 : *std::max_element(lq.begin(), lq.end());
  const int sk = lk.empty() ? 0 : *std::max_element(lk.begin(), lk.end());
  std::int64_t total_q = 0, total_k = 0;
  for (std::size_t i = 0; i < lq.size() && i < std::size_t(b); ++i) total_q += lq[i], total_k += lk[i];
  if (b == 0) total_q = total_k = 0;

  fa::Options opt = draw_options(r, c);
  if (dir == Dir::bwd) opt.return_lse = true;
  else if (r.chance(0.12)) opt.return_lse = false;

  c.desc << " " << fa::dtype_name(dtype) << (varlen ? " varlen" : " dense") << " b=" << b << " h=" << h << " hk=" << hk
         << " d=" << d << " dv=" << dv;
  if (varlen) {
    c.desc << " lq=[";
    for (int i = 0; i < b; ++i) c.desc << (i ? "," : "") << lq[std::size_t(i)];
    c.desc << "] lk=[";
    for (int i = 0; i < b; ++i) c.desc << (i ? "," : "") << lk[std::size_t(i)];
    c.desc << "]";
  } else {
    c.desc << " sq=" << sq << " sk=" << sk;
  }

  // --- inputs -------------------------------------------------------------------------------
  const bool packable = h == hk && d == dv && total_q == total_k && lq == lk;
  Lay lay = Lay::contiguous;
  const double lu = r.unit();
  if (lu < 0.18 && packable) {
    lay = Lay::contiguous;  // packed below
  } else if (lu < 0.45) {
    lay = Lay::padded;
  } else if (lu < 0.6) {
    lay = Lay::bhsd;
  }
  const bool packed = lu < 0.18 && packable;
  const std::int64_t rows_q = varlen ? total_q : sq, rows_k = varlen ? total_k : sk;
  Buf q, k, v, qkv;
  if (packed) {
    const Shape shape5 = varlen ? Shape{rows_q, 3, h, d} : Shape{b, rows_q, 3, h, d};
    qkv = make_contiguous(dtype, shape5);
    const Strides st = varlen ? Strides{3 * h * d, d, 1} : Strides{rows_q * 3 * h * d, 3 * h * d, d, 1};
    const Shape shape = varlen ? Shape{rows_q, h, d} : Shape{b, rows_q, h, d};
    q = qkv, k = qkv, v = qkv;
    q.view = qkv.sub(0, shape, st);
    k.view = qkv.sub(std::int64_t(h) * d, shape, st);
    v.view = qkv.sub(2 * std::int64_t(h) * d, shape, st);
    q.offset = qkv.offset;
    k.offset = qkv.offset + std::int64_t(h) * d;
    v.offset = qkv.offset + 2 * std::int64_t(h) * d;
    c.desc << " packed_qkv";
  } else {
    auto lay_of = [&](const char* arg, int width) {
      if (width > 1 && r.chance(0.025)) {
        c.broke(arg, "last stride 2");
        return Lay::strided_last;
      }
      return lay;
    };
    const Lay lq_ = lay_of("q", d), lk_ = lay_of("k", d), lv_ = lay_of("v", dv);
    q = make_rows(dtype, varlen, b, rows_q, h, d, lq_, r);
    k = make_rows(dtype, varlen, b, rows_k, hk, d, lk_, r);
    v = make_rows(dtype, varlen, b, rows_k, hk, dv, lv_, r);
    c.desc << " layout=" << lay_name(lay);
  }
  if (dtype != DType::i32) {
    const float amp = r.pick({0.5f, 1.0f, 1.0f, 2.0f, 3.0f});
    q.view.fill_random(r.next(), -amp, amp);
    k.view.fill_random(r.next(), -amp, amp);
    v.view.fill_random(r.next(), -1.0f, 1.0f);
  }
  Alibi alibi_kind = Alibi::none;
  const Buf alibi = draw_alibi(r, c, b, h, &alibi_kind);
  if (alibi.defined()) opt.alibi_slopes = alibi.tv();
  std::array<std::uint64_t, 2> rng_state = {r.next(), r.next()};
  if (opt.dropout_p > 0 && r.chance(0.3)) opt.dropout_rng_state = rng_state.data();

  // --- varlen index tensors -------------------------------------------------------------------
  fa::Varlen vl;
  Buf cu_q, cu_k, used;
  std::vector<int> seqused;
  if (varlen) {
    std::vector<std::int32_t> cq{0}, ck{0};
    for (int i = 0; i < b; ++i) {
      cq.push_back(cq.back() + lq[std::size_t(i)]);
      ck.push_back(ck.back() + lk[std::size_t(i)]);
    }
    vl.max_seqlen_q = sq + (r.chance(0.2) ? r.range(1, 5) : 0);
    vl.max_seqlen_k = sk + (r.chance(0.2) ? r.range(1, 5) : 0);
    if (b > 0 && r.chance(0.2)) {
      for (int i = 0; i < b; ++i) seqused.push_back(r.range(0, lk[std::size_t(i)]));
    }
    // Corruptions, each definitely invalid; the error may name the max_seqlen it also breaks.
    for (int side = 0; side < 2 && b > 0; ++side) {
      std::vector<std::int32_t>& cu = side == 0 ? cq : ck;
      const std::string name = side == 0 ? "varlen.cu_seqlens_q" : "varlen.cu_seqlens_k";
      const std::string max_name = side == 0 ? "varlen.max_seqlen_q" : "varlen.max_seqlen_k";
      int& max_len = side == 0 ? vl.max_seqlen_q : vl.max_seqlen_k;
      const double u = r.unit();
      if (u < 0.02) {
        cu[0] = r.pick({1, -1, 3});
        c.broke(name, "start " + std::to_string(cu[0]));
        c.bad.insert(max_name);
      } else if (u < 0.04 && b >= 2) {
        const int i = r.range(1, b - 1);
        cu[std::size_t(i)] = cu[std::size_t(i) + 1] + 1 + r.range(0, 3);
        c.broke(name, "decreasing at " + std::to_string(i));
        c.bad.insert(max_name);
      } else if (u < 0.06) {
        cu[std::size_t(b)] += 1 + r.range(0, 3);
        c.broke(name, "last > total");
        c.bad.insert(max_name);
      } else if (u < 0.08) {
        int actual = 0;
        for (int i = 0; i < b; ++i) actual = std::max(actual, cu[std::size_t(i) + 1] - cu[std::size_t(i)]);
        if (actual > 0) {
          max_len = actual - 1;
          c.broke(max_name, "too small");
        }
      } else if (u < 0.09) {
        max_len = -1;
        c.broke(max_name, "-1");
      }
    }
    if (!seqused.empty() && r.chance(0.05)) {
      const int i = r.range(0, b - 1);
      seqused[std::size_t(i)] = r.chance(0.5) ? -1 : lk[std::size_t(i)] + 1 + r.range(0, 3);
      c.broke("varlen.seqused_k", "entry out of range");
    }
    cu_q = make_i32(cq);
    cu_k = make_i32(ck);
    if (r.chance(0.015)) {  // one entry too many
      ck.push_back(ck.back());
      cu_k = make_i32(ck);
      c.broke("varlen.cu_seqlens_k", "length b + 2");
    }
    vl.cu_seqlens_q = cu_q.tv();
    if (r.chance(0.01)) {  // the right values, announced as f32
      vl.cu_seqlens_q.dtype = DType::f32;
      c.broke("varlen.cu_seqlens_q", "f32");
    }
    vl.cu_seqlens_k = cu_k.tv();
    if (!seqused.empty()) {
      used = make_i32(std::vector<std::int32_t>(seqused.begin(), seqused.end()));
      vl.seqused_k = used.tv();
      c.desc << " seqused_k";
    }
    c.desc << " max=(" << vl.max_seqlen_q << "," << vl.max_seqlen_k << ")";
  }

  // --- outputs --------------------------------------------------------------------------------
  const DType odt = dtype;
  auto out_lay = [&](const char* arg, int width) {
    if (width > 1 && r.chance(0.02)) {
      c.broke(arg, "last stride 2");
      return Lay::strided_last;
    }
    return r.chance(0.35) ? Lay::padded : Lay::contiguous;
  };
  auto lse_buf = [&](const char* arg) {
    const Shape shape = varlen ? Shape{h, total_q} : Shape{b, h, sq};
    const double u = r.unit();
    if (u < 0.01) {
      c.broke(arg, "f16");
      Buf x = make_contiguous(DType::f16, shape, &r);
      return x;
    }
    if (u < 0.02) {
      const Shape wrong = varlen ? Shape{h, total_q + 1} : Shape{b, h, sq + 1};
      c.broke(arg, "wrong shape");
      return make_contiguous(DType::f32, wrong, &r);
    }
    return make_contiguous(DType::f32, shape, &r);
  };
  const Lay olay = out_lay("out", dv);
  Buf out = make_rows(odt, varlen, b, rows_q, h, dv, olay, r);
  Buf lse = lse_buf("lse");
  const bool pass_lse = opt.return_lse || r.chance(0.5);
  if (!pass_lse) c.bad.erase("lse");
  if (r.chance(0.015)) {
    c.broke("out", "wrong shape");
    out = make_rows(odt, varlen, b, rows_q + 1, h, dv, Lay::contiguous, r);
  }

  c.inputs = {q, k, v};
  if (packed) c.inputs = {qkv};
  if (alibi.defined()) c.inputs.push_back(alibi);
  const Buf sinks = draw_sinks(sinks_rng, c, h);
  if (sinks.defined()) c.inputs.push_back(sinks);
  if (varlen) {
    c.inputs.push_back(cu_q);
    c.inputs.push_back(cu_k);
    if (used.defined()) c.inputs.push_back(used);
  }
  c.outputs = {out};
  if (pass_lse) c.outputs.push_back(lse);

  SCOPED_TRACE(std::string(dir_name(dir)) + ":" + c.desc.str());
  fa::ForwardInputs fin{q.tv(), k.tv(), v.tv(), vl};
  if (sinks.defined()) fin.sinks = sinks.tv();
  const fa::ForwardOutputs fout{out.tv(), pass_lse ? lse.tv() : fa::TensorView{}};

  // The problem the checker needs (valid calls only).
  auto problem = [&] {
    AttnProblem p;
    p.cfg.dtype = dtype;
    p.cfg.batch = b;
    p.cfg.seqlen_q = sq;
    p.cfg.seqlen_k = sk;
    p.cfg.heads = h;
    p.cfg.heads_k = hk;
    p.cfg.head_dim = d;
    p.cfg.head_dim_v = dv;
    if (varlen) {
      p.cfg.varlen_q.assign(lq.begin(), lq.begin() + b);
      p.cfg.varlen_k.assign(lk.begin(), lk.begin() + b);
      p.cfg.seqused_k = seqused;
      p.cu_seqlens_q = cu_q.view;
      p.cu_seqlens_k = cu_k.view;
      p.seqused_k = used.view;
    }
    p.cfg.layout = packed ? Layout::packed_qkv : lay == Lay::padded ? Layout::padded : lay == Lay::bhsd ? Layout::bhsd : Layout::contiguous;
    p.cfg.padded_outputs = olay == Lay::padded;
    p.cfg.alibi = alibi_kind;
    p.cfg.opt = opt;
    p.head_dim_v = dv;
    p.total_q = int(rows_q);
    p.total_k = int(rows_k);
    p.q = q.view;
    p.k = k.view;
    p.v = v.view;
    p.alibi_slopes = alibi.view;
    p.cfg.sinks = sinks.defined();
    p.sinks = sinks.view;
    p.opt = opt;
    p.varlen = vl;
    return p;
  };
  // lse for the checker: a defined tensor (when not passed, a poisoned one it will not compare).
  const Tensor lse_for_check = pass_lse ? lse.view : Tensor(DType::f32, varlen ? Shape{h, total_q} : Shape{b, h, sq});

  if (dir == Dir::fwd) {
    const bool ran = run_checked(c, stats, [&] { fa::forward(fin, fout, opt); });
    if (ran && c.bad.empty()) {
      const AttnProblem p = problem();
      EXPECT_TRUE(check_forward(p, ForwardResult{out.view, lse_for_check}));
    }
    return;
  }

  // --- backward: forward first (same backend), then the backward call with its own outputs ----
  // With a broken forward-level argument the backward call is made with poisoned out/lse.
  Buf dout = make_rows(dtype, varlen, b, rows_q, h, dv, r.chance(0.3) ? Lay::padded : Lay::contiguous, r);
  if (dtype != DType::i32) dout.view.fill_random(r.next(), -1.0f, 1.0f);
  const std::set<std::string> fwd_bad = c.bad;
  if (fwd_bad.empty()) {
    Call fc;
    fc.dir = Dir::fwd;
    fc.outputs = c.outputs;
    fc.inputs = c.inputs;
    Stats ignore;
    if (!run_checked(fc, ignore, [&] { fa::forward(fin, fout, opt); })) return;
    EXPECT_TRUE(check_forward(problem(), ForwardResult{out.view, lse_for_check}));
  }
  // Backward-only breakages.
  auto grad_lay = [&](const char* arg, int width) {
    if (width > 1 && r.chance(0.015)) {
      c.broke(arg, "last stride 2");
      return Lay::strided_last;
    }
    return r.chance(0.3) ? Lay::padded : Lay::contiguous;
  };
  const Lay lq_g = grad_lay("dq", d), lk_g = grad_lay("dk", d), lv_g = grad_lay("dv", dv);
  Buf dq = make_rows(dtype, varlen, b, rows_q, h, d, lq_g, r);
  Buf dk = make_rows(dtype, varlen, b, rows_k, hk, d, lk_g, r);
  Buf dvb = make_rows(dtype, varlen, b, rows_k, hk, dv, lv_g, r);
  Buf sd = lse_buf("softmax_d");
  fa::TensorView dout_tv = dout.tv();
  if (r.chance(0.015)) {
    dout_tv.shape[dout_tv.ndim - 1] = std::max<std::int64_t>(dout_tv.shape[dout_tv.ndim - 1] - 8, 0);
    c.broke("dout", "wrong shape");
  }
  fa::TensorView dq_tv = dq.tv();
  if (r.chance(0.015) && dtype != DType::i32) {
    dq_tv.dtype = dtype == DType::f16 ? DType::bf16 : DType::f16;
    c.broke("dq", "dtype");
  }
  fa::BackwardInputs bin{dout_tv, q.tv(), k.tv(), v.tv(), out.tv(), lse.tv(), vl};
  fa::BackwardOutputs bout{dq_tv, dk.tv(), dvb.tv(), sd.tv()};
  c.outputs = {dq, dk, dvb, sd};
  // With sinks: the gradient too (most of the time; the backward also runs without it).
  Buf dsinks;
  if (sinks.defined()) {
    bin.sinks = sinks.tv();
    if (sinks_rng.chance(0.8)) {
      dsinks = make_contiguous(DType::f32, {h});
      bout.dsinks = dsinks.tv();
      c.outputs.push_back(dsinks);
    }
  }
  c.inputs.push_back(dout);
  c.inputs.push_back(out);
  c.inputs.push_back(lse);
  const bool ran = run_checked(c, stats, [&] { fa::backward(bin, bout, opt); });
  if (ran && c.bad.empty()) {
    AttnProblem p = problem();
    p.dout = dout.view;
    EXPECT_TRUE(check_backward(p, ForwardResult{out.view, lse.view},
                               BackwardResult{dq.view, dk.view, dvb.view, sd.view, dsinks.view}));
  }
}

// ================================================================================================
// forward with KV cache
// ================================================================================================

// The rotary embedding of the reference API, written out here: pairs (i, i + rd/2) or (2i, 2i+1).
void rotate(std::vector<double>& x, const Tensor& cos, const Tensor& sin, int pos, int rd, bool interleaved,
            bool in_float) {
  for (int i = 0; i < rd / 2; ++i) {
    const int a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + rd / 2;
    const double c = cos.get({pos, i}), s = sin.get({pos, i});
    const double xa = x[std::size_t(a)], xb = x[std::size_t(b)];
    if (in_float) {  // what a float implementation computes (used for q, whose rounding we mirror)
      x[std::size_t(a)] = double(float(xa) * float(c) - float(xb) * float(s));
      x[std::size_t(b)] = double(float(xa) * float(s) + float(xb) * float(c));
    } else {
      x[std::size_t(a)] = xa * c - xb * s;
      x[std::size_t(b)] = xa * s + xb * c;
    }
  }
}

void fuzz_kvcache(Rng& r, Stats& stats) {
  Call c;
  c.dir = Dir::kv;
  const DType dtype = draw_dtype(r, c);
  const int b = r.chance(0.03) ? 0 : r.range(1, 3);
  if (b == 0) c.broke("q", "b = 0");
  int h = 0, hk = 0;
  draw_heads(r, c, &h, &hk, "k_cache");
  bool bad_d = false, bad_dv = false;
  const int d = draw_dim(r, 0.04, &bad_d);
  const int dv = r.chance(0.6) ? d : draw_dim(r, 0.04, &bad_dv);
  if (bad_d) c.broke("q", "d=" + std::to_string(d));
  if (bad_dv) c.broke("v_cache", "dv=" + std::to_string(dv));
  const double su = r.unit();
  int sq = su < 0.1 ? 0 : su < 0.7 ? r.range(1, 4) : r.range(1, 70);
  enum Kind { dense, indexed, paged };
  const Kind kind = Kind(r.range(0, 2));
  int page = 0, bps = 0, cap = 0;
  if (kind == paged) {
    page = r.pick({1, 2, 3, 4, 8, 16, 32});
    bps = r.range(1, std::max(1, 72 / page));
    cap = page * bps;
  } else {
    cap = r.chance(0.05) ? 0 : r.range(1, 70);
  }
  // Keep the reference cheap: shrink the queries (the cache is what a decode reads).
  while (double(std::max(b, 1)) * sq * std::max(cap, 1) * h * (std::max(d, 8) + std::max(dv, 8)) > 1.2e6 && sq > 1) sq /= 2;
  const bool with_new = r.chance(0.5);
  int sk_new = with_new ? std::min(r.range(0, 8), cap) : 0;
  const bool rotary_ok = d >= 16 && d % 16 == 0 && !bad_d;
  const bool rotary = rotary_ok && r.chance(0.35);
  bool with_seqlens = with_new || rotary || r.chance(0.7);
  std::vector<std::int32_t> seqlens(static_cast<std::size_t>(b));
  for (auto& s : seqlens) s = r.range(0, cap - sk_new);

  fa::Options opt = draw_options(r, c);
  if (r.chance(0.12)) opt.return_lse = false;
  if (opt.dropout_p > 0 && opt.dropout_p < 1 && r.chance(0.6)) opt.dropout_p = 0;  // rare in decoding

  c.desc << " " << fa::dtype_name(dtype) << " b=" << b << " sq=" << sq << " h=" << h << " hk=" << hk << " d=" << d
         << " dv=" << dv << " kind=" << (kind == dense ? "dense" : kind == indexed ? "indexed" : "paged")
         << " cap=" << cap;
  if (kind == paged) c.desc << " page=" << page;
  if (with_new) c.desc << " sk_new=" << sk_new;

  // --- cache layout ---------------------------------------------------------------------------
  int rows = b;  // dense/indexed: cache batch rows; paged: pages
  std::vector<std::int32_t> batch_idx;
  std::vector<std::int32_t> table;  // (b, bps)
  if (kind == indexed) {
    rows = b + r.range(0, 3);
    if (rows == 0) rows = 1;
    std::vector<std::int32_t> perm(static_cast<std::size_t>(rows));
    for (int i = 0; i < rows; ++i) perm[std::size_t(i)] = i;
    r.shuffle(perm);
    for (int i = 0; i < b; ++i) batch_idx.push_back(with_new ? perm[std::size_t(i)] : r.range(0, rows - 1));
  } else if (kind == paged) {
    rows = with_new ? b * bps + r.range(0, 3) : r.range(1, b * bps + 2);
    rows = std::max(rows, 1);
    std::vector<std::int32_t> perm(static_cast<std::size_t>(rows));
    for (int i = 0; i < rows; ++i) perm[std::size_t(i)] = i;
    r.shuffle(perm);
    for (int i = 0; i < b * bps; ++i) table.push_back(with_new ? perm[std::size_t(i)] : r.range(0, rows - 1));
  } else if (r.chance(0.02)) {
    rows = b + 1;
    c.broke("k_cache", "cache batch != b");
  }
  const int rows1 = kind == paged ? page : cap;
  auto len_of = [&](int i) { return with_seqlens ? seqlens[std::size_t(i)] + sk_new : cap; };

  // --- breakages of the cache arguments -------------------------------------------------------
  if (b > 0 && with_seqlens && r.chance(0.04)) {
    const int i = r.range(0, b - 1);
    seqlens[std::size_t(i)] = r.chance(0.5) ? -1 - r.range(0, 2) : cap - sk_new + 1 + r.range(0, 2);
    c.broke("cache_seqlens", "entry " + std::to_string(i) + " = " + std::to_string(seqlens[std::size_t(i)]));
  }
  if (kind == paged && b > 0 && r.chance(0.05)) {
    const int i = r.range(0, b - 1);
    const int used_blocks = (std::max(len_of(i), 0) + page - 1) / page;
    if (used_blocks > 0 && !c.bad.count("cache_seqlens")) {
      const int blk = r.range(0, std::min(used_blocks, bps) - 1);
      table[std::size_t(i * bps + blk)] = r.chance(0.5) ? -1 : rows + r.range(0, 2);
      c.broke("block_table", "entry out of range");
    }
  }
  if (kind == indexed && b > 0 && r.chance(0.05)) {
    const int i = r.range(0, b - 1);
    batch_idx[std::size_t(i)] = r.chance(0.5) ? -1 : rows + r.range(0, 2);
    c.broke("cache_batch_idx", "entry out of range");
  }

  // --- tensors --------------------------------------------------------------------------------
  auto rows_lay = [&]() { return r.chance(0.3) ? Lay::padded : Lay::contiguous; };
  Buf q = make_rows(dtype, false, b, sq, h, d, rows_lay(), r);
  Buf kc = make_rows(dtype, false, rows, rows1, hk, d, rows_lay(), r);
  Buf vc = make_rows(dtype, false, rows, rows1, hk, dv, rows_lay(), r);
  Buf kn, vn;
  if (with_new) {
    kn = make_rows(dtype, false, b, sk_new, hk, d, rows_lay(), r);
    vn = make_rows(dtype, false, b, sk_new, hk, dv, rows_lay(), r);
  }
  if (dtype != DType::i32) {
    q.view.fill_random(r.next());
    kc.view.fill_random(r.next());
    vc.view.fill_random(r.next());
    if (with_new) {
      kn.view.fill_random(r.next());
      vn.view.fill_random(r.next());
    }
  }
  Buf sl, bi, bt, cosb, sinb;
  if (with_seqlens) sl = make_i32(seqlens);
  if (kind == indexed) bi = make_i32(batch_idx);
  if (kind == paged) {
    bt = make_contiguous(DType::i32, {b, bps});
    for (int i = 0; i < b; ++i)
      for (int j = 0; j < bps; ++j) bt.view.set({i, j}, float(table[std::size_t(i * bps + j)]));
  }
  int rd = 0, ro = 0;
  bool interleaved = false;
  if (rotary) {
    rd = 16 * r.range(1, d / 16);
    interleaved = r.chance(0.5);
    int need = 0;
    for (int i = 0; i < b; ++i) need = std::max(need, seqlens[std::size_t(i)] + std::max(sq, sk_new));
    ro = need + (r.chance(0.5) ? 0 : r.range(1, 6));
    if (r.chance(0.05) && need > 0 && !c.bad.count("cache_seqlens")) {
      ro = need - 1;
      c.broke("rotary_cos", "table too short");
    }
    if (r.chance(0.04)) {
      rd = r.pick({8, 24, d + 16});
      if (rd % 16 != 0 || rd > d) c.broke("rotary_cos", "rotary_dim " + std::to_string(rd));
    }
    cosb = make_contiguous(dtype, {ro, rd / 2});
    sinb = make_contiguous(dtype, {ro, rd / 2});
    if (dtype != DType::i32) {
      // Real cos/sin tables of some frequencies (|values| ≤ 1), rounded to the dtype.
      for (int p = 0; p < ro; ++p)
        for (int i = 0; i < rd / 2; ++i) {
          const double theta = p * std::pow(10000.0, -2.0 * i / rd);
          cosb.view.set({p, i}, float(std::cos(theta)));
          sinb.view.set({p, i}, float(std::sin(theta)));
        }
    }
    c.desc << " rotary(rd=" << rd << " ro=" << ro << (interleaved ? " interleaved" : "") << ")";
  }
  Alibi alibi_kind = Alibi::none;
  const Buf alibi = draw_alibi(r, c, b, h, &alibi_kind);
  if (alibi.defined()) opt.alibi_slopes = alibi.tv();
  Buf out = make_rows(dtype, false, b, sq, h, dv, rows_lay(), r);
  Buf lse = make_contiguous(DType::f32, {b, h, sq}, &r);
  const bool pass_lse = opt.return_lse || r.chance(0.5);

  fa::KVCacheInputs in;
  in.q = q.tv();
  in.k_cache = kc.tv();
  in.v_cache = vc.tv();
  in.k_new = kn.tv();
  in.v_new = vn.tv();
  in.cache_seqlens = sl.tv();
  in.cache_batch_idx = bi.tv();
  in.block_table = bt.tv();
  in.rotary_cos = cosb.tv();
  in.rotary_sin = sinb.tv();
  in.rotary_interleaved = interleaved;
  // Argument-level breakages.
  if (with_new && r.chance(0.02)) {
    if (r.chance(0.5)) {
      in.v_new = {};
      c.broke("v_new", "k_new without v_new");
    } else {
      in.k_new = {};
      c.broke("k_new", "v_new without k_new");
    }
  }
  if ((with_new || rotary) && r.chance(0.02)) {
    in.cache_seqlens = {};
    c.broke("cache_seqlens", "missing");
  }
  Buf stray_idx;
  if (kind == paged && b > 0 && r.chance(0.02)) {
    stray_idx = make_i32(std::vector<std::int32_t>(std::size_t(b), 0));
    in.cache_batch_idx = stray_idx.tv();
    c.broke("cache_batch_idx", "with block_table");
  }
  fa::TensorView out_tv = out.tv();
  if (r.chance(0.015)) {
    out_tv.shape[3] = std::max<std::int64_t>(dv - 8, 0);
    c.broke("out", "wrong shape");
  }
  const fa::ForwardOutputs outs{out_tv, pass_lse ? lse.tv() : fa::TensorView{}};

  c.inputs = {q};
  for (const Buf* x : std::initializer_list<const Buf*>{&kn, &vn, &sl, &bi, &bt, &cosb, &sinb, &alibi})
    if (x->defined()) c.inputs.push_back(*x);
  c.outputs = {out};
  if (pass_lse) c.outputs.push_back(lse);
  c.caches = {kc, vc};
  SCOPED_TRACE(std::string("forward_kvcache:") + c.desc.str());

  // The cache as it was, for the append check.
  const Tensor kc_before = kc.view.clone(), vc_before = vc.view.clone();
  const bool ran = run_checked(c, stats, [&] { fa::forward_kvcache(in, outs, opt); });
  if (!ran || !c.bad.empty()) return;

  // --- 1. the cache: rows [seqlens, seqlens + sk_new) of each sequence hold k_new (rotated) and
  //        v_new; every other element is bit for bit what it was ------------------------------
  auto where = [&](int i, int j) {  // (cache row or page, row within it) of key j of sequence i
    if (kind == paged) return std::pair<int, int>(table[std::size_t(i * bps + j / page)], j % page);
    return std::pair<int, int>(kind == indexed ? batch_idx[std::size_t(i)] : i, j);
  };
  std::map<std::pair<int, int>, std::pair<int, int>> appended;  // cache slot → (sequence, t)
  for (int i = 0; i < b && with_new; ++i)
    for (int t = 0; t < sk_new; ++t) appended[where(i, seqlens[std::size_t(i)] + t)] = {i, t};
  const double u = unit_roundoff(dtype);
  std::int64_t cache_bad = 0;
  std::string first_bad;
  auto note = [&](const std::string& what) {
    if (cache_bad++ == 0) first_bad = what;
  };
  for (int w = 0; w < 2; ++w) {
    const Tensor& now = w == 0 ? kc.view : vc.view;
    const Tensor& before = w == 0 ? kc_before : vc_before;
    const int width = w == 0 ? d : dv;
    for (int r0 = 0; r0 < rows; ++r0)
      for (int r1 = 0; r1 < rows1; ++r1)
        for (int hh = 0; hh < hk; ++hh) {
          const auto it = appended.find({r0, r1});
          std::vector<double> expect;
          if (it != appended.end()) {
            const Tensor& src = w == 0 ? kn.view : vn.view;
            expect.resize(std::size_t(width));
            for (int x = 0; x < width; ++x) expect[std::size_t(x)] = src.get({it->second.first, it->second.second, hh, x});
            if (w == 0 && rd > 0) {
              const int pos = seqlens[std::size_t(it->second.first)] + it->second.second;
              const std::vector<double> raw = expect;
              rotate(expect, cosb.view, sinb.view, pos, rd, interleaved, false);
              for (int x = 0; x < rd; ++x) {
                const double got = now.get({r0, r1, hh, x});
                const double e = expect[std::size_t(x)];
                const double tol = 2 * u * std::abs(e) + 1e-6 * (std::abs(raw[std::size_t(x)]) + 1.0) + 1e-7;
                if (!(std::abs(got - e) <= tol)) {
                  note("k_cache(" + std::to_string(r0) + "," + std::to_string(r1) + "," + std::to_string(hh) + "," +
                       std::to_string(x) + ") = " + std::to_string(got) + ", rotated k_new " + std::to_string(e));
                }
              }
            }
            for (int x = (w == 0 ? rd : 0); x < width; ++x) {
              const Tensor& srcv = w == 0 ? kn.view : vn.view;
              const std::uint32_t want = srcv.bits_at(srcv.offset({it->second.first, it->second.second, hh, x}));
              if (now.bits_at(now.offset({r0, r1, hh, x})) != want) {
                note(std::string(w == 0 ? "k" : "v") + "_cache(" + std::to_string(r0) + "," + std::to_string(r1) +
                     ") differs from the appended row");
              }
            }
          } else {
            for (int x = 0; x < width; ++x) {
              if (now.bits_at(now.offset({r0, r1, hh, x})) != before.bits_at(before.offset({r0, r1, hh, x}))) {
                note(std::string(w == 0 ? "k" : "v") + "_cache(" + std::to_string(r0) + "," + std::to_string(r1) + "," +
                     std::to_string(hh) + "," + std::to_string(x) + ") changed outside the appended rows");
              }
            }
          }
        }
    EXPECT_EQ(writes_outside(w == 0 ? kc : vc), 0) << "writes outside the cache view";
  }
  EXPECT_EQ(cache_bad, 0) << cache_bad << " cache elements wrong; first: " << first_bad;

  // --- 2. the attention: the same call as a varlen forward over the keys each sequence now has,
  //        with q rotated at its positions (per row when the mask is causal or windowed) ---------
  const int cap_norm = cap;  // windows ≥ capacity are unbounded, as in the reference API
  int wl = opt.window_left, wr = opt.causal ? 0 : opt.window_right;
  if (wl >= cap_norm) wl = -1;
  if (wr >= cap_norm) wr = -1;
  const bool per_row = wl >= 0 || wr >= 0;
  std::vector<int> lens(static_cast<std::size_t>(b));
  std::int64_t total_k = 0;
  for (int i = 0; i < b; ++i) total_k += lens[std::size_t(i)] = len_of(i);
  Tensor q_ref(dtype, {std::int64_t(b) * sq, h, d}), k_ref(dtype, {total_k, hk, d}), v_ref(dtype, {total_k, hk, dv});
  std::int64_t row = 0;
  for (int i = 0; i < b; ++i)
    for (int t = 0; t < sq; ++t)
      for (int hh = 0; hh < h; ++hh) {
        std::vector<double> x(static_cast<std::size_t>(d));
        for (int e = 0; e < d; ++e) x[std::size_t(e)] = q.view.get({i, t, hh, e});
        if (rd > 0) rotate(x, cosb.view, sinb.view, seqlens[std::size_t(i)] + (per_row ? t : 0), rd, interleaved, true);
        for (int e = 0; e < d; ++e) q_ref.set({std::int64_t(i) * sq + t, hh, e}, float(x[std::size_t(e)]));
      }
  for (int i = 0; i < b; ++i)
    for (int j = 0; j < lens[std::size_t(i)]; ++j, ++row) {
      const auto [r0, r1] = where(i, j);
      for (int hh = 0; hh < hk; ++hh) {
        for (int e = 0; e < d; ++e) k_ref.set({row, hh, e}, kc.view.get({r0, r1, hh, e}));
        for (int e = 0; e < dv; ++e) v_ref.set({row, hh, e}, vc.view.get({r0, r1, hh, e}));
      }
    }
  AttnProblem p;
  p.cfg.dtype = dtype;
  p.cfg.batch = b;
  p.cfg.heads = h;
  p.cfg.heads_k = hk;
  p.cfg.head_dim = d;
  p.cfg.head_dim_v = dv;
  p.cfg.varlen_q.assign(std::size_t(b), sq);
  p.cfg.varlen_k = lens;
  p.cfg.seqlen_q = sq;
  p.cfg.seqlen_k = cap;
  p.cfg.alibi = alibi_kind;
  p.cfg.opt = opt;
  p.head_dim_v = dv;
  p.total_q = b * sq;
  p.total_k = int(total_k);
  p.q = q_ref;
  p.k = k_ref;
  p.v = v_ref;
  std::vector<std::int32_t> cq{0}, ck{0};
  for (int i = 0; i < b; ++i) {
    cq.push_back(cq.back() + sq);
    ck.push_back(ck.back() + lens[std::size_t(i)]);
  }
  p.cu_seqlens_q = Tensor::from_i32(cq);
  p.cu_seqlens_k = Tensor::from_i32(ck);
  p.varlen.cu_seqlens_q = p.cu_seqlens_q.tv();
  p.varlen.cu_seqlens_k = p.cu_seqlens_k.tv();
  p.varlen.max_seqlen_q = sq;
  p.varlen.max_seqlen_k = cap;
  p.alibi_slopes = alibi.view;
  p.opt = opt;
  // The kernel's out (b, sq, h, dv) and lse (b, h, sq) re-laid as varlen (b·sq, h, dv) / (h, b·sq),
  // bit for bit (poison stays poison).
  Tensor out_v(dtype, {std::int64_t(b) * sq, h, dv}), lse_v(DType::f32, {h, std::int64_t(b) * sq});
  const std::size_t es = fa::dtype_size(dtype);
  for (int i = 0; i < b; ++i)
    for (int t = 0; t < sq; ++t)
      for (int hh = 0; hh < h; ++hh) {
        for (int e = 0; e < dv; ++e) {
          const std::uint32_t bits = out.view.bits_at(out.view.offset({i, t, hh, e}));
          std::memcpy(static_cast<char*>(out_v.data()) + out_v.offset({std::int64_t(i) * sq + t, hh, e}) * std::int64_t(es),
                      &bits, es);
        }
        const std::uint32_t lbits = lse.view.bits_at(lse.view.offset({i, hh, t}));
        std::memcpy(static_cast<char*>(lse_v.data()) + lse_v.offset({hh, std::int64_t(i) * sq + t}) * 4, &lbits, 4);
      }
  if (!pass_lse) p.opt.return_lse = false;
  EXPECT_TRUE(check_forward(p, ForwardResult{out_v, lse_v}));
}

// ================================================================================================

// One iteration: its own generator state, derived from (seed, iteration) only.
void run_iteration(std::uint64_t seed, int it, Stats& stats) {
  Rng r(seed ^ (0xD1B54A32D192ED03ull * std::uint64_t(it + 1)));
  const Dir dir = r.chance(0.45) ? Dir::fwd : r.chance(0.55) ? Dir::bwd : Dir::kv;
  SCOPED_TRACE("iteration " + std::to_string(it) + " — replay alone with FLASHATTN_FUZZ_SEED=" + std::to_string(seed) +
               " FLASHATTN_FUZZ_FIRST=" + std::to_string(it) + " FLASHATTN_FUZZ_ITERS=1");
  if (dir == Dir::kv) {
    fuzz_kvcache(r, stats);
  } else {
    fuzz_attention(r, dir, stats);
  }
}

TEST(FuzzApi, RandomCalls) {
  const std::uint64_t seed = env_u64("FLASHATTN_FUZZ_SEED", kDefaultSeed);
  const int iters = int(env_u64("FLASHATTN_FUZZ_ITERS", kDefaultIters));
  const int first = int(env_u64("FLASHATTN_FUZZ_FIRST", 0));
  std::printf("[ FuzzApi  ] seed=0x%llx iterations=%d..%d (override with FLASHATTN_FUZZ_SEED, FLASHATTN_FUZZ_ITERS,"
              " FLASHATTN_FUZZ_FIRST)\n",
              static_cast<unsigned long long>(seed), first, first + iters - 1);
  std::fflush(stdout);
  Stats stats;
  int failing = 0;
  for (int it = first; it < first + iters; ++it) {
    const bool had_failure = HasFailure();
    run_iteration(seed, it, stats);
    if (!had_failure && HasFailure()) ++failing;
    if (failing >= 8) {
      ADD_FAILURE() << "stopping after 8 failing iterations";
      break;
    }
  }
  std::printf("[ FuzzApi  ] accepted %d (forward %d, backward %d, kvcache %d), rejected %d (forward %d, backward %d, "
              "kvcache %d)\n",
              stats.total_accepted(), stats.accepted[0], stats.accepted[1], stats.accepted[2], stats.total_rejected(),
              stats.rejected[0], stats.rejected[1], stats.rejected[2]);
  std::printf("[ FuzzApi  ] rejections by argument:");
  for (const auto& [arg, n] : stats.rejected_by) std::printf(" %s=%d", arg.c_str(), n);
  std::printf("\n");
  EXPECT_GT(stats.total_accepted(), 0);
  EXPECT_GT(stats.total_rejected(), 0);
  if (iters >= 100) {  // the default run exercises every entry point both ways
    for (int d = 0; d < 3; ++d) {
      EXPECT_GT(stats.accepted[d], 0) << dir_name(Dir(d));
      EXPECT_GT(stats.rejected[d], 0) << dir_name(Dir(d));
    }
  }
}

// Iterations of other seeds where the cpu backend once exceeded the SPEC §7 bound (found by
// running RandomCalls with FLASHATTN_FUZZ_SEED=11..25, 3000 iterations each; cpu_reference never
// did). All were small: a few float ulps in f32 (where naive_lowprec is nearly exact), and one f16
// backward whose exact dq/dk are 0 (single visible key: dS = P·(dP − D) cancels). The checker's
// rounding term now covers fp32 accumulation and cancelling terms (test_util.cpp); these replays
// keep both the kernel and that reading of SPEC §7 honest on exactly those cases.
TEST(FuzzApi, ReplayOfFailingIterations) {
  struct Case {
    std::uint64_t seed;
    int iteration;
    const char* what;
  };
  const Case cases[] = {
      {15, 195, "f32 backward, sq = sk = 1: dv = P·dout with P of the single key not exactly 1 (naive error 0)"},
      {15, 413, "f32 forward, sk = 1, causal + ALiBi: lse (= the one score) off by 2 ulp"},
      {11, 2481, "f32 forward, sq = sk = 1, d 80: lse off by 1.5 ulp"},
      {11, 1974, "f32 forward (before backward), d = 256, dropout + ALiBi: lse 3.7x the naive error"},
      {15, 1484, "f32 forward (before a backward call that is rejected), causal window (-1, 4), sq 63 sk 2: out 2.7x the naive error"},
      {16, 2020, "f32 varlen backward with an empty query sequence, d = 8: dq, dk 3.4x the naive error"},
      {22, 1893, "f16 backward, sq = sk = 1, dropout: dq, dk should cancel to 0, kernel 8e-4 (naive 3.7e-4)"},
  };
  fuzz_sinks = false;  // the calls exactly as they were found
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    Stats stats;
    run_iteration(c.seed, c.iteration, stats);
    EXPECT_EQ(stats.total_accepted() + stats.total_rejected(), 1);
  }
  fuzz_sinks = true;
}

}  // namespace
}  // namespace fa_test
