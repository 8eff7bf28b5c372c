// tests/cpp/test_validation.cpp — SPEC §5: every invalid call throws flashattn::Error whose message
// names the argument, the rule, the expected and the actual value ("<api>: <argument>: <rule>;
// expected <x>, got <y>", src/api/validate.cpp), and writes NOTHING: every output (and, for the KV
// cache, both caches) is compared bit for bit with its state before the call. One test per rule;
// each rejection is also asked of can_implement, which must say "no" with the very same message.
// Then the special cases that are NOT errors (empty sequences, null pointers of empty tensors,
// empty varlen segments), run on both CPU backends.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "test_util.h"

namespace fa_test {
namespace {

namespace fa = flashattn;

constexpr fa::Device kCuda0{fa::DeviceType::cuda, 0};
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// --- what a rejection must look like ------------------------------------------------------------

struct Msg {
  std::string api;                    // "flashattn::forward"
  std::string arg;                    // "k", "options.dropout_p", "varlen.cu_seqlens_q", ...
  std::vector<std::string> rule;      // key words of the rule, each must appear
  std::vector<std::string> expected;  // the expected value: one of these follows "; expected "
  std::string got;                    // the actual value: follows ", got "
};

testing::AssertionResult message_matches(const std::string& msg, const Msg& m) {
  auto fail = [&](const std::string& why) {
    return testing::AssertionFailure() << why << "\n  message: \"" << msg << "\"";
  };
  const std::string head = m.api + ": " + m.arg + ": ";
  if (msg.compare(0, head.size(), head) != 0) return fail("does not start with \"" + head + "\"");
  for (const std::string& k : m.rule) {
    if (msg.find(k, head.size()) == std::string::npos) return fail("lacks the rule's words \"" + k + "\"");
  }
  const std::size_t pe = msg.find("; expected ", head.size());
  if (pe == std::string::npos) return fail("has no \"; expected <x>\"");
  const std::size_t pg = msg.find(", got ", pe);
  if (pg == std::string::npos) return fail("has no \", got <y>\" after the expected value");
  const std::string expected = msg.substr(pe + 11, pg - (pe + 11));
  const std::string got = msg.substr(pg + 6);
  if (!m.expected.empty()) {
    bool any = false;
    for (const std::string& e : m.expected) any = any || expected.find(e) != std::string::npos;
    if (!any) return fail("expected value \"" + expected + "\" lacks \"" + m.expected.front() + "\"");
  }
  if (got.find(m.got) == std::string::npos) return fail("actual value \"" + got + "\" lacks \"" + m.got + "\"");
  return testing::AssertionSuccess();
}

// The bytes of every watched tensor (outputs, caches), to prove a rejected call wrote nothing.
class Snapshot {
 public:
  explicit Snapshot(std::vector<Tensor> ts) : ts_(std::move(ts)) {
    for (const Tensor& t : ts_) bytes_.push_back(bytes_of(t));
  }
  testing::AssertionResult unchanged() const {
    for (std::size_t i = 0; i < ts_.size(); ++i) {
      const std::vector<unsigned char> now = bytes_of(ts_[i]);
      if (now != bytes_[i]) {
        std::size_t first = 0;
        while (first < now.size() && now[first] == bytes_[i][first]) ++first;
        return testing::AssertionFailure() << "watched tensor #" << i << " (shape "
                                           << fa::shape_string(ts_[i].tv()) << ") changed at byte "
                                           << first;
      }
    }
    return testing::AssertionSuccess();
  }

 private:
  static std::vector<unsigned char> bytes_of(const Tensor& t) {
    if (!t.defined()) return {};
    const std::size_t n = std::size_t(std::max<std::int64_t>(t.span(), 1)) * fa::dtype_size(t.dtype());
    const auto* p = static_cast<const unsigned char*>(t.data());
    return std::vector<unsigned char>(p, p + n);
  }
  std::vector<Tensor> ts_;
  std::vector<std::vector<unsigned char>> bytes_;
};

// Calls `call`, which must throw flashattn::Error with a message matching `m` and leave every
// watched tensor untouched. Returns the message.
std::string expect_rejected_by(const std::function<void()>& call, const std::vector<Tensor>& watched,
                               const Msg& m) {
  const Snapshot snap(watched);
  std::string msg;
  bool threw = false;
  try {
    call();
  } catch (const fa::Error& e) {
    threw = true;
    msg = e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw an exception that is not flashattn::Error: " << e.what();
  }
  if (!threw) {
    ADD_FAILURE() << "the call was accepted; expected flashattn::Error naming \"" << m.arg << "\"";
  } else {
    EXPECT_TRUE(message_matches(msg, m));
  }
  EXPECT_TRUE(snap.unchanged()) << "a rejected call wrote into an output (or a cache)";
  return msg;
}

// For the entry points with can_implement: the call and can_implement must agree.
template <class Case>
std::string expect_rejected(const Case& c, const Msg& m) {
  const std::string msg = expect_rejected_by([&] { c.call(); }, c.watched(), m);
  const Snapshot snap(c.watched());
  const fa::Support s = c.support();
  EXPECT_FALSE(s.ok) << "can_implement said yes to a call that throws: " << msg;
  EXPECT_FALSE(bool(s));
  if (!msg.empty()) {
    EXPECT_EQ(s.reason, msg) << "can_implement's reason differs from the error";
  }
  EXPECT_TRUE(snap.unchanged()) << "can_implement wrote into an output";
  return msg;
}

#define EXPECT_REJECTED(case_, ...)                  \
  do {                                               \
    SCOPED_TRACE("rejection checked here");          \
    expect_rejected((case_), Msg{__VA_ARGS__});      \
  } while (0)

// --- tensors ------------------------------------------------------------------------------------

// A tensor whose last dimension has stride `last` (> 1: not contiguous), memory exactly its span.
Tensor strided_last(DType dtype, Shape shape, std::int64_t last, std::uint64_t seed) {
  Strides st(shape.size());
  st.back() = last;
  for (int i = int(shape.size()) - 2; i >= 0; --i) st[std::size_t(i)] = st[std::size_t(i) + 1] * shape[std::size_t(i) + 1];
  Tensor t = Tensor::with_strides(dtype, shape, st);
  if (dtype == DType::i32) {
    t.fill(0.0f);
  } else {
    t.fill_random(seed);
  }
  return t;
}

Tensor random_tensor(DType dtype, Shape shape, std::uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
  Tensor t(dtype, std::move(shape));
  t.fill_random(seed, lo, hi);
  return t;
}

Tensor i32_matrix(const std::vector<std::vector<std::int32_t>>& rows) {
  Tensor t(DType::i32, {std::int64_t(rows.size()), std::int64_t(rows.at(0).size())});
  for (std::size_t i = 0; i < rows.size(); ++i)
    for (std::size_t j = 0; j < rows[i].size(); ++j) t.set({std::int64_t(i), std::int64_t(j)}, float(rows[i][j]));
  return t;
}

fa::TensorView on(fa::TensorView t, fa::Device d) {
  t.device = d;
  return t;
}
fa::TensorView as(fa::TensorView t, DType dtype) {
  t.dtype = dtype;
  return t;
}
// The view with one dimension resized (never larger than the memory behind it, unless noted).
fa::TensorView resized(fa::TensorView t, int dim, std::int64_t size) {
  t.shape[dim] = size;
  return t;
}

// --- the valid calls every rejection test breaks in one place -----------------------------------

// b=2, sq=5, sk=7, h=4, hk=2, d=16, dv=24: q (2,5,4,16) k (2,7,2,16) v (2,7,2,24) out (2,5,4,24)
// lse (2,4,5). d ≠ dv and h ≠ hk so that every shape names its own numbers.
AttnConfig dense_cfg(DType dtype = DType::f16) {
  AttnConfig c;
  c.dtype = dtype;
  c.batch = 2;
  c.seqlen_q = 5;
  c.seqlen_k = 7;
  c.heads = 4;
  c.heads_k = 2;
  c.head_dim = 16;
  c.head_dim_v = 24;
  return c;
}

// Varlen: q lengths {3, 5, 2} (total 10), k lengths {4, 6, 1} (total 11): cu_seqlens_q
// [0, 3, 8, 10], cu_seqlens_k [0, 4, 10, 11], max 5 / 6. q (10,4,16) k (11,2,16) v (11,2,24).
AttnConfig varlen_cfg() {
  AttnConfig c = dense_cfg();
  c.varlen_q = {3, 5, 2};
  c.varlen_k = {4, 6, 1};
  return c;
}

const std::string kFwd = "flashattn::forward";
const std::string kBwd = "flashattn::backward";
const std::string kKv = "flashattn::forward_kvcache";
const std::string kComb = "flashattn::combine";

struct FwdCase {
  AttnProblem p;
  ForwardResult r;
  fa::ForwardInputs in;
  fa::ForwardOutputs out;
  fa::Options opt;

  explicit FwdCase(const AttnConfig& cfg = dense_cfg()) : p(make_problem(cfg)), r(make_forward_outputs(p)) {
    in = p.forward_inputs();
    out = {r.out.tv(), r.lse.tv()};
    opt = p.opt;
    opt.backend = Backend::cpu_reference;
  }
  void call() const { fa::forward(in, out, opt); }
  fa::Support support() const { return fa::can_implement(in, out, opt); }
  std::vector<Tensor> watched() const { return {r.out, r.lse}; }
};

struct BwdCase {
  AttnProblem p;
  ForwardResult fwd;
  BackwardResult r;
  fa::BackwardInputs in;
  fa::BackwardOutputs out;
  fa::Options opt;

  explicit BwdCase(const AttnConfig& cfg = dense_cfg())
      : p(make_problem(cfg)), fwd(run_forward(p, Backend::cpu_reference)), r(make_backward_outputs(p)) {
    in = p.backward_inputs(fwd);
    out = {r.dq.tv(), r.dk.tv(), r.dv.tv(), r.softmax_d.tv()};
    opt = p.opt;
    opt.backend = Backend::cpu_reference;
  }
  void call() const { fa::backward(in, out, opt); }
  fa::Support support() const { return fa::can_implement(in, out, opt); }
  std::vector<Tensor> watched() const { return {r.dq, r.dk, r.dv, r.softmax_d}; }
};

// KV cache: b=2, sq=3, h=4, hk=2, d=32, dv=16; cache_seqlens [3, 5]; k_new/v_new of 2 rows.
//   dense:   k_cache (2, 12, 2, 32), v_cache (2, 12, 2, 16) — capacity 12
//   indexed: k_cache (3, 12, 2, 32) with cache_batch_idx [2, 0]
//   paged:   k_cache (7, 4, 2, 32) pages, block_table (2, 3) [[5,0,3],[1,6,2]] — capacity 12
// rotary: cos/sin (12, 8): rotary_dim 16.
struct KvCase {
  static constexpr std::int64_t b = 2, sq = 3, h = 4, hk = 2, d = 32, dv = 16, cap = 12, sk_new = 2,
                                ro = 12, page = 4, blocks = 7;
  enum Kind { dense, indexed, paged };
  DType dt = DType::f16;
  Tensor q, k_cache, v_cache, k_new, v_new, seqlens, batch_idx, block_table, cos, sin, out, lse;
  fa::KVCacheInputs in;
  fa::ForwardOutputs outs;
  fa::Options opt;

