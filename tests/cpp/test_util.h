// tests/cpp/test_util.h — shared helpers of the flashattn C++ tests: an owning strided test
// tensor, builders for the API's input structs, and THE accuracy checker of SPEC §7.
//
// ------------------------------------------------------------------------------------------------
// INTERFACE (kept stable: test_validation.cpp and test_fuzz.cpp build on it)
//
// Seeds
//   std::uint64_t test_seed(std::uint64_t salt = 0)
//       A seed derived from the running gtest's full name and `salt`: fixed from run to run, but
//       different for every test (and every salt), so no two checks see the same inputs.
//
// fa_test::Tensor — owning, strided, any DType (f16 / bf16 / f32 / i32). Copies are SHALLOW
// (they share storage, like torch tensors); clone() makes a deep copy.
//   Tensor(DType, Shape)                        contiguous, filled with poison
//   Tensor::with_strides(DType, Shape, Strides) owns exactly the span the strides need (gaps are
//                                               poisoned too, so a stray read gives NaN)
//   Tensor::from_i32(values) / from_f32(shape, values)
//   t.view(offset, shape, strides)              a view sharing t's storage (offset in elements,
//                                               relative to t's data pointer)
//   t.tv()                                      the flashattn::TensorView
//   t.fill_random(seed, lo = -1, hi = 1)        uniform, rounded to the dtype, never exactly 0
//   t.fill_poison()                             NaN bit patterns over the WHOLE underlying buffer
//   t.fill(value)                               every logical element
//   t.get({i, j, ...}) / t.set({i, j, ...}, v)  float access (i32 converts)
//   t.load(off) / t.store(off, v)               by element offset from the data pointer
//   t.offset({i, j, ...})                       that offset
//   t.numel(), t.ndim(), t.shape(), t.stride(), t.dtype(), t.span() (elements the view covers)
//   t.for_each_index(fn(const Index&))          every logical multi-index, row-major
//   t.to_vector()                               logical elements, row-major, as float
//   t.clone(), Tensor::empty_like(t)            same shape and strides (empty_like: poisoned)
//   t.count_written_outside_view()              elements of the underlying buffer outside this
//                                               view that no longer hold the poison pattern
//                                               (0 for a view(): only an owner can tell)
//
// Attention problems
//   AttnConfig      shapes, dtype, layout, options and varlen lengths of one problem
//   AttnProblem make_problem(const AttnConfig&)
//                   owns random q, k, v, dout, cu_seqlens, seqused_k and ALiBi slopes;
//                   .opt holds the options (alibi_slopes pointing into the problem)
//   p.forward_inputs(), p.backward_inputs(fwd)
//   ForwardResult  make_forward_outputs(p)         poisoned out, lse (padded if cfg asks)
//   BackwardResult make_backward_outputs(p)        poisoned dq, dk, dv, softmax_d (and dsinks)
//   ForwardResult  run_forward(p, backend, num_threads = 0)          poison, call the API
//   BackwardResult run_backward(p, fwd, backend, num_threads = 0)
//   std::string describe(const AttnConfig&)        one line, for SCOPED_TRACE
//
// The accuracy rule (SPEC §7)
//   testing::AssertionResult check_forward(p, fwd)
//   testing::AssertionResult check_backward(p, fwd, bwd)
//       Runs the fp64 reference (cpu::reference_*, fp64 sink) and the naive_lowprec reference
//       (RefPrecision::emulate_storage) on the SAME stored inputs and, for each of out, lse
//       (forward) and dq, dk, dv, softmax_d, dsinks (backward), asserts
//           max|kernel − ref| ≤ F · max|naive − ref| + 2 · max|ref| · u(dtype)
//       with F = 2 (3 with softcap) and u = 2^-8 (bf16), 2^-11 (f16), 2^-24 (f32). NaN never
//       passes; an element still poisoned fails; where ref is +inf (lse of a fully masked row) the
//       kernel and the naive reference must be +inf too. Elements the SPEC leaves undefined (keys
//       past seqused_k) are not compared. Outputs with gaps must have no writes in the gaps.
//       The message lists measured errors and bounds; FA_TEST_VERBOSE=1 prints them always.
//   testing::AssertionResult bitwise_equal(a, b)   same shape; every logical element's bits equal
//   double unit_roundoff(DType)
// ------------------------------------------------------------------------------------------------
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "flashattn/flashattn.h"