  explicit KvCase(Kind kind = dense, bool rotary = false) {
    const std::uint64_t s = test_seed(1000);
    q = random_tensor(dt, {b, sq, h, d}, s + 1);
    if (kind == paged) {
      k_cache = random_tensor(dt, {blocks, page, hk, d}, s + 2);
      v_cache = random_tensor(dt, {blocks, page, hk, dv}, s + 3);
      block_table = i32_matrix({{5, 0, 3}, {1, 6, 2}});
    } else {
      const std::int64_t rows = kind == indexed ? 3 : b;
      k_cache = random_tensor(dt, {rows, cap, hk, d}, s + 2);
      v_cache = random_tensor(dt, {rows, cap, hk, dv}, s + 3);
      if (kind == indexed) batch_idx = Tensor::from_i32({2, 0});
    }
    k_new = random_tensor(dt, {b, sk_new, hk, d}, s + 4);
    v_new = random_tensor(dt, {b, sk_new, hk, dv}, s + 5);
    seqlens = Tensor::from_i32({3, 5});
    if (rotary) {
      cos = random_tensor(dt, {ro, 8}, s + 6);
      sin = random_tensor(dt, {ro, 8}, s + 7);
    }
    out = Tensor(dt, {b, sq, h, dv});
    lse = Tensor(DType::f32, {b, h, sq});
    in.q = q.tv();
    in.k_cache = k_cache.tv();
    in.v_cache = v_cache.tv();
    in.k_new = k_new.tv();
    in.v_new = v_new.tv();
    in.cache_seqlens = seqlens.tv();
    in.cache_batch_idx = batch_idx.tv();
    in.block_table = block_table.tv();
    in.rotary_cos = cos.tv();
    in.rotary_sin = sin.tv();
    outs = {out.tv(), lse.tv()};
    opt.backend = Backend::cpu_reference;
  }
  void call() const { fa::forward_kvcache(in, outs, opt); }
  fa::Support support() const { return fa::can_implement(in, outs, opt); }
  std::vector<Tensor> watched() const { return {out, lse, k_cache, v_cache}; }
};

// combine: out_partial (3, 2, 4, 2, 8) f32, lse_partial (3, 2, 2, 4) f32 → out (2, 4, 2, 8) f16,
// lse (2, 2, 4) f32.
struct CombineCase {
  Tensor op, lp, out, lse;
  fa::CombineInputs in;
  fa::ForwardOutputs outs;

  CombineCase() {
    const std::uint64_t s = test_seed(2000);
    op = random_tensor(DType::f32, {3, 2, 4, 2, 8}, s + 1);
    lp = random_tensor(DType::f32, {3, 2, 2, 4}, s + 2, -2.0f, 3.0f);
    out = Tensor(DType::f16, {2, 4, 2, 8});
    lse = Tensor(DType::f32, {2, 2, 4});
    in = {op.tv(), lp.tv()};
    outs = {out.tv(), lse.tv()};
  }
  void call() const { fa::combine(in, outs); }
  std::vector<Tensor> watched() const { return {out, lse}; }
};

std::string expect_combine_rejected(const CombineCase& c, const Msg& m) {
  return expect_rejected_by([&] { c.call(); }, c.watched(), m);
}
#define EXPECT_COMBINE_REJECTED(case_, ...)                \
  do {                                                     \
    SCOPED_TRACE("rejection checked here");                \
    expect_combine_rejected((case_), Msg{__VA_ARGS__});    \
  } while (0)

// ================================================================================================
// The valid calls the rejection tests start from are valid (else the tests prove nothing).
// ================================================================================================

TEST(ValidationBase, EveryBaseCallIsAccepted) {
  {
    FwdCase c;
    EXPECT_TRUE(c.support().ok) << c.support().reason;
    EXPECT_NO_THROW(c.call());
    EXPECT_TRUE(check_forward(c.p, c.r));
  }
  {
    FwdCase c(varlen_cfg());
    EXPECT_TRUE(c.support().ok) << c.support().reason;
    EXPECT_NO_THROW(c.call());
    EXPECT_TRUE(check_forward(c.p, c.r));
  }
  for (const AttnConfig& cfg : {dense_cfg(), varlen_cfg()}) {
    BwdCase c(cfg);
    EXPECT_TRUE(c.support().ok) << c.support().reason;
    EXPECT_NO_THROW(c.call());
    EXPECT_TRUE(check_backward(c.p, c.fwd, c.r));
  }
  for (KvCase::Kind kind : {KvCase::dense, KvCase::indexed, KvCase::paged}) {
    for (bool rotary : {false, true}) {
      KvCase c(kind, rotary);
      SCOPED_TRACE("kv kind " + std::to_string(int(kind)) + (rotary ? " rotary" : ""));
      EXPECT_TRUE(c.support().ok) << c.support().reason;
      EXPECT_NO_THROW(c.call());
    }
  }
  {
    CombineCase c;
    EXPECT_NO_THROW(c.call());
  }
}

// ================================================================================================
// Tensors every entry point checks: presence, rank, sizes, strides, memory.
// ================================================================================================

TEST(ValidationTensor, RequiredTensorsMustBeGiven) {
  auto fwd = [](auto mutate, const std::string& arg) {
    FwdCase c;
    mutate(c);
    SCOPED_TRACE(arg);
    EXPECT_REJECTED(c, kFwd, arg, {"is required"}, {"a tensor"}, "none");
  };
  fwd([](FwdCase& c) { c.in.q = {}; }, "q");
  fwd([](FwdCase& c) { c.in.k = {}; }, "k");
  fwd([](FwdCase& c) { c.in.v = {}; }, "v");
  fwd([](FwdCase& c) { c.out.out = {}; }, "out");
  fwd([](FwdCase& c) { c.out.lse = {}; }, "lse");  // return_lse is true by default
  auto bwd = [](auto mutate, const std::string& arg) {
    BwdCase c;
    mutate(c);
    SCOPED_TRACE(arg);
    EXPECT_REJECTED(c, kBwd, arg, {"is required"}, {"a tensor"}, "none");
  };
  bwd([](BwdCase& c) { c.in.dout = {}; }, "dout");
  bwd([](BwdCase& c) { c.in.out = {}; }, "out");
  bwd([](BwdCase& c) { c.in.lse = {}; }, "lse");
  bwd([](BwdCase& c) { c.out.dq = {}; }, "dq");
  bwd([](BwdCase& c) { c.out.dk = {}; }, "dk");
  bwd([](BwdCase& c) { c.out.dv = {}; }, "dv");
  bwd([](BwdCase& c) { c.out.softmax_d = {}; }, "softmax_d");
  auto kv = [](auto mutate, const std::string& arg) {
    KvCase c;
    mutate(c);
    SCOPED_TRACE(arg);
    EXPECT_REJECTED(c, kKv, arg, {"is required"}, {"a tensor"}, "none");
  };
  kv([](KvCase& c) { c.in.q = {}; }, "q");
  kv([](KvCase& c) { c.in.k_cache = {}; }, "k_cache");
  kv([](KvCase& c) { c.in.v_cache = {}; }, "v_cache");
  kv([](KvCase& c) { c.outs.out = {}; }, "out");
  kv([](KvCase& c) { c.outs.lse = {}; }, "lse");
}

TEST(ValidationTensor, RankOutOfRange) {
  FwdCase c;
  c.in.q.ndim = 6;  // beyond kMaxDims; shape[5] does not exist and must not be read
  EXPECT_REJECTED(c, kFwd, "q", {"rank out of range"}, {"1 to 5"}, "6");
  FwdCase d;
  d.out.lse.ndim = 7;
  EXPECT_REJECTED(d, kFwd, "lse", {"rank out of range"}, {"1 to 5"}, "7");
}

TEST(ValidationTensor, NegativeDimension) {
  FwdCase c;
  c.in.k.shape[1] = -1;
  EXPECT_REJECTED(c, kFwd, "k", {"negative dimension"}, {"0"}, "(2, -1, 2, 16)");
  BwdCase b;
  b.out.dv.shape[2] = -2;
  EXPECT_REJECTED(b, kBwd, "dv", {"negative dimension"}, {"0"}, "(2, 7, -2, 24)");
}

TEST(ValidationTensor, NegativeStride) {
  FwdCase c;
  c.in.v.stride[1] = -c.in.v.stride[1];
  EXPECT_REJECTED(c, kFwd, "v", {"negative stride", "dimension 1"}, {"0"}, "-48");
  FwdCase o;
  o.out.out.stride[0] = -1;
  EXPECT_REJECTED(o, kFwd, "out", {"negative stride", "dimension 0"}, {"0"}, "-1");
  KvCase kv;
  kv.in.k_new.stride[2] = -32;
  EXPECT_REJECTED(kv, kKv, "k_new", {"negative stride", "dimension 2"}, {"0"}, "-32");
}

TEST(ValidationTensor, NullDataPointerOfNonEmptyTensor) {
  FwdCase c;
  c.in.k.data = nullptr;
  EXPECT_REJECTED(c, kFwd, "k", {"null data pointer"}, {"(2, 7, 2, 16)"}, "nullptr");
  FwdCase o;
  o.out.lse.data = nullptr;
  EXPECT_REJECTED(o, kFwd, "lse", {"null data pointer"}, {"(2, 4, 5)"}, "nullptr");
  BwdCase b;
  b.out.dq.data = nullptr;
  EXPECT_REJECTED(b, kBwd, "dq", {"null data pointer"}, {"(2, 5, 4, 16)"}, "nullptr");
  KvCase kv;
  kv.in.cache_seqlens.data = nullptr;
  EXPECT_REJECTED(kv, kKv, "cache_seqlens", {"null data pointer"}, {"(2)"}, "nullptr");
}

// ================================================================================================
// dtypes
// ================================================================================================

TEST(ValidationDtype, Int32InputsRejected) {
  FwdCase c;
  c.in.q = as(c.in.q, DType::i32);
  c.in.k = as(c.in.k, DType::i32);
  c.in.v = as(c.in.v, DType::i32);
  c.out.out = as(c.out.out, DType::i32);
  EXPECT_REJECTED(c, kFwd, "q", {"fp16", "bf16"}, {"f16, bf16 or f32"}, "i32");
  KvCase kv;
  kv.in.q = as(kv.in.q, DType::i32);
  EXPECT_REJECTED(kv, kKv, "q", {"fp16", "bf16"}, {"f16, bf16 or f32"}, "i32");
}

TEST(ValidationDtype, Fp32OnlyOnCpuBackends) {
  // f32 is served by the CPU backends (accepted) ...
  {
    FwdCase c(dense_cfg(DType::f32));
    EXPECT_TRUE(c.support().ok) << c.support().reason;
    EXPECT_NO_THROW(c.call());
    EXPECT_TRUE(check_forward(c.p, c.r));
  }
  // ... but not when the CUDA backend is asked for: fp16 and bf16 only.
  FwdCase c(dense_cfg(DType::f32));
  c.opt.backend = Backend::cuda;
  EXPECT_REJECTED(c, kFwd, "q", {"fp16", "bf16"}, {"f16 or bf16"}, "f32");
  BwdCase b(dense_cfg(DType::f32));
  b.opt.backend = Backend::cuda;
  EXPECT_REJECTED(b, kBwd, "q", {"fp16", "bf16"}, {"f16 or bf16"}, "f32");
}

TEST(ValidationDtype, TensorsMustHaveQsDtype) {
  auto fwd = [](auto mutate, const std::string& arg) {
    FwdCase c;
    mutate(c);
    SCOPED_TRACE(arg);
    EXPECT_REJECTED(c, kFwd, arg, {"q's dtype"}, {"f16"}, "bf16");
  };
  fwd([](FwdCase& c) { c.in.k = as(c.in.k, DType::bf16); }, "k");
  fwd([](FwdCase& c) { c.in.v = as(c.in.v, DType::bf16); }, "v");
  fwd([](FwdCase& c) { c.out.out = as(c.out.out, DType::bf16); }, "out");
  auto bwd = [](auto mutate, const std::string& arg) {
    BwdCase c;
    mutate(c);
    SCOPED_TRACE(arg);
    EXPECT_REJECTED(c, kBwd, arg, {"q's dtype"}, {"f16"}, "bf16");
  };
  bwd([](BwdCase& c) { c.in.dout = as(c.in.dout, DType::bf16); }, "dout");
  bwd([](BwdCase& c) { c.in.out = as(c.in.out, DType::bf16); }, "out");
  bwd([](BwdCase& c) { c.out.dq = as(c.out.dq, DType::bf16); }, "dq");
  bwd([](BwdCase& c) { c.out.dk = as(c.out.dk, DType::bf16); }, "dk");
  bwd([](BwdCase& c) { c.out.dv = as(c.out.dv, DType::bf16); }, "dv");
  auto kv = [](auto mutate, const std::string& arg) {
    KvCase c(KvCase::dense, true);
    mutate(c);
    SCOPED_TRACE(arg);
    EXPECT_REJECTED(c, kKv, arg, {"q's dtype"}, {"f16"}, "bf16");
  };
  kv([](KvCase& c) { c.in.k_cache = as(c.in.k_cache, DType::bf16); }, "k_cache");
  kv([](KvCase& c) { c.in.v_cache = as(c.in.v_cache, DType::bf16); }, "v_cache");
  kv([](KvCase& c) { c.in.k_new = as(c.in.k_new, DType::bf16); }, "k_new");
  kv([](KvCase& c) { c.in.v_new = as(c.in.v_new, DType::bf16); }, "v_new");
  kv([](KvCase& c) { c.in.rotary_cos = as(c.in.rotary_cos, DType::bf16); }, "rotary_cos");
  kv([](KvCase& c) { c.in.rotary_sin = as(c.in.rotary_sin, DType::bf16); }, "rotary_sin");
  kv([](KvCase& c) { c.outs.out = as(c.outs.out, DType::bf16); }, "out");
}

TEST(ValidationDtype, LseAndSoftmaxDMustBeFp32) {
  FwdCase c;
  c.out.lse = as(c.out.lse, DType::f16);
  EXPECT_REJECTED(c, kFwd, "lse", {"must be fp32"}, {"f32"}, "f16");
  BwdCase b;
  b.in.lse = as(b.in.lse, DType::bf16);
  EXPECT_REJECTED(b, kBwd, "lse", {"must be fp32"}, {"f32"}, "bf16");
  BwdCase s;
  s.out.softmax_d = as(s.out.softmax_d, DType::i32);
  EXPECT_REJECTED(s, kBwd, "softmax_d", {"must be fp32"}, {"f32"}, "i32");
  KvCase kv;
  kv.outs.lse = as(kv.outs.lse, DType::f16);
  EXPECT_REJECTED(kv, kKv, "lse", {"must be fp32"}, {"f32"}, "f16");
}

TEST(ValidationDtype, IndexTensorsMustBeInt32) {
  {
    FwdCase c(varlen_cfg());
    c.in.varlen.cu_seqlens_q = as(c.in.varlen.cu_seqlens_q, DType::f32);
    EXPECT_REJECTED(c, kFwd, "varlen.cu_seqlens_q", {"int32"}, {"i32"}, "f32");
  }
  {
    FwdCase c(varlen_cfg());
    c.in.varlen.cu_seqlens_k = as(c.in.varlen.cu_seqlens_k, DType::f16);
    EXPECT_REJECTED(c, kFwd, "varlen.cu_seqlens_k", {"int32"}, {"i32"}, "f16");
  }
  {
    AttnConfig cfg = varlen_cfg();
    cfg.seqused_k = {4, 6, 1};
    FwdCase c(cfg);
    c.in.varlen.seqused_k = as(c.in.varlen.seqused_k, DType::f32);
    EXPECT_REJECTED(c, kFwd, "varlen.seqused_k", {"int32"}, {"i32"}, "f32");
  }
  {
    KvCase c;
    c.in.cache_seqlens = as(c.in.cache_seqlens, DType::f32);
    EXPECT_REJECTED(c, kKv, "cache_seqlens", {"int32"}, {"i32"}, "f32");
  }
  {
    KvCase c(KvCase::indexed);
    c.in.cache_batch_idx = as(c.in.cache_batch_idx, DType::f32);
    EXPECT_REJECTED(c, kKv, "cache_batch_idx", {"int32"}, {"i32"}, "f32");
  }
  {
    KvCase c(KvCase::paged);
    c.in.block_table = as(c.in.block_table, DType::f32);
    EXPECT_REJECTED(c, kKv, "block_table", {"int32"}, {"i32"}, "f32");
  }
}

// ================================================================================================
// Devices and backends
// ================================================================================================

TEST(ValidationDevice, AllTensorsOnOneDevice) {
  auto fwd = [](auto mutate, const std::string& arg) {
    FwdCase c;
    mutate(c);
    SCOPED_TRACE(arg);
    EXPECT_REJECTED(c, kFwd, arg, {"one device"}, {"cpu"}, "cuda:0");
  };
  fwd([](FwdCase& c) { c.in.k = on(c.in.k, kCuda0); }, "k");
  fwd([](FwdCase& c) { c.in.v = on(c.in.v, kCuda0); }, "v");
  fwd([](FwdCase& c) { c.out.out = on(c.out.out, kCuda0); }, "out");
  fwd([](FwdCase& c) { c.out.lse = on(c.out.lse, kCuda0); }, "lse");
  {
    AttnConfig cfg = dense_cfg();
    cfg.alibi = Alibi::per_head;
    FwdCase c(cfg);
    c.opt.alibi_slopes = on(c.opt.alibi_slopes, kCuda0);
    EXPECT_REJECTED(c, kFwd, "alibi_slopes", {"one device"}, {"cpu"}, "cuda:0");
  }
  {
    FwdCase c(varlen_cfg());
    c.in.varlen.cu_seqlens_k = on(c.in.varlen.cu_seqlens_k, kCuda0);
    EXPECT_REJECTED(c, kFwd, "varlen.cu_seqlens_k", {"one device"}, {"cpu"}, "cuda:0");
  }
  auto bwd = [](auto mutate, const std::string& arg) {
    BwdCase c;
    mutate(c);
    SCOPED_TRACE(arg);
    EXPECT_REJECTED(c, kBwd, arg, {"one device"}, {"cpu"}, "cuda:0");
  };
  bwd([](BwdCase& c) { c.in.dout = on(c.in.dout, kCuda0); }, "dout");
  bwd([](BwdCase& c) { c.in.lse = on(c.in.lse, kCuda0); }, "lse");
  bwd([](BwdCase& c) { c.out.dq = on(c.out.dq, kCuda0); }, "dq");
  bwd([](BwdCase& c) { c.out.dk = on(c.out.dk, kCuda0); }, "dk");
  bwd([](BwdCase& c) { c.out.dv = on(c.out.dv, kCuda0); }, "dv");
  bwd([](BwdCase& c) { c.out.softmax_d = on(c.out.softmax_d, kCuda0); }, "softmax_d");
  auto kv = [](auto mutate, const std::string& arg, KvCase::Kind kind = KvCase::dense) {
    KvCase c(kind, true);
    mutate(c);
    SCOPED_TRACE(arg);
    EXPECT_REJECTED(c, kKv, arg, {"one device"}, {"cpu"}, "cuda:0");
  };
  kv([](KvCase& c) { c.in.v_cache = on(c.in.v_cache, kCuda0); }, "v_cache");
  kv([](KvCase& c) { c.in.k_new = on(c.in.k_new, kCuda0); }, "k_new");
  kv([](KvCase& c) { c.in.cache_seqlens = on(c.in.cache_seqlens, kCuda0); }, "cache_seqlens");
  kv([](KvCase& c) { c.in.rotary_sin = on(c.in.rotary_sin, kCuda0); }, "rotary_sin");
  kv([](KvCase& c) { c.in.block_table = on(c.in.block_table, kCuda0); }, "block_table", KvCase::paged);
  kv([](KvCase& c) { c.in.cache_batch_idx = on(c.in.cache_batch_idx, kCuda0); }, "cache_batch_idx",
     KvCase::indexed);
  CombineCase cb;
  cb.in.lse_partial = on(cb.in.lse_partial, kCuda0);
  EXPECT_COMBINE_REJECTED(cb, kComb, "lse_partial", {"one device"}, {"cpu"}, "cuda:0");
  CombineCase co;
  co.outs.out = on(co.outs.out, kCuda0);
  EXPECT_COMBINE_REJECTED(co, kComb, "out", {"one device"}, {"cpu"}, "cuda:0");
}

#ifndef FLASHATTN_WITH_CUDA
// Every tensor on cuda:0, in a build without CUDA: the message says which build option adds it.
TEST(ValidationDevice, CudaTensorInBuildWithoutCuda) {
  {
    FwdCase c;
    for (fa::TensorView* t : {&c.in.q, &c.in.k, &c.in.v, &c.out.out, &c.out.lse}) *t = on(*t, kCuda0);
    EXPECT_REJECTED(c, kFwd, "q", {"CUDA tensor", "FLASHATTN_CUDA"}, {"host tensor"}, "cuda:0");
    c.opt.backend = Backend::automatic;
    EXPECT_REJECTED(c, kFwd, "q", {"CUDA tensor", "FLASHATTN_CUDA"}, {"host tensor"}, "cuda:0");
  }
  {
    BwdCase c;
    for (fa::TensorView* t : {&c.in.dout, &c.in.q, &c.in.k, &c.in.v, &c.in.out, &c.in.lse, &c.out.dq,
                              &c.out.dk, &c.out.dv, &c.out.softmax_d})
      *t = on(*t, kCuda0);
    c.opt.backend = Backend::cuda;
    EXPECT_REJECTED(c, kBwd, "q", {"CUDA tensor", "FLASHATTN_CUDA"}, {"host tensor"}, "cuda:0");
  }
  {
    KvCase c;
    for (fa::TensorView* t : {&c.in.q, &c.in.k_cache, &c.in.v_cache, &c.in.k_new, &c.in.v_new,
                              &c.in.cache_seqlens, &c.outs.out, &c.outs.lse})
      *t = on(*t, kCuda0);
    c.opt.backend = Backend::automatic;
    EXPECT_REJECTED(c, kKv, "q", {"CUDA tensor", "FLASHATTN_CUDA"}, {"host tensor"}, "cuda:0");
  }
  {
    CombineCase c;
    for (fa::TensorView* t : {&c.in.out_partial, &c.in.lse_partial, &c.outs.out, &c.outs.lse}) *t = on(*t, kCuda0);
    EXPECT_COMBINE_REJECTED(c, kComb, "out_partial", {"CUDA tensor", "FLASHATTN_CUDA"}, {"host tensor"}, "cuda:0");
  }
  const std::vector<Backend> compiled = fa::compiled_backends();
  EXPECT_EQ(std::find(compiled.begin(), compiled.end(), Backend::cuda), compiled.end());
}
#else
TEST(ValidationDevice, CpuBackendCannotReadCudaTensors) {
  FwdCase c;
  for (fa::TensorView* t : {&c.in.q, &c.in.k, &c.in.v, &c.out.out, &c.out.lse}) *t = on(*t, kCuda0);
  c.opt.backend = Backend::cpu;
  EXPECT_REJECTED(c, kFwd, "options.backend", {"CPU backend", "CUDA tensors"}, {"auto or cuda"}, "cpu");
}
#endif

TEST(ValidationDevice, CudaBackendNeedsCudaTensors) {
  FwdCase c;
  c.opt.backend = Backend::cuda;
  EXPECT_REJECTED(c, kFwd, "options.backend", {"CUDA backend", "CUDA tensors"}, {"cpu_reference"}, "cuda");
  KvCase kv;
  kv.opt.backend = Backend::cuda;
  EXPECT_REJECTED(kv, kKv, "options.backend", {"CUDA backend", "CUDA tensors"}, {"cpu_reference"}, "cuda");
}

// ================================================================================================
// Strides: the last dimension contiguous; lse-like and index tensors fully contiguous.
// ================================================================================================

TEST(ValidationStrides, LastDimensionMustBeContiguous) {
  const std::uint64_t s = test_seed(1);
  auto fwd = [&](auto mutate, const std::string& arg) {
    FwdCase c;
    mutate(c);
    SCOPED_TRACE(arg);
    EXPECT_REJECTED(c, kFwd, arg, {"last dimension must be contiguous"}, {"stride 1"}, "stride 2");
  };
  Tensor q2 = strided_last(DType::f16, {2, 5, 4, 16}, 2, s + 1);
  Tensor k2 = strided_last(DType::f16, {2, 7, 2, 16}, 2, s + 2);
  Tensor v2 = strided_last(DType::f16, {2, 7, 2, 24}, 2, s + 3);
  Tensor o2 = strided_last(DType::f16, {2, 5, 4, 24}, 2, s + 4);
  Tensor dq2 = strided_last(DType::f16, {2, 5, 4, 16}, 2, s + 5);
  Tensor dk2 = strided_last(DType::f16, {2, 7, 2, 16}, 2, s + 6);
  Tensor dv2 = strided_last(DType::f16, {2, 7, 2, 24}, 2, s + 7);
  fwd([&](FwdCase& c) { c.in.q = q2.tv(); }, "q");
  fwd([&](FwdCase& c) { c.in.k = k2.tv(); }, "k");
  fwd([&](FwdCase& c) { c.in.v = v2.tv(); }, "v");
  fwd([&](FwdCase& c) { c.out.out = o2.tv(); }, "out");
  auto bwd = [&](auto mutate, const std::string& arg) {
    BwdCase c;
    mutate(c);
    SCOPED_TRACE(arg);
    EXPECT_REJECTED(c, kBwd, arg, {"last dimension must be contiguous"}, {"stride 1"}, "stride 2");
  };
  bwd([&](BwdCase& c) { c.in.dout = o2.tv(); }, "dout");
  bwd([&](BwdCase& c) { c.in.out = o2.tv(); }, "out");
  bwd([&](BwdCase& c) { c.out.dq = dq2.tv(); }, "dq");
  bwd([&](BwdCase& c) { c.out.dk = dk2.tv(); }, "dk");
  bwd([&](BwdCase& c) { c.out.dv = dv2.tv(); }, "dv");
  // KV cache tensors, the new rows, the rotary tables and the page table.
  Tensor kc2 = strided_last(DType::f16, {2, 12, 2, 32}, 2, s + 8);
  Tensor vn2 = strided_last(DType::f16, {2, 2, 2, 16}, 2, s + 9);
  Tensor cos2 = strided_last(DType::f16, {12, 8}, 2, s + 10);
  Tensor bt2 = strided_last(DType::i32, {2, 3}, 2, s + 11);
  auto kv = [&](auto mutate, const std::string& arg, KvCase::Kind kind = KvCase::dense) {
    KvCase c(kind, true);
    mutate(c);
    SCOPED_TRACE(arg);
    EXPECT_REJECTED(c, kKv, arg, {"last dimension must be contiguous"}, {"stride 1"}, "stride 2");
  };
  kv([&](KvCase& c) { c.in.k_cache = kc2.tv(); }, "k_cache");
  kv([&](KvCase& c) { c.in.v_new = vn2.tv(); }, "v_new");
  kv([&](KvCase& c) { c.in.rotary_cos = cos2.tv(); }, "rotary_cos");
  kv([&](KvCase& c) { c.in.block_table = bt2.tv(); }, "block_table", KvCase::paged);
  // ALiBi slopes (b, h) with a strided last dimension.
  {
    AttnConfig cfg = dense_cfg();
    cfg.alibi = Alibi::per_batch_head;
    FwdCase c(cfg);
    Tensor a2 = strided_last(DType::f32, {2, 4}, 2, s + 12);
    c.opt.alibi_slopes = a2.tv();
    EXPECT_REJECTED(c, kFwd, "alibi_slopes", {"last dimension must be contiguous"}, {"stride 1"}, "stride 2");
  }
  CombineCase cp;
  Tensor op2 = strided_last(DType::f32, {3, 2, 4, 2, 8}, 2, s + 13);
  cp.in.out_partial = op2.tv();
  EXPECT_COMBINE_REJECTED(cp, kComb, "out_partial", {"last dimension must be contiguous"}, {"stride 1"}, "stride 2");
  CombineCase co;
  Tensor out2 = strided_last(DType::f16, {2, 4, 2, 8}, 3, s + 14);
  co.outs.out = out2.tv();
  EXPECT_COMBINE_REJECTED(co, kComb, "out", {"last dimension must be contiguous"}, {"stride 1"}, "stride 3");
}

TEST(ValidationStrides, LseLikeAndIndexTensorsMustBeContiguous) {
  // lse (2, 4, 5) stored as (2, 5, 4): a permuted, non-row-major view of the same size.
  Tensor lse_t(DType::f32, {2, 5, 4});
  const fa::TensorView permuted = Tensor(lse_t).view(0, {2, 4, 5}, {20, 1, 4}).tv();
  {
    FwdCase c;
    c.out.lse = permuted;
    EXPECT_REJECTED(c, kFwd, "lse", {"must be contiguous"}, {"strides ("}, "strides (");
  }
  {
    BwdCase c;
    c.out.softmax_d = permuted;
    EXPECT_REJECTED(c, kBwd, "softmax_d", {"must be contiguous"}, {"strides ("}, "strides (");
  }
  {
    FwdCase c(varlen_cfg());
    Tensor cu = Tensor::with_strides(DType::i32, {4}, {2});
    for (int i = 0; i < 4; ++i) cu.set({i}, float(std::vector<int>{0, 4, 10, 11}[std::size_t(i)]));
    c.in.varlen.cu_seqlens_k = cu.tv();
    EXPECT_REJECTED(c, kFwd, "varlen.cu_seqlens_k", {"must be contiguous"}, {"strides ("}, "strides (");
  }
  {
    KvCase c;
    Tensor sl = Tensor::with_strides(DType::i32, {2}, {3});
    sl.set({0}, 3.0f);
    sl.set({1}, 5.0f);
    c.in.cache_seqlens = sl.tv();
    EXPECT_REJECTED(c, kKv, "cache_seqlens", {"must be contiguous"}, {"strides ("}, "strides (");
  }
  {
    CombineCase c;
    Tensor lp(DType::f32, {3, 2, 4, 2});
    lp.fill_random(test_seed(3), 0.0f, 1.0f);
    c.in.lse_partial = lp.view(0, {3, 2, 2, 4}, {16, 8, 1, 2}).tv();
    EXPECT_COMBINE_REJECTED(c, kComb, "lse_partial", {"must be contiguous"}, {"strides ("}, "strides (");
  }
}

// ================================================================================================
// Shapes
// ================================================================================================

TEST(ValidationShape, BatchMustBePositive) {
  FwdCase c;
  for (fa::TensorView* t : {&c.in.q, &c.in.k, &c.in.v, &c.out.out, &c.out.lse}) *t = resized(*t, 0, 0);
  EXPECT_REJECTED(c, kFwd, "q", {"batch size must be positive"}, {"1"}, "0");
  BwdCase b;
  for (fa::TensorView* t : {&b.in.dout, &b.in.q, &b.in.k, &b.in.v, &b.in.out, &b.in.lse, &b.out.dq,
                            &b.out.dk, &b.out.dv, &b.out.softmax_d})
    *t = resized(*t, 0, 0);
  EXPECT_REJECTED(b, kBwd, "q", {"batch size must be positive"}, {"1"}, "0");
  KvCase kv;
  for (fa::TensorView* t : {&kv.in.q, &kv.in.k_new, &kv.in.v_new, &kv.in.cache_seqlens, &kv.outs.out, &kv.outs.lse})
    *t = resized(*t, 0, 0);
  EXPECT_REJECTED(kv, kKv, "q", {"batch size must be positive"}, {"1"}, "0");
}

TEST(ValidationShape, HeadsMustBePositive) {
  FwdCase c;
  c.in.q = resized(c.in.q, 2, 0);
  c.out.out = resized(c.out.out, 2, 0);
  c.out.lse = resized(c.out.lse, 1, 0);
  EXPECT_REJECTED(c, kFwd, "q", {"number of heads must be positive"}, {"1"}, "0");
  FwdCase k;
  k.in.k = resized(k.in.k, 2, 0);
  k.in.v = resized(k.in.v, 2, 0);
  EXPECT_REJECTED(k, kFwd, "k", {"number of heads must be positive"}, {"1"}, "0");
  KvCase kv;
  for (fa::TensorView* t : {&kv.in.k_cache, &kv.in.v_cache, &kv.in.k_new, &kv.in.v_new}) *t = resized(*t, 2, 0);
  EXPECT_REJECTED(kv, kKv, "k_cache", {"number of heads must be positive"}, {"1"}, "0");
}

TEST(ValidationShape, HeadDimMultipleOf8AndAtMost256) {
  struct Bad {
    int d, dv;
    const char* arg;
    const char* got;
  };
  for (const Bad& bad : {Bad{12, 24, "q", "12"}, Bad{264, 24, "q", "264"}, Bad{0, 24, "q", "0"},
                         Bad{4, 24, "q", "4"}, Bad{16, 20, "v", "20"}, Bad{16, 264, "v", "264"},
                         Bad{16, 0, "v", "0"}}) {
    SCOPED_TRACE("d=" + std::to_string(bad.d) + " dv=" + std::to_string(bad.dv));
    AttnConfig cfg = dense_cfg();
    cfg.head_dim = bad.d;
    cfg.head_dim_v = bad.dv;
    if (bad.dv == 0) {  // AttnConfig reads dv = 0 as "= d": build dv = 0 by hand
      FwdCase c(dense_cfg());
      c.in.v = resized(c.in.v, 3, 0);
      c.out.out = resized(c.out.out, 3, 0);
      EXPECT_REJECTED(c, kFwd, bad.arg, {"head dimension", "multiple of 8", "256"}, {"8, 16"}, bad.got);
      continue;
    }
    FwdCase c(cfg);
    EXPECT_REJECTED(c, kFwd, bad.arg, {"head dimension", "multiple of 8", "256"}, {"8, 16"}, bad.got);
    BwdCase b(dense_cfg());
    // Backward applies the same rule (shapes set by hand; nothing is read).
    for (fa::TensorView* t : {&b.in.q, &b.in.k, &b.out.dq, &b.out.dk}) *t = resized(*t, 3, bad.d);
    for (fa::TensorView* t : {&b.in.v, &b.in.dout, &b.in.out, &b.out.dv}) *t = resized(*t, 3, bad.dv);
    if (bad.d <= 16 && bad.dv <= 24) EXPECT_REJECTED(b, kBwd, bad.arg, {"head dimension"}, {"8, 16"}, bad.got);
  }
  KvCase kv;
  kv.in.q = resized(kv.in.q, 3, 24);  // 24 is fine...
  kv.in.v_cache = resized(kv.in.v_cache, 3, 12);  // ... 12 is not
  EXPECT_REJECTED(kv, kKv, "v_cache", {"head dimension"}, {"8, 16"}, "12");
  KvCase kq;
  kq.in.q = resized(kq.in.q, 3, 20);
  EXPECT_REJECTED(kq, kKv, "q", {"head dimension"}, {"8, 16"}, "20");
}

TEST(ValidationShape, QueryHeadsDivisibleByKeyHeads) {
  AttnConfig cfg = dense_cfg();
  cfg.heads = 4;
  cfg.heads_k = 3;
  FwdCase c(cfg);
  EXPECT_REJECTED(c, kFwd, "k", {"must divide"}, {"a divisor of 4"}, "3");
  BwdCase b(dense_cfg());
  b.in.q = resized(b.in.q, 2, 3);
  b.in.dout = resized(b.in.dout, 2, 3);
  b.in.out = resized(b.in.out, 2, 3);
  b.in.lse = resized(b.in.lse, 1, 3);
  b.out.dq = resized(b.out.dq, 2, 3);
  b.out.softmax_d = resized(b.out.softmax_d, 1, 3);
  EXPECT_REJECTED(b, kBwd, "k", {"must divide"}, {"a divisor of 3"}, "2");
  KvCase kv;
  kv.in.q = resized(kv.in.q, 2, 3);
  kv.outs.out = resized(kv.outs.out, 2, 3);
  kv.outs.lse = resized(kv.outs.lse, 1, 3);
  EXPECT_REJECTED(kv, kKv, "k_cache", {"must divide"}, {"a divisor of 3"}, "2");
}

TEST(ValidationShape, InputsRankFourOrVarlenThree) {
  FwdCase c;
  c.in.k.ndim = 3;
  EXPECT_REJECTED(c, kFwd, "k", {"(batch, seqlen, heads, head_dim)"}, {"rank 4"}, "rank 3");
  FwdCase v(varlen_cfg());
  Tensor q4 = random_tensor(DType::f16, {1, 10, 4, 16}, test_seed(5));
  v.in.q = q4.tv();
  EXPECT_REJECTED(v, kFwd, "q", {"varlen tensors are (total, heads, head_dim)"}, {"rank 3"}, "rank 4");
  KvCase kv;
  kv.in.k_cache.ndim = 3;
  EXPECT_REJECTED(kv, kKv, "k_cache", {"4-dimensional"}, {"rank 4"}, "rank 3");
  KvCase kn;
  kn.in.k_new.ndim = 3;
  EXPECT_REJECTED(kn, kKv, "k_new", {"wrong rank"}, {"rank 4"}, "rank 3");
}

TEST(ValidationShape, EveryTensorHasExactlyItsShape) {
  auto fwd = [](auto mutate, const std::string& arg, const std::string& expected, const std::string& got,
                const AttnConfig& cfg = dense_cfg()) {
    FwdCase c(cfg);
    mutate(c);
    SCOPED_TRACE(arg + " " + got);
    EXPECT_REJECTED(c, kFwd, arg, {"wrong shape"}, {expected}, got);
  };
  fwd([](FwdCase& c) { c.in.k = resized(c.in.k, 0, 1); }, "k", "(2, 7, 2, 16)", "(1, 7, 2, 16)");
  fwd([](FwdCase& c) { c.in.k = resized(c.in.k, 3, 8); }, "k", "(2, 7, 2, 16)", "(2, 7, 2, 8)");
  fwd([](FwdCase& c) { c.in.v = resized(c.in.v, 1, 6); }, "v", "(2, 7, 2, 24)", "(2, 6, 2, 24)");
  fwd([](FwdCase& c) { c.in.v = resized(c.in.v, 2, 1); }, "v", "(2, 7, 2, 24)", "(2, 7, 1, 24)");
  fwd([](FwdCase& c) { c.out.out = resized(c.out.out, 3, 16); }, "out", "(2, 5, 4, 24)", "(2, 5, 4, 16)");
  fwd([](FwdCase& c) { c.out.out = resized(c.out.out, 1, 4); }, "out", "(2, 5, 4, 24)", "(2, 4, 4, 24)");
  fwd([](FwdCase& c) { c.out.out.ndim = 3; }, "out", "(2, 5, 4, 24)", "(2, 5, 4)");
  fwd([](FwdCase& c) { c.out.lse = resized(c.out.lse, 2, 4); }, "lse", "(2, 4, 5)", "(2, 4, 4)");
  fwd([](FwdCase& c) { c.out.lse.ndim = 2; }, "lse", "(2, 4, 5)", "(2, 4)");
  // varlen: k/v (total_k, hk, d), out (total_q, h, dv), lse (h, total_q)
  fwd([](FwdCase& c) { c.in.k = resized(c.in.k, 2, 8); }, "k", "(11, 2, 16)", "(11, 2, 8)", varlen_cfg());
  fwd([](FwdCase& c) { c.in.v = resized(c.in.v, 0, 10); }, "v", "(11, 2, 24)", "(10, 2, 24)", varlen_cfg());
  fwd([](FwdCase& c) { c.out.out = resized(c.out.out, 0, 9); }, "out", "(10, 4, 24)", "(9, 4, 24)", varlen_cfg());
  {
    FwdCase c(varlen_cfg());
    Tensor dense_lse(DType::f32, {3, 4, 5});
    c.out.lse = dense_lse.tv();
    EXPECT_REJECTED(c, kFwd, "lse", {"wrong shape"}, {"(4, 10)"}, "(3, 4, 5)");
  }
  auto bwd = [](auto mutate, const std::string& arg, const std::string& expected, const std::string& got,
                const AttnConfig& cfg = dense_cfg()) {
    BwdCase c(cfg);
    mutate(c);
    SCOPED_TRACE(arg + " " + got);
    EXPECT_REJECTED(c, kBwd, arg, {"wrong shape"}, {expected}, got);
  };
  bwd([](BwdCase& c) { c.in.dout = resized(c.in.dout, 3, 16); }, "dout", "(2, 5, 4, 24)", "(2, 5, 4, 16)");
  bwd([](BwdCase& c) { c.in.out = resized(c.in.out, 1, 3); }, "out", "(2, 5, 4, 24)", "(2, 3, 4, 24)");
  bwd([](BwdCase& c) { c.in.lse = resized(c.in.lse, 1, 2); }, "lse", "(2, 4, 5)", "(2, 2, 5)");
  bwd([](BwdCase& c) { c.out.dq = resized(c.out.dq, 3, 8); }, "dq", "(2, 5, 4, 16)", "(2, 5, 4, 8)");
  bwd([](BwdCase& c) { c.out.dk = resized(c.out.dk, 1, 6); }, "dk", "(2, 7, 2, 16)", "(2, 6, 2, 16)");
  bwd([](BwdCase& c) { c.out.dv = resized(c.out.dv, 3, 16); }, "dv", "(2, 7, 2, 24)", "(2, 7, 2, 16)");
  bwd([](BwdCase& c) { c.out.softmax_d = resized(c.out.softmax_d, 2, 4); }, "softmax_d", "(2, 4, 5)", "(2, 4, 4)");
  bwd([](BwdCase& c) { c.out.dk = resized(c.out.dk, 0, 10); }, "dk", "(11, 2, 16)", "(10, 2, 16)", varlen_cfg());
  bwd([](BwdCase& c) { c.out.softmax_d = resized(c.out.softmax_d, 1, 9); }, "softmax_d", "(4, 10)", "(4, 9)",
      varlen_cfg());
  auto kv = [](auto mutate, const std::string& arg, const std::string& expected, const std::string& got,
               bool rotary = false) {
    KvCase c(KvCase::dense, rotary);
    mutate(c);
    SCOPED_TRACE(arg + " " + got);
    EXPECT_REJECTED(c, kKv, arg, {"wrong shape"}, {expected}, got);
  };
  kv([](KvCase& c) { c.in.k_cache = resized(c.in.k_cache, 3, 16); }, "k_cache", "(2, 12, 2, 32)", "(2, 12, 2, 16)");
  kv([](KvCase& c) { c.in.v_cache = resized(c.in.v_cache, 1, 10); }, "v_cache", "(2, 12, 2, 16)", "(2, 10, 2, 16)");
  kv([](KvCase& c) { c.in.k_new = resized(c.in.k_new, 3, 16); }, "k_new", "(2, 2, 2, 32)", "(2, 2, 2, 16)");
  kv([](KvCase& c) { c.in.v_new = resized(c.in.v_new, 1, 1); }, "v_new", "(2, 2, 2, 16)", "(2, 1, 2, 16)");
  kv([](KvCase& c) { c.in.k_new = resized(c.in.k_new, 0, 1); }, "k_new", "(2, 2, 2, 32)", "(1, 2, 2, 32)");
  kv([](KvCase& c) { c.outs.out = resized(c.outs.out, 3, 8); }, "out", "(2, 3, 4, 16)", "(2, 3, 4, 8)");
  kv([](KvCase& c) { c.outs.lse = resized(c.outs.lse, 2, 2); }, "lse", "(2, 4, 3)", "(2, 4, 2)");
  kv([](KvCase& c) { c.in.rotary_sin = resized(c.in.rotary_sin, 0, 11); }, "rotary_sin", "(12, 8)", "(11, 8)", true);
  {
    KvCase c(KvCase::dense, true);
    c.in.rotary_cos.ndim = 1;
    c.in.rotary_sin.ndim = 1;
    EXPECT_REJECTED(c, kKv, "rotary_cos", {"wrong rank"}, {"(seqlen_ro, rotary_dim / 2)"}, "(12)");
  }
}

TEST(ValidationShape, SequenceLengthsBelow2Pow30) {
  // q of 2^30 + 1 rows, all aliasing one row (stride 0): nothing may be read.
  FwdCase c;
  const std::int64_t n = (std::int64_t(1) << 30) + 1;
  for (fa::TensorView* t : {&c.in.q, &c.in.k, &c.in.v}) *t = resized(*t, 0, 1);
  c.in.q.shape[1] = n;
  c.in.q.stride[1] = 0;
  EXPECT_REJECTED(c, kFwd, "q", {"sequence lengths", "2^30"}, {"2^30"}, std::to_string(n));
}

// ================================================================================================
// ALiBi slopes
// ================================================================================================

TEST(ValidationAlibi, SlopesMustBeFp32) {
  AttnConfig cfg = dense_cfg();
  cfg.alibi = Alibi::per_head;
  FwdCase c(cfg);
  Tensor half = random_tensor(DType::f16, {4}, test_seed(1), 0.1f, 0.5f);
  c.opt.alibi_slopes = half.tv();
  EXPECT_REJECTED(c, kFwd, "alibi_slopes", {"fp32"}, {"f32"}, "f16");
}

TEST(ValidationAlibi, SlopesShapeHeadsOrBatchHeads) {
  const std::uint64_t s = test_seed(2);
  for (const Shape& shape : {Shape{5}, Shape{4, 2}, Shape{3, 4}, Shape{1, 4}, Shape{2, 4, 1}, Shape{8}}) {
    Tensor a = random_tensor(DType::f32, shape, s, 0.1f, 0.5f);
    SCOPED_TRACE(fa::shape_string(a.tv()));
    FwdCase c;
    c.opt.alibi_slopes = a.tv();
    EXPECT_REJECTED(c, kFwd, "alibi_slopes", {"wrong shape"}, {"(4) or (2, 4)"}, fa::shape_string(a.tv()));
    BwdCase b;
    b.opt.alibi_slopes = a.tv();
    EXPECT_REJECTED(b, kBwd, "alibi_slopes", {"wrong shape"}, {"(4) or (2, 4)"}, fa::shape_string(a.tv()));
  }
  // varlen: b is the number of sequences (3)
  Tensor a = random_tensor(DType::f32, {2, 4}, s + 1, 0.1f, 0.5f);
  FwdCase v(varlen_cfg());
  v.opt.alibi_slopes = a.tv();
  EXPECT_REJECTED(v, kFwd, "alibi_slopes", {"wrong shape"}, {"(4) or (3, 4)"}, "(2, 4)");
  KvCase kv;
  Tensor ak = random_tensor(DType::f32, {2}, s + 2, 0.1f, 0.5f);
  kv.opt.alibi_slopes = ak.tv();
  EXPECT_REJECTED(kv, kKv, "alibi_slopes", {"wrong shape"}, {"(4) or (2, 4)"}, "(2)");
  // The two valid shapes are accepted and computed (checked against the fp64 reference).
  for (Alibi al : {Alibi::per_head, Alibi::per_batch_head}) {
    AttnConfig cfg = varlen_cfg();
    cfg.alibi = al;
    FwdCase ok(cfg);
    EXPECT_NO_THROW(ok.call());
    EXPECT_TRUE(check_forward(ok.p, ok.r));
  }
}

// ================================================================================================
// Options
// ================================================================================================

TEST(ValidationOptions, DropoutProbabilityInZeroToOne) {
  struct Bad {
    float p;
    const char* got;
  };
  for (const Bad& bad : {Bad{-0.1f, "-0.1"}, Bad{1.0f, "1.0"}, Bad{1.5f, "1.5"}, Bad{kNaN, "nan"}, Bad{kInf, "inf"}}) {
    SCOPED_TRACE(bad.got);
    FwdCase c;
    c.opt.dropout_p = bad.p;
    EXPECT_REJECTED(c, kFwd, "options.dropout_p", {"dropout probability", "[0, 1)"}, {"p < 1"}, bad.got);
    BwdCase b;
    b.opt.dropout_p = bad.p;
    EXPECT_REJECTED(b, kBwd, "options.dropout_p", {"dropout probability", "[0, 1)"}, {"p < 1"}, bad.got);
  }
  // The boundary 0 and values just below 1 are valid.
  for (float p : {0.0f, 0.999f}) {
    FwdCase c;
    c.opt.dropout_p = p;
    c.p.opt.dropout_p = p;
    EXPECT_NO_THROW(c.call()) << p;
    EXPECT_TRUE(check_forward(c.p, c.r)) << p;
  }
}

TEST(ValidationOptions, SoftcapFiniteAndNonNegative) {
  for (float cap : {-1.0f, -1e-6f, kInf, kNaN}) {
    SCOPED_TRACE(std::to_string(cap));
    FwdCase c;
    c.opt.softcap = cap;
    EXPECT_REJECTED(c, kFwd, "options.softcap", {"softcap", "finite"}, {"0"}, std::isnan(cap) ? "nan" : std::to_string(cap));
  }
}

TEST(ValidationOptions, SoftmaxScaleFiniteAndNonNegative) {
  for (float scale : {-0.5f, kInf, -kInf, kNaN}) {
    SCOPED_TRACE(std::to_string(scale));
    FwdCase c;
    c.opt.softmax_scale = scale;
    EXPECT_REJECTED(c, kFwd, "options.softmax_scale", {"softmax_scale", "finite"}, {"0"},
                    std::isnan(scale) ? "nan" : std::to_string(scale));
  }
}

TEST(ValidationOptions, WindowSizesAtLeastMinusOne) {
  for (int w : {-2, -1000}) {
    FwdCase l;
    l.opt.window_left = w;
    EXPECT_REJECTED(l, kFwd, "options.window_left", {"window"}, {"−1", "-1"}, std::to_string(w));
    FwdCase r;
    r.opt.window_right = w;
    EXPECT_REJECTED(r, kFwd, "options.window_right", {"window"}, {"−1", "-1"}, std::to_string(w));
    KvCase kv;
    kv.opt.window_right = w;
    EXPECT_REJECTED(kv, kKv, "options.window_right", {"window"}, {"−1", "-1"}, std::to_string(w));
  }
}

TEST(ValidationOptions, NumThreadsNonNegative) {
  FwdCase c;
  c.opt.num_threads = -1;
  EXPECT_REJECTED(c, kFwd, "options.num_threads", {"thread count"}, {"0"}, "-1");
  BwdCase b;
  b.opt.num_threads = -3;
  EXPECT_REJECTED(b, kBwd, "options.num_threads", {"thread count"}, {"0"}, "-3");
}

TEST(ValidationOptions, NumSplitsNonNegative) {
  FwdCase c;
  c.opt.num_splits = -2;
  EXPECT_REJECTED(c, kFwd, "options.num_splits", {"split count"}, {"0"}, "-2");
  KvCase kv;
  kv.opt.num_splits = -1;
  EXPECT_REJECTED(kv, kKv, "options.num_splits", {"split count"}, {"0"}, "-1");
}

// ================================================================================================
// Varlen index tensors
// ================================================================================================

TEST(ValidationVarlen, CuSeqlensKRequired) {
  FwdCase c(varlen_cfg());
  c.in.varlen.cu_seqlens_k = {};
  EXPECT_REJECTED(c, kFwd, "varlen.cu_seqlens_k", {"is required"}, {"a tensor"}, "none");
}

TEST(ValidationVarlen, CuSeqlensLengthBatchPlusOne) {
  Tensor one = Tensor::from_i32({0});
  FwdCase c(varlen_cfg());
  c.in.varlen.cu_seqlens_q = one.tv();
  EXPECT_REJECTED(c, kFwd, "varlen.cu_seqlens_q", {"batch + 1"}, {"(b + 1)"}, "(1)");
  Tensor two_d = i32_matrix({{0, 3, 8, 10}});
  FwdCase r(varlen_cfg());
  r.in.varlen.cu_seqlens_q = two_d.tv();
  EXPECT_REJECTED(r, kFwd, "varlen.cu_seqlens_q", {"batch + 1"}, {"(b + 1)"}, "(1, 4)");
  Tensor short_k = Tensor::from_i32({0, 4, 10});
  FwdCase k(varlen_cfg());
  k.in.varlen.cu_seqlens_k = short_k.tv();
  EXPECT_REJECTED(k, kFwd, "varlen.cu_seqlens_k", {"wrong shape"}, {"(4)"}, "(3)");
  Tensor used = Tensor::from_i32({4, 6});
  FwdCase u(varlen_cfg());
  u.in.varlen.seqused_k = used.tv();
  EXPECT_REJECTED(u, kFwd, "varlen.seqused_k", {"wrong shape"}, {"(3)"}, "(2)");
}

TEST(ValidationVarlen, MaxSeqlenNonNegative) {
  FwdCase c(varlen_cfg());
  c.in.varlen.max_seqlen_q = -1;
  EXPECT_REJECTED(c, kFwd, "varlen.max_seqlen_q", {"must be"}, {"0"}, "-1");
  FwdCase k(varlen_cfg());
  k.in.varlen.max_seqlen_k = -5;
  EXPECT_REJECTED(k, kFwd, "varlen.max_seqlen_k", {"must be"}, {"0"}, "-5");
}

TEST(ValidationVarlen, CuSeqlensStartAtZero) {
  Tensor cq = Tensor::from_i32({1, 3, 8, 10});
  FwdCase c(varlen_cfg());
  c.in.varlen.cu_seqlens_q = cq.tv();
  EXPECT_REJECTED(c, kFwd, "varlen.cu_seqlens_q", {"start at 0"}, {"0"}, "1");
  Tensor ck = Tensor::from_i32({2, 4, 10, 11});
  BwdCase b(varlen_cfg());
  b.in.varlen.cu_seqlens_k = ck.tv();
  EXPECT_REJECTED(b, kBwd, "varlen.cu_seqlens_k", {"start at 0"}, {"0"}, "2");
}

TEST(ValidationVarlen, CuSeqlensNonDecreasing) {
  Tensor cq = Tensor::from_i32({0, 5, 3, 10});
  FwdCase c(varlen_cfg());
  c.in.varlen.cu_seqlens_q = cq.tv();
  EXPECT_REJECTED(c, kFwd, "varlen.cu_seqlens_q", {"non-decreasing"}, {"5"}, "3");
  Tensor ck = Tensor::from_i32({0, 4, 3, 11});
  FwdCase k(varlen_cfg());
  k.in.varlen.cu_seqlens_k = ck.tv();
  k.in.varlen.max_seqlen_k = 8;
  EXPECT_REJECTED(k, kFwd, "varlen.cu_seqlens_k", {"non-decreasing"}, {"4"}, "3");
}

TEST(ValidationVarlen, LastPrefixSumAtMostTotal) {
  Tensor ck = Tensor::from_i32({0, 4, 10, 12});
  FwdCase c(varlen_cfg());
  c.in.varlen.cu_seqlens_k = ck.tv();
  EXPECT_REJECTED(c, kFwd, "varlen.cu_seqlens_k", {"exceeds the packed rows"}, {"11"}, "12");
  Tensor cq = Tensor::from_i32({0, 3, 8, 11});
  BwdCase b(varlen_cfg());
  b.in.varlen.cu_seqlens_q = cq.tv();
  EXPECT_REJECTED(b, kBwd, "varlen.cu_seqlens_q", {"exceeds the packed rows"}, {"10"}, "11");
}

TEST(ValidationVarlen, MaxSeqlenAtLeastEveryLength) {
  FwdCase c(varlen_cfg());
  c.in.varlen.max_seqlen_q = 4;  // sequence 1 has 5 queries
  EXPECT_REJECTED(c, kFwd, "varlen.max_seqlen_q", {"every sequence's length"}, {"5"}, "4");
  FwdCase k(varlen_cfg());
  k.in.varlen.max_seqlen_k = 5;  // sequence 1 has 6 keys
  EXPECT_REJECTED(k, kFwd, "varlen.max_seqlen_k", {"every sequence's length"}, {"6"}, "5");
}

TEST(ValidationVarlen, SequsedKWithinEachSequence) {
  AttnConfig cfg = varlen_cfg();
  cfg.seqused_k = {4, 6, 1};
  Tensor over = Tensor::from_i32({4, 7, 1});
  FwdCase c(cfg);
  c.in.varlen.seqused_k = over.tv();
  EXPECT_REJECTED(c, kFwd, "varlen.seqused_k", {"entry 1"}, {"6"}, "7");
  Tensor neg = Tensor::from_i32({-1, 2, 1});
  FwdCase n(cfg);
  n.in.varlen.seqused_k = neg.tv();
  EXPECT_REJECTED(n, kFwd, "varlen.seqused_k", {"entry 0"}, {"4"}, "-1");
}

// ================================================================================================
// KV cache
// ================================================================================================

TEST(ValidationKVCache, CacheBatchMustMatchWithoutBatchIdx) {
  KvCase c;
  c.in.k_cache = resized(c.in.k_cache, 0, 1);
  c.in.v_cache = resized(c.in.v_cache, 0, 1);
  EXPECT_REJECTED(c, kKv, "k_cache", {"batch of the cache", "cache_batch_idx"}, {"2"}, "1");
}

TEST(ValidationKVCache, KNewAndVNewTogether) {
  KvCase c;
  c.in.v_new = {};
  EXPECT_REJECTED(c, kKv, "v_new", {"k_new and v_new must be given together"}, {"both or neither"}, "one");
  KvCase v;
  v.in.k_new = {};
  EXPECT_REJECTED(v, kKv, "k_new", {"k_new and v_new must be given together"}, {"both or neither"}, "one");
}

TEST(ValidationKVCache, KNewNeedsCacheSeqlens) {
  KvCase c;
  c.in.cache_seqlens = {};
  EXPECT_REJECTED(c, kKv, "cache_seqlens", {"is required", "k_new"}, {"int32"}, "none");
}

TEST(ValidationKVCache, CacheSeqlensShape) {
  KvCase c;
  Tensor three = Tensor::from_i32({3, 5, 1});
  c.in.cache_seqlens = three.tv();
  EXPECT_REJECTED(c, kKv, "cache_seqlens", {"wrong shape"}, {"(2)"}, "(3)");
  KvCase i(KvCase::indexed);
  Tensor one = Tensor::from_i32({2});
  i.in.cache_batch_idx = one.tv();
  EXPECT_REJECTED(i, kKv, "cache_batch_idx", {"wrong shape"}, {"(2)"}, "(1)");
}

TEST(ValidationKVCache, CacheBatchIdxNotWithBlockTable) {
  KvCase c(KvCase::paged);
  Tensor idx = Tensor::from_i32({0, 1});
  c.in.cache_batch_idx = idx.tv();
  EXPECT_REJECTED(c, kKv, "cache_batch_idx", {"paged cache", "block_table"}, {"none"}, "a tensor");
}

TEST(ValidationKVCache, BlockTableShape) {
  KvCase c(KvCase::paged);
  Tensor bt = i32_matrix({{5, 0, 3}, {1, 6, 2}, {4, 4, 4}});
  c.in.block_table = bt.tv();
  EXPECT_REJECTED(c, kKv, "block_table", {"wrong shape"}, {"(2, max_blocks_per_seq)"}, "(3, 3)");
  KvCase r(KvCase::paged);
  Tensor flat = Tensor::from_i32({5, 0, 3, 1, 6, 2});
  r.in.block_table = flat.tv();
  EXPECT_REJECTED(r, kKv, "block_table", {"wrong shape"}, {"(2, max_blocks_per_seq)"}, "(6)");
}

TEST(ValidationKVCache, BlockTableEntriesArePages) {
  for (int bad : {7, 100, -1}) {
    SCOPED_TRACE(bad);
    KvCase c(KvCase::paged);
    c.block_table.set({1, 1}, float(bad));  // sequence 1 holds 5 + 2 keys: pages 0 and 1 are used
    EXPECT_REJECTED(c, kKv, "block_table", {"entry (1, 1)", "not a page"}, {"7"}, std::to_string(bad));
  }
}

TEST(ValidationKVCache, PageSizePositive) {
  KvCase c(KvCase::paged);
  c.in.k_cache = resized(c.in.k_cache, 1, 0);
  c.in.v_cache = resized(c.in.v_cache, 1, 0);
  EXPECT_REJECTED(c, kKv, "k_cache", {"page size"}, {"1"}, "0");
}

TEST(ValidationKVCache, CacheSeqlensPlusNewFitTheCache) {
  for (KvCase::Kind kind : {KvCase::dense, KvCase::paged, KvCase::indexed}) {
    SCOPED_TRACE(int(kind));
    KvCase c(kind);
    c.seqlens.set({1}, 11.0f);  // 11 + 2 new > 12
    EXPECT_REJECTED(c, kKv, "cache_seqlens", {"entry 1", "fit the cache"}, {"10"}, "11");
    KvCase n(kind);
    n.seqlens.set({0}, -1.0f);
    EXPECT_REJECTED(n, kKv, "cache_seqlens", {"entry 0", "fit the cache"}, {"10"}, "-1");
  }
  // Without new keys the whole capacity may be used, but no more.
  KvCase c;
  c.in.k_new = {};
  c.in.v_new = {};
  c.seqlens.set({1}, 13.0f);
  EXPECT_REJECTED(c, kKv, "cache_seqlens", {"entry 1", "fit the cache"}, {"12"}, "13");
}

TEST(ValidationKVCache, CacheBatchIdxInRange) {
  for (int bad : {3, -1}) {
    KvCase c(KvCase::indexed);
    c.batch_idx.set({1}, float(bad));
    EXPECT_REJECTED(c, kKv, "cache_batch_idx", {"entry 1", "out of range"}, {"3"}, std::to_string(bad));
  }
}

TEST(ValidationKVCache, RotaryCosAndSinTogether) {
  KvCase c(KvCase::dense, true);
  c.in.rotary_sin = {};
  EXPECT_REJECTED(c, kKv, "rotary_sin", {"rotary_cos and rotary_sin must be given together"}, {"both"}, "one");
  KvCase s(KvCase::dense, true);
  s.in.rotary_cos = {};
  EXPECT_REJECTED(s, kKv, "rotary_cos", {"rotary_cos and rotary_sin must be given together"}, {"both"}, "one");
}

TEST(ValidationKVCache, RotaryDimMultipleOf16AndAtMostD) {
  for (std::int64_t half : {4, 12, 24, 0}) {  // rotary_dim 8, 24 (not multiples of 16), 48 > d, 0
    SCOPED_TRACE(half);
    KvCase c(KvCase::dense, true);
    Tensor cos = random_tensor(DType::f16, {12, half}, test_seed(7));
    Tensor sin = random_tensor(DType::f16, {12, half}, test_seed(8));
    c.in.rotary_cos = cos.tv();
    c.in.rotary_sin = sin.tv();
    EXPECT_REJECTED(c, kKv, "rotary_cos", {"rotary_dim", "multiple of 16", "at most d"}, {"32"},
                    std::to_string(2 * half));
  }
}

TEST(ValidationKVCache, RotaryNeedsCacheSeqlens) {
  KvCase c(KvCase::dense, true);
  c.in.k_new = {};
  c.in.v_new = {};
  c.in.cache_seqlens = {};
  EXPECT_REJECTED(c, kKv, "cache_seqlens", {"is required", "rotary"}, {"int32"}, "none");
}

TEST(ValidationKVCache, RotaryTableCoversEveryPosition) {
  // cache_seqlens [3, 5], seqlen_q 3, 2 new keys: positions up to 5 + 3 − 1 are rotated.
  KvCase c(KvCase::dense, true);
  c.in.rotary_cos = resized(c.in.rotary_cos, 0, 7);
  c.in.rotary_sin = resized(c.in.rotary_sin, 0, 7);
  EXPECT_REJECTED(c, kKv, "rotary_cos", {"cover every rotated position", "cache_seqlens[1]"}, {"8"}, "7");
  KvCase ok(KvCase::dense, true);  // exactly 8 rows suffice
  ok.in.rotary_cos = resized(ok.in.rotary_cos, 0, 8);
  ok.in.rotary_sin = resized(ok.in.rotary_sin, 0, 8);
  EXPECT_TRUE(ok.support().ok) << ok.support().reason;
}

// A late error (the options are checked last) after every tensor of a call that appends: the
// caches must be untouched, since appending happens only after validation.
TEST(ValidationKVCache, LateErrorLeavesCachesUntouched) {
  for (KvCase::Kind kind : {KvCase::dense, KvCase::paged, KvCase::indexed}) {
    SCOPED_TRACE(int(kind));
    KvCase c(kind, true);
    c.opt.dropout_p = kNaN;
    EXPECT_REJECTED(c, kKv, "options.dropout_p", {"dropout probability"}, {"p < 1"}, "nan");
    KvCase s(kind, true);
    s.opt.softcap = -2.0f;
    EXPECT_REJECTED(s, kKv, "options.softcap", {"softcap"}, {"0"}, "-2");
  }
}

// The cache's capacity (page_size · max_blocks_per_seq, or the cache's rows) must stay within
// 2^30 keys, like forward's sequence lengths: beyond 2^31 the 32-bit max_seqlen_k wrapped and the
// mask was silently lost (a causal call attended to every key; found by this test, fixed in
// validate.cpp). A paged cache of capacity 2^31 holding 5 keys, and a dense one of 2^30 + 1 rows
// (all aliasing one row, stride 0) must both be rejected, on both CPU backends.
TEST(ValidationKVCache, CapacityAtMost2Pow30) {
  const std::int64_t page = 1 << 11, blocks_per_seq = 1 << 20;  // capacity 2^31
  const std::uint64_t s = test_seed(9);
  Tensor q = random_tensor(DType::f16, {1, 3, 1, 8}, s + 1);
  Tensor kc = random_tensor(DType::f16, {1, page, 1, 8}, s + 2);
  Tensor vc = random_tensor(DType::f16, {1, page, 1, 8}, s + 3);
  Tensor bt(DType::i32, {1, blocks_per_seq});
  std::memset(bt.data(), 0, std::size_t(blocks_per_seq) * 4);
  Tensor sl = Tensor::from_i32({5});
  Tensor out(DType::f16, {1, 3, 1, 8}), lse(DType::f32, {1, 1, 3});
  for (Backend backend : {Backend::cpu_reference, Backend::cpu}) {
    SCOPED_TRACE(fa::backend_name(backend));
    fa::KVCacheInputs in;
    in.q = q.tv();
    in.k_cache = kc.tv();
    in.v_cache = vc.tv();
    in.block_table = bt.tv();
    in.cache_seqlens = sl.tv();
    fa::Options opt;
    opt.causal = true;
    opt.backend = backend;
    const std::string msg = expect_rejected_by([&] { fa::forward_kvcache(in, {out.tv(), lse.tv()}, opt); },
                                               {out, lse, kc, vc},
                                               Msg{kKv, "block_table", {"capacity", "2^30"}, {"1073741824"}, "2147483648"});
    EXPECT_EQ(fa::can_implement(in, {out.tv(), lse.tv()}, opt).reason, msg);
    // Dense: 2^30 + 1 cache rows (stride 0 over one row; nothing may be read).
    fa::KVCacheInputs dense = in;
    dense.block_table = {};
    dense.cache_seqlens = {};
    dense.k_cache = resized(dense.k_cache, 1, (std::int64_t(1) << 30) + 1);
    dense.v_cache = resized(dense.v_cache, 1, (std::int64_t(1) << 30) + 1);
    dense.k_cache.stride[1] = 0;
    dense.v_cache.stride[1] = 0;
    expect_rejected_by([&] { fa::forward_kvcache(dense, {out.tv(), lse.tv()}, opt); }, {out, lse, kc, vc},
                       Msg{kKv, "k_cache", {"capacity", "2^30"}, {"1073741824"}, "1073741825"});
  }
  // Exactly 2^30 keys of capacity are allowed (a paged table of 2^19 pages of 2^11 rows).
  Tensor bt30(DType::i32, {1, blocks_per_seq / 2});
  std::memset(bt30.data(), 0, std::size_t(blocks_per_seq / 2) * 4);
  fa::KVCacheInputs in;
  in.q = q.tv();
  in.k_cache = kc.tv();
  in.v_cache = vc.tv();
  in.block_table = bt30.tv();
  in.cache_seqlens = sl.tv();
  fa::Options opt;
  opt.causal = true;
  opt.backend = Backend::cpu_reference;
  const fa::Support sup = fa::can_implement(in, {out.tv(), lse.tv()}, opt);
  EXPECT_TRUE(sup.ok) << sup.reason;
}

// ================================================================================================
// combine
// ================================================================================================

TEST(ValidationCombine, RequiredTensors) {
  CombineCase a;
  a.in.out_partial = {};
  EXPECT_COMBINE_REJECTED(a, kComb, "out_partial", {"is required"}, {"a tensor"}, "none");
  CombineCase b;
  b.in.lse_partial = {};
  EXPECT_COMBINE_REJECTED(b, kComb, "lse_partial", {"is required"}, {"a tensor"}, "none");
  CombineCase c;
  c.outs.out = {};
  EXPECT_COMBINE_REJECTED(c, kComb, "out", {"is required"}, {"a tensor"}, "none");
}

TEST(ValidationCombine, OutPartialRankFive) {
  CombineCase c;
  c.in.out_partial.ndim = 4;
  EXPECT_COMBINE_REJECTED(c, kComb, "out_partial", {"wrong rank"}, {"(splits, b, sq, h, dv)"}, "(3, 2, 4, 2)");
}

TEST(ValidationCombine, AtLeastOneSplit) {
  CombineCase c;
  c.in.out_partial = resized(c.in.out_partial, 0, 0);
  c.in.lse_partial = resized(c.in.lse_partial, 0, 0);
  EXPECT_COMBINE_REJECTED(c, kComb, "out_partial", {"at least one split"}, {"1"}, "0");
}

TEST(ValidationCombine, PartialsAreFp32) {
  CombineCase c;
  c.in.out_partial = as(c.in.out_partial, DType::f16);
  EXPECT_COMBINE_REJECTED(c, kComb, "out_partial", {"fp32"}, {"f32"}, "f16");
  CombineCase l;
  l.in.lse_partial = as(l.in.lse_partial, DType::bf16);
  EXPECT_COMBINE_REJECTED(l, kComb, "lse_partial", {"fp32"}, {"f32"}, "bf16");
  CombineCase o;
  o.outs.lse = as(o.outs.lse, DType::f16);
  EXPECT_COMBINE_REJECTED(o, kComb, "lse", {"fp32"}, {"f32"}, "f16");
}

TEST(ValidationCombine, OutIsFloatingPoint) {
  CombineCase c;
  c.outs.out = as(c.outs.out, DType::i32);
  EXPECT_COMBINE_REJECTED(c, kComb, "out", {"floating-point"}, {"f16, bf16 or f32"}, "i32");
}

TEST(ValidationCombine, Shapes) {
  CombineCase l;
  l.in.lse_partial.shape[2] = 4;
  l.in.lse_partial.shape[3] = 2;
  EXPECT_COMBINE_REJECTED(l, kComb, "lse_partial", {"wrong shape"}, {"(3, 2, 2, 4)"}, "(3, 2, 4, 2)");
  CombineCase o;
  o.outs.out = resized(o.outs.out, 3, 4);
  EXPECT_COMBINE_REJECTED(o, kComb, "out", {"wrong shape"}, {"(2, 4, 2, 8)"}, "(2, 4, 2, 4)");
  CombineCase s;
  s.outs.lse = resized(s.outs.lse, 2, 3);
  EXPECT_COMBINE_REJECTED(s, kComb, "lse", {"wrong shape"}, {"(2, 2, 4)"}, "(2, 2, 3)");
}

// A valid combine computes lse = log Σ exp(lse_s), out = Σ exp(lse_s − lse) out_s; splits with
// lse = +inf (no keys) carry no mass; a row with no mass anywhere gets out 0, lse +inf.
TEST(ValidationCombine, ValidCombineComputesTheMerge) {
  CombineCase c;
  c.lp.set({1, 0, 1, 2}, kInf);  // one empty split for (b 0, h 1, i 2)
  for (int s = 0; s < 3; ++s) c.lp.set({s, 1, 0, 3}, kInf);  // (b 1, h 0, i 3): no mass at all
  ASSERT_NO_THROW(c.call());
  for (int b = 0; b < 2; ++b)
    for (int i = 0; i < 4; ++i)
      for (int h = 0; h < 2; ++h) {
        double mx = -kInf;
        for (int s = 0; s < 3; ++s) {
          const double l = c.lp.get({s, b, h, i});
          if (std::isfinite(l)) mx = std::max(mx, l);
        }
        if (mx == -double(kInf)) {
          EXPECT_EQ(c.lse.get({b, h, i}), kInf);
          for (int x = 0; x < 8; ++x) EXPECT_EQ(c.out.get({b, i, h, x}), 0.0f);
          continue;
        }
        double sum = 0;
        for (int s = 0; s < 3; ++s) {
          const double l = c.lp.get({s, b, h, i});
          if (std::isfinite(l)) sum += std::exp(l - mx);
        }
        const double lse = mx + std::log(sum);
        EXPECT_NEAR(c.lse.get({b, h, i}), lse, 1e-5 * (1 + std::abs(lse)));
        for (int x = 0; x < 8; ++x) {
          double o = 0;
          for (int s = 0; s < 3; ++s) {
            const double l = c.lp.get({s, b, h, i});
            if (std::isfinite(l)) o += std::exp(l - lse) * c.op.get({s, b, i, h, x});
          }
          EXPECT_NEAR(c.out.get({b, i, h, x}), o, 2e-3) << b << " " << i << " " << h << " " << x;
        }
      }
  // lse is optional.
  CombineCase n;
  n.outs.lse = {};
  EXPECT_NO_THROW(n.call());
  EXPECT_FALSE(std::isnan(n.out.get({0, 0, 0, 0})));
}

// ================================================================================================
// can_implement
// ================================================================================================

TEST(ValidationSupport, ValidCallsAreSupportedByTheCpuBackends) {
  FwdCase c;
  for (Backend asked : {Backend::automatic, Backend::cpu}) {
    c.opt.backend = asked;
    const fa::Support s = c.support();
    EXPECT_TRUE(s.ok) << s.reason;
    EXPECT_TRUE(bool(s));
    EXPECT_EQ(s.backend, Backend::cpu);
    EXPECT_TRUE(s.reason.empty()) << s.reason;
  }
  c.opt.backend = Backend::cpu_reference;
  EXPECT_EQ(c.support().backend, Backend::cpu_reference);
  EXPECT_TRUE(c.support().ok);
  BwdCase b;
  b.opt.backend = Backend::cpu;
  EXPECT_TRUE(b.support().ok) << b.support().reason;
  EXPECT_EQ(b.support().backend, Backend::cpu);
  KvCase kv(KvCase::paged, true);
  kv.opt.backend = Backend::automatic;
  EXPECT_TRUE(kv.support().ok) << kv.support().reason;
  EXPECT_EQ(kv.support().backend, Backend::cpu);
  // can_implement runs nothing: outputs and caches stay as they were.
  const Snapshot snap(kv.watched());
  (void)kv.support();
  (void)c.support();
  EXPECT_TRUE(snap.unchanged());
  const std::vector<Backend> compiled = fa::compiled_backends();
  EXPECT_NE(std::find(compiled.begin(), compiled.end(), Backend::cpu), compiled.end());
  EXPECT_NE(std::find(compiled.begin(), compiled.end(), Backend::cpu_reference), compiled.end());
}

// (Every EXPECT_REJECTED above also asks can_implement; this one shows the agreement on its own.)
TEST(ValidationSupport, RejectedCallsGiveTheSameMessage) {
  FwdCase c;
  c.in.k = resized(c.in.k, 0, 1);
  std::string thrown;
  try {
    c.call();
  } catch (const fa::Error& e) {
    thrown = e.what();
  }
  ASSERT_FALSE(thrown.empty());
  const fa::Support s = c.support();
  EXPECT_FALSE(s.ok);
  EXPECT_EQ(s.reason, thrown);
  EXPECT_TRUE(message_matches(s.reason, Msg{kFwd, "k", {"wrong shape"}, {"(2, 7, 2, 16)"}, "(1, 7, 2, 16)"}));
}

// ================================================================================================
// Special cases that are NOT errors (SPEC §5 end, §2.5), on both CPU backends.
// ================================================================================================

class ValidationSpecial : public testing::TestWithParam<Backend> {};

// Outputs come poisoned (NaN patterns), so an element the call leaves unwritten fails these exact
// checks.
void expect_all(const Tensor& t, float value, const char* what) {
  std::int64_t bad = 0;
  std::vector<float> vals = t.to_vector();
  for (float v : vals) bad += !(v == value);
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << vals.size() << " elements are not " << value;
}

TEST_P(ValidationSpecial, SeqlenQZero) {
  AttnConfig cfg = dense_cfg();
  cfg.seqlen_q = 0;
  AttnProblem p = make_problem(cfg);
  ForwardResult fwd;
  ASSERT_NO_THROW(fwd = run_forward(p, GetParam(), 2));
  EXPECT_EQ(fwd.out.numel(), 0);
  BackwardResult bwd;
  ASSERT_NO_THROW(bwd = run_backward(p, fwd, GetParam(), 2));
  // The reference behaviour: dk = dv = 0 (every key row written), softmax_d (empty) = 0.
  ASSERT_EQ(bwd.dk.numel(), 2 * 7 * 2 * 16);
  expect_all(bwd.dk, 0.0f, "dk");
  expect_all(bwd.dv, 0.0f, "dv");
  EXPECT_EQ(bwd.dq.numel(), 0);
  EXPECT_EQ(bwd.softmax_d.numel(), 0);
  // can_implement agrees.
  const ForwardResult outs = make_forward_outputs(p);
  fa::Options opt = p.opt;
  opt.backend = GetParam();
  EXPECT_TRUE(fa::can_implement(p.forward_inputs(), {outs.out.tv(), outs.lse.tv()}, opt).ok);
}

TEST_P(ValidationSpecial, SeqlenKZero) {
  AttnConfig cfg = dense_cfg();
  cfg.seqlen_k = 0;
  AttnProblem p = make_problem(cfg);
  ForwardResult fwd;
  ASSERT_NO_THROW(fwd = run_forward(p, GetParam(), 2));
  expect_all(fwd.out, 0.0f, "out");
  expect_all(fwd.lse, kInf, "lse");
  BackwardResult bwd;
  ASSERT_NO_THROW(bwd = run_backward(p, fwd, GetParam(), 2));
  expect_all(bwd.dq, 0.0f, "dq");
  expect_all(bwd.softmax_d, 0.0f, "softmax_d");
  EXPECT_EQ(bwd.dk.numel(), 0);
}

// Empty tensors may come with data == nullptr (tensor.h).
TEST_P(ValidationSpecial, NullPointersOfEmptyTensors) {
  AttnConfig cfg = dense_cfg();
  cfg.seqlen_k = 0;
  FwdCase c(cfg);
  c.in.k.data = nullptr;
  c.in.v.data = nullptr;
  c.opt.backend = GetParam();
  ASSERT_NO_THROW(c.call());
  expect_all(c.r.out, 0.0f, "out");
  expect_all(c.r.lse, kInf, "lse");
  AttnConfig q0 = dense_cfg();
  q0.seqlen_q = 0;
  FwdCase z(q0);
  z.in.q.data = nullptr;
  z.out.out.data = nullptr;
  z.out.lse.data = nullptr;
  z.opt.backend = GetParam();
  EXPECT_NO_THROW(z.call());
}

TEST_P(ValidationSpecial, EmptyVarlenSegments) {
  AttnConfig cfg = varlen_cfg();
  cfg.varlen_q = {3, 0, 4, 2, 0};
  cfg.varlen_k = {5, 2, 0, 0, 0};
  AttnProblem p = make_problem(cfg);
  ForwardResult fwd;
  ASSERT_NO_THROW(fwd = run_forward(p, GetParam(), 2));
  EXPECT_TRUE(check_forward(p, fwd));
  // Sequence 2 (rows 3..6) and 3 (rows 7..8) have no keys: out 0, lse +inf.
  for (std::int64_t row = 3; row < 9; ++row)
    for (std::int64_t h = 0; h < 4; ++h) {
      EXPECT_EQ(fwd.lse.get({h, row}), kInf) << row;
      for (std::int64_t x = 0; x < 24; ++x) EXPECT_EQ(fwd.out.get({row, h, x}), 0.0f) << row;
    }
  BackwardResult bwd;
  ASSERT_NO_THROW(bwd = run_backward(p, fwd, GetParam(), 2));
  EXPECT_TRUE(check_backward(p, fwd, bwd));
  // Keys 5..6 belong to sequence 1, which has no queries: zero gradients.
  for (std::int64_t row = 5; row < 7; ++row)
    for (std::int64_t h = 0; h < 2; ++h) {
      for (std::int64_t x = 0; x < 16; ++x) EXPECT_EQ(bwd.dk.get({row, h, x}), 0.0f) << row;
      for (std::int64_t x = 0; x < 24; ++x) EXPECT_EQ(bwd.dv.get({row, h, x}), 0.0f) << row;
    }
}

TEST_P(ValidationSpecial, WithoutLseWhenNotReturned) {
  AttnConfig cfg = dense_cfg();
  cfg.opt.return_lse = false;
  FwdCase c(cfg);
  c.out.lse = {};
  c.opt.backend = GetParam();
  ASSERT_TRUE(c.support().ok) << c.support().reason;
  ASSERT_NO_THROW(c.call());
  EXPECT_TRUE(check_forward(c.p, c.r));
}

INSTANTIATE_TEST_SUITE_P(Backends, ValidationSpecial, testing::Values(Backend::cpu_reference, Backend::cpu),
                         [](const testing::TestParamInfo<Backend>& info) {
                           return std::string(flashattn::backend_name(info.param));
                         });

}  // namespace
}  // namespace fa_test