namespace fa_test {

using flashattn::Backend;
using flashattn::DType;
using Shape = std::vector<std::int64_t>;
using Strides = std::vector<std::int64_t>;
using Index = std::vector<std::int64_t>;

std::uint64_t test_seed(std::uint64_t salt = 0);

// Threads of the references in check_forward / check_backward: FA_TEST_REF_THREADS, else every
// hardware thread.
int reference_threads();

// Unit roundoff of a storage dtype: 2^-8 (bf16), 2^-11 (f16), 2^-24 (f32).
double unit_roundoff(DType dtype);
// Round a float to the dtype's precision and back.
float round_to(DType dtype, float x);
// Poison bit pattern of a dtype (a NaN for the float types).
std::uint32_t poison_bits(DType dtype);

class Tensor {
 public:
  Tensor() = default;
  Tensor(DType dtype, Shape shape);
  static Tensor with_strides(DType dtype, Shape shape, Strides strides);
  static Tensor from_i32(const std::vector<std::int32_t>& values);
  static Tensor from_f32(Shape shape, const std::vector<float>& values);
  static Tensor empty_like(const Tensor& t);

  Tensor view(std::int64_t offset, Shape shape, Strides strides) const;
  Tensor clone() const;

  flashattn::TensorView tv() const;
  bool defined() const { return storage_ != nullptr; }

  DType dtype() const { return dtype_; }
  int ndim() const { return int(shape_.size()); }
  const Shape& shape() const { return shape_; }
  const Strides& stride() const { return strides_; }
  std::int64_t shape(int i) const { return shape_.at(std::size_t(i)); }
  std::int64_t numel() const;
  // Elements from the data pointer to one past the last element of the view (0 when empty).
  std::int64_t span() const;
  void* data() const;

  std::int64_t offset(const Index& idx) const;
  float get(const Index& idx) const { return load(offset(idx)); }
  void set(const Index& idx, float v) { store(offset(idx), v); }
  float load(std::int64_t off) const;
  void store(std::int64_t off, float v);
  std::uint32_t bits_at(std::int64_t off) const;

  void fill_random(std::uint64_t seed, float lo = -1.0f, float hi = 1.0f);
  void fill_poison();
  void fill(float value);
  void for_each_index(const std::function<void(const Index&)>& fn) const;
  std::vector<float> to_vector() const;
  std::int64_t count_written_outside_view() const;

 private:
  struct Storage {
    std::vector<std::uint64_t> words;  // 8-byte aligned
    std::size_t bytes = 0;
  };
  std::shared_ptr<Storage> storage_;
  std::int64_t base_ = 0;  // element offset of the data pointer within storage
  DType dtype_ = DType::f32;
  bool owns_buffer_ = false;  // made by a constructor (not view()): the whole buffer is ours
  Shape shape_;
  Strides strides_;
};

testing::AssertionResult bitwise_equal(const Tensor& a, const Tensor& b);

// --- attention problems -------------------------------------------------------------------------

enum class Alibi { none, per_head, per_batch_head };

// How q, k, v (and dout) are laid out in memory. The last dim is always contiguous.
enum class Layout {
  contiguous,  // (b, s, h, d) row-major
  packed_qkv,  // q, k, v are views into one (b, s, 3, h, d) buffer (needs sq == sk, h == hk,
               // d == dv); varlen: (total, 3, h, d)
  bhsd,        // memory order (b, h, s, d): strides (h·s·d, d, s·d, 1) (dense only)
  padded,      // gaps between heads, rows and batches (poisoned, so a stray read gives NaN)
};

struct AttnConfig {
  DType dtype = DType::f16;
  int batch = 1;
  int seqlen_q = 16;
  int seqlen_k = 16;
  int heads = 2;
  int heads_k = 2;
  int head_dim = 64;
  int head_dim_v = 0;  // 0: = head_dim
  // Varlen when non-empty: per-sequence lengths (batch = their count; seqlen_q/k ignored).
  std::vector<int> varlen_q;
  std::vector<int> varlen_k;
  std::vector<int> seqused_k;  // optional, varlen only: keys used per sequence
  Layout layout = Layout::contiguous;
  bool padded_outputs = false;  // out/dq/dk/dv with gaps (checked for stray writes)
  Alibi alibi = Alibi::none;
  // Attention sinks (docs/sinks.md): a random (h) fp32 sink logit per head, in the forward and
  // backward inputs, and dsinks among the backward outputs.
  bool sinks = false;
  // Every other option (causal, window, softcap, dropout, softmax_scale, ...). alibi_slopes and
  // backend are set by make_problem / run_*.
  flashattn::Options opt = {};
  // q and k are uniform in ±qk_amplitude (larger → peakier softmax); v, dout in ±1.
  float qk_amplitude = 1.0f;
  std::uint64_t seed = 0;  // 0: test_seed()
};

// A dense configuration: dtype, batch, seqlen_q, seqlen_k, heads, kv heads, head dims (dv 0: = d).
inline AttnConfig dense_config(DType dtype, int b, int sq, int sk, int h, int hk, int d, int dv = 0) {
  AttnConfig c;
  c.dtype = dtype;
  c.batch = b;
  c.seqlen_q = sq;
  c.seqlen_k = sk;
  c.heads = h;
  c.heads_k = hk;
  c.head_dim = d;
  c.head_dim_v = dv;
  return c;
}

std::string describe(const AttnConfig& cfg);

// not_run: the backend under test has no kernel for the problem (a restricted CUDA build); the
// runner recorded a skip with the reason, the outputs are untouched, and check_* accept them.
struct ForwardResult {
  Tensor out;  // (b, sq, h, dv) or varlen (total_q, h, dv)
  Tensor lse;  // (b, h, sq) or varlen (h, total_q), f32
  bool not_run = false;
};

struct BackwardResult {
  Tensor dq, dk, dv;
  Tensor softmax_d;  // like lse
  Tensor dsinks;     // (h) f32 when cfg.sinks
  bool not_run = false;
};

struct AttnProblem {
  AttnConfig cfg;
  int head_dim_v = 0;
  int total_q = 0, total_k = 0;  // rows of the packed dimension (varlen) or per batch (dense)
  Tensor q, k, v, dout;
  Tensor qkv_buffer;  // Layout::packed_qkv: the packed storage q, k, v view into
  Tensor cu_seqlens_q, cu_seqlens_k, seqused_k;
  Tensor alibi_slopes;
  Tensor sinks;  // (h) f32 when cfg.sinks
  flashattn::Options opt;
  flashattn::Varlen varlen;

  bool is_varlen() const { return !cfg.varlen_q.empty(); }
  flashattn::ForwardInputs forward_inputs() const;
  flashattn::BackwardInputs backward_inputs(const ForwardResult& fwd) const;
};

AttnProblem make_problem(const AttnConfig& cfg);

ForwardResult make_forward_outputs(const AttnProblem& p);
BackwardResult make_backward_outputs(const AttnProblem& p);
// Poisoned outputs, workspace of the reported size, then the public API with opt.backend set.
ForwardResult run_forward(const AttnProblem& p, Backend backend, int num_threads = 0);
BackwardResult run_backward(const AttnProblem& p, const ForwardResult& fwd, Backend backend,
                            int num_threads = 0);

testing::AssertionResult check_forward(const AttnProblem& p, const ForwardResult& fwd);
testing::AssertionResult check_backward(const AttnProblem& p, const ForwardResult& fwd,
                                        const BackwardResult& bwd);

}  // namespace fa_test
