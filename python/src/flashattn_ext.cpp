// python/src/flashattn_ext.cpp — the nanobind module flashattn._C: the C++ entry points over
// arrays that arrive through DLPack (PyTorch tensors, NumPy arrays), without copies.
//
// Every tensor argument, outputs and workspace included, is memory the caller owns: the Python
// layer allocates out, lse, dq, ... and passes them in. The workspace comes as an array (its size
// from the *_workspace_size functions, which read only shapes, dtypes and devices), and/or as
// workspace_alloc: a callable that the call asks for the bytes it needs (the core's
// Workspace::grow, once the call has counted them) — one call instead of a size query and a
// call, each of which converts and checks every argument — or a KeptWorkspace, which also keeps
// the array from call to call. Shapes and strides (in elements) are taken as they are, so views
// into packed tensors are read in place. The GIL is released while the kernels run.
// flashattn::Error surfaces as flashattn._C.Error, a subclass of ValueError and RuntimeError.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include "flashattn/flashattn.h"

namespace nb = nanobind;

namespace {

using flashattn::DType;
using flashattn::Error;
using flashattn::TensorView;

// Inputs are read-only (this also admits read-only NumPy arrays); outputs are written.
using InArray = nb::ndarray<nb::ro>;
using OutArray = nb::ndarray<>;
using MaybeIn = std::optional<InArray>;
using MaybeOut = std::optional<OutArray>;

// DLPack device codes (dlpack.h: kDLCPU, kDLCUDA, kDLCUDAHost).
constexpr int kDlpackCpu = 1;
constexpr int kDlpackCuda = 2;
constexpr int kDlpackCudaHost = 3;

std::string dlpack_dtype_name(nb::dlpack::dtype t) {
  using Code = nb::dlpack::dtype_code;
  std::string base;
  switch (Code(t.code)) {
    case Code::Int: base = "int"; break;
    case Code::UInt: base = "uint"; break;
    case Code::Float: base = "float"; break;
    case Code::Bfloat: base = "bfloat"; break;
    case Code::Complex: base = "complex"; break;
    case Code::Bool: base = "bool"; break;
    case Code::Float8_E4M3FN: return "float8_e4m3fn";
    default: base = "dtype code " + std::to_string(int(t.code)) + " of "; break;
  }
  return base + std::to_string(int(t.bits));
}

// The argument names below are C strings, made into a std::string only for an error message: a
// call converts up to 16 arrays, most of them absent.

// How the element type of an array maps onto flashattn::DType. NumPy has no bfloat16, so the
// NumPy layer passes bfloat16 data as uint16 bit patterns with bf16_bits = true.
DType dtype_of(const char* name, nb::dlpack::dtype t, bool bf16_bits) {
  using Code = nb::dlpack::dtype_code;
  if (t.lanes == 1) {
    if (t.code == uint8_t(Code::Float) && t.bits == 16) return DType::f16;
    if (t.code == uint8_t(Code::Bfloat) && t.bits == 16) return DType::bf16;
    if (t.code == uint8_t(Code::Float) && t.bits == 32) return DType::f32;
    if (t.code == uint8_t(Code::Int) && t.bits == 32) return DType::i32;
    if (t.code == uint8_t(Code::Float8_E4M3FN) && t.bits == 8) return DType::f8e4m3;
    if (bf16_bits && t.code == uint8_t(Code::UInt) && t.bits == 16) return DType::bf16;
  }
  throw Error(std::string(name) + ": unsupported element type; expected float16, bfloat16, float32, float8_e4m3fn "
              "(forward inputs) or int32 (index tensors), got " + dlpack_dtype_name(t));
}

flashattn::Device device_of(const char* name, int device_type, int device_id) {
  switch (device_type) {
    case kDlpackCpu:
    case kDlpackCudaHost: return {flashattn::DeviceType::cpu, 0};
    case kDlpackCuda: return {flashattn::DeviceType::cuda, device_id};
    default:
      throw Error(std::string(name) + ": unsupported device; expected a CPU or CUDA tensor, got DLPack device type " +
                  std::to_string(device_type));
  }
}

template <class Array>
TensorView view_of(const char* name, const Array& a, bool bf16_bits) {
  if (a.ndim() < 1 || a.ndim() > std::size_t(flashattn::kMaxDims)) {
    throw Error(std::string(name) + ": rank out of range; expected 1 to " + std::to_string(flashattn::kMaxDims) + ", got " +
                std::to_string(a.ndim()));
  }
  TensorView v;
  v.data = const_cast<void*>(static_cast<const void*>(a.data()));
  v.dtype = dtype_of(name, a.dtype(), bf16_bits);
  v.ndim = int(a.ndim());
  for (std::size_t i = 0; i < a.ndim(); ++i) {
    v.shape[i] = std::int64_t(a.shape(i));
    v.stride[i] = a.stride(i);
  }
  v.device = device_of(name, a.device_type(), a.device_id());
  return v;
}

template <class Array>
TensorView maybe_view(const char* name, const std::optional<Array>& a, bool bf16_bits) {
  return a ? view_of(name, *a, bf16_bits) : TensorView{};
}

// The dropout state {seed, offset} read at run time: int64 (2), contiguous, on q's device.
const std::uint64_t* rng_state_of(const MaybeIn& rng_state, const TensorView& q) {
  if (!rng_state) return nullptr;
  const InArray& r = *rng_state;
  const nb::dlpack::dtype i64{uint8_t(nb::dlpack::dtype_code::Int), 64, 1};
  const nb::dlpack::dtype u64{uint8_t(nb::dlpack::dtype_code::UInt), 64, 1};
  if (r.dtype() != i64 && r.dtype() != u64) {
    throw Error("rng_state: must be int64 {seed, offset}; expected int64, got " + dlpack_dtype_name(r.dtype()));
  }
  if (r.ndim() != 1 || r.shape(0) != 2 || r.stride(0) != 1) {
    throw Error("rng_state: must be a contiguous pair {seed, offset}; expected shape (2)");
  }
  if (device_of("rng_state", r.device_type(), r.device_id()) != q.device) {
    throw Error("rng_state: all tensors must be on one device; expected q's device");
  }
  return static_cast<const std::uint64_t*>(static_cast<const void*>(r.data()));
}

flashattn::Options with_tensors(flashattn::Options opt, const MaybeIn& alibi_slopes, const MaybeIn& rng_state,
                                const TensorView& q) {
  opt.alibi_slopes = maybe_view("alibi_slopes", alibi_slopes, false);
  opt.dropout_rng_state = rng_state_of(rng_state, q);
  return opt;
}

// paged: the forward reads a paged K/V (block_table), whose key counts may come from seqused_k alone.
flashattn::Varlen varlen_of(const MaybeIn& cu_seqlens_q, const MaybeIn& cu_seqlens_k, const MaybeIn& seqused_k,
                            int max_seqlen_q, int max_seqlen_k, bool paged = false) {
  flashattn::Varlen vl;
  if (cu_seqlens_q.has_value() != cu_seqlens_k.has_value() && !(paged && cu_seqlens_q.has_value())) {
    throw Error(std::string(cu_seqlens_q ? "cu_seqlens_k" : "cu_seqlens_q") +
                ": varlen calls need both cu_seqlens_q and cu_seqlens_k; expected a (b + 1) int32 tensor, got none");
  }
  vl.cu_seqlens_q = maybe_view("cu_seqlens_q", cu_seqlens_q, false);
  vl.cu_seqlens_k = maybe_view("cu_seqlens_k", cu_seqlens_k, false);
  vl.seqused_k = maybe_view("seqused_k", seqused_k, false);
  vl.max_seqlen_q = max_seqlen_q;
  vl.max_seqlen_k = max_seqlen_k;
  return vl;
}

// The caller's scratch: a 1-D contiguous uint8 array on q's device (256-byte alignment and the
// size are checked by the core against what the call needs). None = no workspace.
flashattn::Workspace workspace_of(const MaybeOut& workspace, const TensorView& q) {
  if (!workspace) return {};
  const OutArray& w = *workspace;
  const nb::dlpack::dtype u8{uint8_t(nb::dlpack::dtype_code::UInt), 8, 1};
  if (w.dtype() != u8) {
    throw Error("workspace: must be a byte buffer; expected uint8, got " + dlpack_dtype_name(w.dtype()));
  }
  if (w.ndim() != 1 || (w.shape(0) > 1 && w.stride(0) != 1)) {
    throw Error("workspace: must be a contiguous 1-D uint8 array; expected rank 1 with stride 1, got rank " +
                std::to_string(w.ndim()));
  }
  if (device_of("workspace", w.device_type(), w.device_id()) != q.device) {
    throw Error("workspace: all tensors must be on one device; expected q's device");
  }
  flashattn::Workspace ws;
  ws.data = w.shape(0) == 0 ? nullptr : w.data();
  ws.bytes = std::size_t(w.shape(0));
  return ws;
}

// A workspace kept from call to call: the Python layer makes one per CUDA stream and hands it to
// the calls on that stream as workspace_alloc. A call takes its array as the workspace, with no
// round trip into Python, and asks `alloc` (nbytes -> a DLPack array) only when it needs more;
// the new array, 256-byte aligned, is kept for the next calls when it holds at most max_bytes.
// The kernels of one call pass data to each other through the workspace, and the kernels of
// calls made one after the other on one stream run in that order, so a later call's kernels use
// the bytes after the earlier call's. Calls from two host threads on one stream may interleave
// their launches, though: while one call holds the keeper (`busy`, from taking its array until
// its kernels are enqueued) another gets a workspace of its own and keeps nothing.
struct KeptWorkspace {
  nb::object alloc;
  std::size_t max_bytes = 0;
  MaybeOut array;
  bool busy = false;
};

// What a call's Workspace::grow reaches (grow_from_python): the allocator, the keeper the call
// holds (or null), where the array lives until the call returns, and q (the device check). It
// lives in the binding function's frame, declared before the GIL is released, so that it is
// destroyed with the GIL held, after the call: it then gives the keeper back.
struct GrowSource {
  nb::handle alloc;
  KeptWorkspace* kept = nullptr;
  MaybeOut* keep = nullptr;
  const TensorView* q = nullptr;
  GrowSource() = default;
  GrowSource(const GrowSource&) = delete;
  GrowSource& operator=(const GrowSource&) = delete;
  ~GrowSource() {
    if (kept != nullptr) kept->busy = false;
  }
};

// Workspace::grow of a call from Python, which the core calls with the GIL released: nbytes from
// the allocator. `keep` holds the array until the call returns, after its kernels are enqueued
// (a caching allocator may then hand the memory to later work of the same stream, which runs
// after them).
flashattn::Workspace grow_from_python(void* context, std::size_t nbytes) {
  const GrowSource& g = *static_cast<const GrowSource*>(context);
  nb::gil_scoped_acquire gil;
  OutArray array;
  if (!nb::try_cast(g.alloc(nbytes), array)) {
    throw Error("workspace_alloc: must return a 1-D uint8 array (DLPack) of " + std::to_string(nbytes) +
                " bytes; got an object that is not an array");
  }
  if (array.ndim() != 1 || array.shape(0) < nbytes) {
    throw Error("workspace_alloc: must return a 1-D uint8 array of at least " + std::to_string(nbytes) +
                " bytes");
  }
  *g.keep = array;
  const flashattn::Workspace ws = workspace_of(*g.keep, *g.q);
  // Kept only as the core takes it (aligned): a kept array that the core refused would be handed
  // to every later call, never grown again.
  constexpr std::uintptr_t kAlign = 256;
  if (g.kept != nullptr && nbytes <= g.kept->max_bytes && reinterpret_cast<std::uintptr_t>(ws.data) % kAlign == 0) {
    g.kept->array = array;
  }
  return ws;
}

// The workspace of a call: the caller's array (none: empty), and given workspace_alloc — a
// callable (nbytes -> a DLPack array or an object with __dlpack__) or a KeptWorkspace, whose
// array stands in for a missing `workspace` — the core's Workspace::grow, asked for the call's
// need only when the array holds less (not at all when the call needs none). `grow` and `keep`
// belong to the caller's frame and outlive the call.
flashattn::Workspace workspace_for(const MaybeOut& workspace, const nb::object& workspace_alloc, const TensorView& q,
                                   MaybeOut& keep, GrowSource& grow) {
  flashattn::Workspace ws = workspace_of(workspace, q);
  if (workspace_alloc.is_none()) return ws;
  grow.alloc = workspace_alloc;
  KeptWorkspace* kept = nullptr;
  if (nb::isinstance<KeptWorkspace>(workspace_alloc)) {
    if (!nb::try_cast(workspace_alloc, kept) || kept == nullptr) {
      throw Error("workspace_alloc: a KeptWorkspace that was never initialised");
    }
    grow.alloc = kept->alloc;
    if (!kept->busy) {  // (busy: another thread's call holds it; this one keeps nothing)
      kept->busy = true;
      grow.kept = kept;
      if (!workspace && kept->array) {
        keep = kept->array;
        ws = workspace_of(keep, q);
      }
    }
  }
  grow.keep = &keep;
  grow.q = &q;
  ws.grow = grow_from_python;
  ws.grow_context = &grow;
  return ws;
}

flashattn::Stream stream_of(std::uintptr_t handle) { return flashattn::Stream{reinterpret_cast<void*>(handle)}; }

flashattn::ForwardInputs forward_inputs(const InArray& q, const InArray& k, const InArray& v,
                                        const MaybeIn& cu_seqlens_q, const MaybeIn& cu_seqlens_k,
                                        const MaybeIn& seqused_k, int max_seqlen_q, int max_seqlen_k,
                                        const MaybeIn& block_table, bool bf16_bits, const MaybeIn& sinks) {
  flashattn::ForwardInputs in;
  in.q = view_of("q", q, bf16_bits);
  in.k = view_of("k", k, bf16_bits);
  in.v = view_of("v", v, bf16_bits);
  in.varlen = varlen_of(cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, block_table.has_value());
  in.block_table = maybe_view("block_table", block_table, false);
  in.sinks = maybe_view("sinks", sinks, false);
  return in;
}

std::size_t forward_workspace_size(const InArray& q, const InArray& k, const InArray& v,
                                   const flashattn::Options& options, const MaybeIn& alibi_slopes,
                                   const MaybeIn& cu_seqlens_q, const MaybeIn& cu_seqlens_k, const MaybeIn& seqused_k,
                                   int max_seqlen_q, int max_seqlen_k, const MaybeIn& block_table, bool bf16_bits,
                                   const MaybeIn& sinks) {
  const flashattn::ForwardInputs in = forward_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                                                     max_seqlen_k, block_table, bf16_bits, sinks);
  return flashattn::forward_workspace_size(in, with_tensors(options, alibi_slopes, std::nullopt, in.q));
}

void forward(const InArray& q, const InArray& k, const InArray& v, const OutArray& out, const MaybeOut& lse,
             const flashattn::Options& options, const MaybeIn& alibi_slopes, const MaybeIn& rng_state,
             const MaybeIn& cu_seqlens_q, const MaybeIn& cu_seqlens_k, const MaybeIn& seqused_k, int max_seqlen_q,
             int max_seqlen_k, const MaybeIn& block_table, const MaybeOut& workspace, std::uintptr_t stream,
             bool bf16_bits, const nb::object& workspace_alloc, const MaybeIn& sinks, const MaybeIn& q_descale,
             const MaybeIn& k_descale, const MaybeIn& v_descale) {
  flashattn::ForwardInputs in = forward_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                                               max_seqlen_k, block_table, bf16_bits, sinks);
  in.q_descale = maybe_view("q_descale", q_descale, false);
  in.k_descale = maybe_view("k_descale", k_descale, false);
  in.v_descale = maybe_view("v_descale", v_descale, false);
  flashattn::ForwardOutputs outs;
  outs.out = view_of("out", out, bf16_bits);
  outs.lse = maybe_view("lse", lse, false);
  flashattn::Options opt = with_tensors(options, alibi_slopes, rng_state, in.q);
  opt.return_lse = lse.has_value();
  MaybeOut keep;
  GrowSource grow;
  const flashattn::Workspace ws = workspace_for(workspace, workspace_alloc, in.q, keep, grow);
  nb::gil_scoped_release no_gil;
  flashattn::forward(in, outs, opt, ws, stream_of(stream));
}

flashattn::BackwardInputs backward_inputs(const InArray& dout, const InArray& q, const InArray& k, const InArray& v,
                                          const InArray& out, const InArray& lse, const MaybeIn& cu_seqlens_q,
                                          const MaybeIn& cu_seqlens_k, const MaybeIn& seqused_k, int max_seqlen_q,
                                          int max_seqlen_k, bool bf16_bits, const MaybeIn& sinks) {
  flashattn::BackwardInputs in;
  in.dout = view_of("dout", dout, bf16_bits);
  in.q = view_of("q", q, bf16_bits);
  in.k = view_of("k", k, bf16_bits);
  in.v = view_of("v", v, bf16_bits);
  in.out = view_of("out", out, bf16_bits);
  in.lse = view_of("lse", lse, false);
  in.varlen = varlen_of(cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k);
  in.sinks = maybe_view("sinks", sinks, false);
  return in;
}

std::size_t backward_workspace_size(const InArray& dout, const InArray& q, const InArray& k, const InArray& v,
                                    const InArray& out, const InArray& lse, const flashattn::Options& options,
                                    const MaybeIn& alibi_slopes, const MaybeIn& cu_seqlens_q,
                                    const MaybeIn& cu_seqlens_k, const MaybeIn& seqused_k, int max_seqlen_q,
                                    int max_seqlen_k, bool bf16_bits, const MaybeIn& sinks) {
  const flashattn::BackwardInputs in = backward_inputs(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                                       seqused_k, max_seqlen_q, max_seqlen_k, bf16_bits, sinks);
  return flashattn::backward_workspace_size(in, with_tensors(options, alibi_slopes, std::nullopt, in.q));
}

void backward(const InArray& dout, const InArray& q, const InArray& k, const InArray& v, const InArray& out,
              const InArray& lse, const OutArray& dq, const OutArray& dk, const OutArray& dv,
              const OutArray& softmax_d, const flashattn::Options& options, const MaybeIn& alibi_slopes,
              const MaybeIn& rng_state, const MaybeIn& cu_seqlens_q, const MaybeIn& cu_seqlens_k,
              const MaybeIn& seqused_k, int max_seqlen_q, int max_seqlen_k, const MaybeOut& workspace,
              std::uintptr_t stream, bool bf16_bits, const nb::object& workspace_alloc, const MaybeIn& sinks,
              const MaybeOut& dsinks) {
  const flashattn::BackwardInputs in = backward_inputs(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                                       seqused_k, max_seqlen_q, max_seqlen_k, bf16_bits, sinks);
  flashattn::BackwardOutputs outs;
  outs.dq = view_of("dq", dq, bf16_bits);
  outs.dk = view_of("dk", dk, bf16_bits);
  outs.dv = view_of("dv", dv, bf16_bits);
  outs.softmax_d = view_of("softmax_d", softmax_d, false);
  outs.dsinks = maybe_view("dsinks", dsinks, false);
  const flashattn::Options opt = with_tensors(options, alibi_slopes, rng_state, in.q);
  MaybeOut keep;
  GrowSource grow;
  const flashattn::Workspace ws = workspace_for(workspace, workspace_alloc, in.q, keep, grow);
  nb::gil_scoped_release no_gil;
  flashattn::backward(in, outs, opt, ws, stream_of(stream));
}

// The caches are taken read-only here so that the size query also accepts read-only arrays;
// forward_kvcache itself takes them as writable (k_new/v_new are appended in place).
template <class CacheArray>
flashattn::KVCacheInputs kvcache_inputs(const InArray& q, const CacheArray& k_cache, const CacheArray& v_cache,
                                        const MaybeIn& k_new, const MaybeIn& v_new, const MaybeIn& cache_seqlens,
                                        const MaybeIn& cache_batch_idx, const MaybeIn& cache_leftpad,
                                        const MaybeIn& block_table, const MaybeIn& rotary_cos,
                                        const MaybeIn& rotary_sin, bool rotary_interleaved, bool bf16_bits,
                                        const MaybeIn& sinks) {
  flashattn::KVCacheInputs in;
  in.q = view_of("q", q, bf16_bits);
  in.k_cache = view_of("k_cache", k_cache, bf16_bits);
  in.v_cache = view_of("v_cache", v_cache, bf16_bits);
  in.k_new = maybe_view("k", k_new, bf16_bits);
  in.v_new = maybe_view("v", v_new, bf16_bits);
  in.cache_seqlens = maybe_view("cache_seqlens", cache_seqlens, false);
  in.cache_batch_idx = maybe_view("cache_batch_idx", cache_batch_idx, false);
  in.cache_leftpad = maybe_view("cache_leftpad", cache_leftpad, false);
  in.block_table = maybe_view("block_table", block_table, false);
  in.rotary_cos = maybe_view("rotary_cos", rotary_cos, bf16_bits);
  in.rotary_sin = maybe_view("rotary_sin", rotary_sin, bf16_bits);
  in.rotary_interleaved = rotary_interleaved;
  in.sinks = maybe_view("sinks", sinks, false);
  return in;
}

std::size_t forward_kvcache_workspace_size(const InArray& q, const InArray& k_cache, const InArray& v_cache,
                                           const flashattn::Options& options, const MaybeIn& k_new,
                                           const MaybeIn& v_new, const MaybeIn& cache_seqlens,
                                           const MaybeIn& cache_batch_idx, const MaybeIn& cache_leftpad,
                                           const MaybeIn& block_table, const MaybeIn& rotary_cos,
                                           const MaybeIn& rotary_sin, bool rotary_interleaved,
                                           const MaybeIn& alibi_slopes, bool bf16_bits, const MaybeIn& sinks) {
  const flashattn::KVCacheInputs in = kvcache_inputs(q, k_cache, v_cache, k_new, v_new, cache_seqlens,
                                                     cache_batch_idx, cache_leftpad, block_table, rotary_cos,
                                                     rotary_sin, rotary_interleaved, bf16_bits, sinks);
  return flashattn::forward_kvcache_workspace_size(in, with_tensors(options, alibi_slopes, std::nullopt, in.q));
}

void forward_kvcache(const InArray& q, const OutArray& k_cache, const OutArray& v_cache, const OutArray& out,
                     const MaybeOut& lse, const flashattn::Options& options, const MaybeIn& k_new,
                     const MaybeIn& v_new, const MaybeIn& cache_seqlens, const MaybeIn& cache_batch_idx,
                     const MaybeIn& cache_leftpad, const MaybeIn& block_table, const MaybeIn& rotary_cos,
                     const MaybeIn& rotary_sin, bool rotary_interleaved, const MaybeIn& alibi_slopes,
                     const MaybeOut& workspace, std::uintptr_t stream, bool bf16_bits,
                     const nb::object& workspace_alloc, const MaybeIn& sinks, const MaybeIn& q_descale,
                     const MaybeIn& k_descale, const MaybeIn& v_descale) {
  flashattn::KVCacheInputs in = kvcache_inputs(q, k_cache, v_cache, k_new, v_new, cache_seqlens, cache_batch_idx,
                                               cache_leftpad, block_table, rotary_cos, rotary_sin, rotary_interleaved,
                                               bf16_bits, sinks);
  in.q_descale = maybe_view("q_descale", q_descale, false);
  in.k_descale = maybe_view("k_descale", k_descale, false);
  in.v_descale = maybe_view("v_descale", v_descale, false);
  flashattn::ForwardOutputs outs;
  outs.out = view_of("out", out, bf16_bits);
  outs.lse = maybe_view("lse", lse, false);
  flashattn::Options opt = with_tensors(options, alibi_slopes, std::nullopt, in.q);
  opt.return_lse = lse.has_value();
  MaybeOut keep;
  GrowSource grow;
  const flashattn::Workspace ws = workspace_for(workspace, workspace_alloc, in.q, keep, grow);
  nb::gil_scoped_release no_gil;
  flashattn::forward_kvcache(in, outs, opt, ws, stream_of(stream));
}

void combine(const InArray& out_partial, const InArray& lse_partial, const OutArray& out, const MaybeOut& lse,
             std::uintptr_t stream, bool bf16_bits) {
  flashattn::CombineInputs in;
  in.out_partial = view_of("out_partial", out_partial, false);
  in.lse_partial = view_of("lse_partial", lse_partial, false);
  flashattn::ForwardOutputs outs;
  outs.out = view_of("out", out, bf16_bits);
  outs.lse = maybe_view("lse", lse, false);
  nb::gil_scoped_release no_gil;
  flashattn::combine(in, outs, {}, stream_of(stream));
}

std::vector<std::string> compiled_backend_names() {
  std::vector<std::string> names;
  for (flashattn::Backend b : flashattn::compiled_backends()) names.emplace_back(flashattn::backend_name(b));
  return names;
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "flashattn C++ core: forward, backward, forward_kvcache and combine over DLPack arrays";

  // Both a ValueError (an invalid argument) and a RuntimeError, which is what code written for
  // flash_attn catches: its C++ checks raise RuntimeError.
  nb::exception<Error>(m, "Error", nb::make_tuple(nb::handle(PyExc_ValueError), nb::handle(PyExc_RuntimeError)));

  nb::enum_<flashattn::Backend>(m, "Backend")
      .value("automatic", flashattn::Backend::automatic)
      .value("cpu", flashattn::Backend::cpu)
      .value("cpu_reference", flashattn::Backend::cpu_reference)
      .value("cuda", flashattn::Backend::cuda);

  // The scalar fields of flashattn::Options; the tensor-valued ones (alibi_slopes, the dropout
  // rng_state pointer) are arguments of the entry points so that their arrays stay alive.
  nb::class_<flashattn::Options>(m, "Options")
      .def(nb::init<>())
      .def_rw("softmax_scale", &flashattn::Options::softmax_scale)
      .def_rw("causal", &flashattn::Options::causal)
      .def_rw("window_left", &flashattn::Options::window_left)
      .def_rw("window_right", &flashattn::Options::window_right)
      .def_rw("softcap", &flashattn::Options::softcap)
      .def_rw("dropout_p", &flashattn::Options::dropout_p)
      .def_rw("dropout_seed", &flashattn::Options::dropout_seed)
      .def_rw("dropout_offset", &flashattn::Options::dropout_offset)
      .def_rw("dropout_row_offset", &flashattn::Options::dropout_row_offset)
      .def_rw("dropout_col_offset", &flashattn::Options::dropout_col_offset)
      .def_rw("deterministic", &flashattn::Options::deterministic)
      .def_rw("backend", &flashattn::Options::backend)
      .def_rw("num_threads", &flashattn::Options::num_threads)
      .def_rw("num_splits", &flashattn::Options::num_splits)
      .def_rw("check_indices", &flashattn::Options::check_indices);

  nb::class_<KeptWorkspace>(m, "KeptWorkspace",
                            "A workspace kept from call to call (one per CUDA stream): passed as a call's "
                            "workspace_alloc, its array is the call's workspace, and alloc(nbytes) (-> a 1-D "
                            "uint8 DLPack array) is asked only for more; a new array of at most max_bytes is "
                            "kept for the next calls.")
      .def(
          "__init__",
          [](KeptWorkspace* self, nb::object alloc, std::size_t max_bytes) {
            new (self) KeptWorkspace{std::move(alloc), max_bytes, std::nullopt};
          },
          nb::arg("alloc"), nb::arg("max_bytes"))
      .def_ro("max_bytes", &KeptWorkspace::max_bytes)
      .def_prop_ro("kept_bytes",
                   [](const KeptWorkspace& w) { return w.array ? std::size_t(w.array->shape(0)) : std::size_t(0); })
      .def_prop_ro("kept_address", [](const KeptWorkspace& w) {
        return w.array ? reinterpret_cast<std::uintptr_t>(w.array->data()) : std::uintptr_t(0);
      });

  m.def("forward", &forward, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"), nb::arg("lse").none(),
        nb::kw_only(), nb::arg("options"), nb::arg("alibi_slopes").none() = nb::none(),
        nb::arg("rng_state").none() = nb::none(), nb::arg("cu_seqlens_q").none() = nb::none(),
        nb::arg("cu_seqlens_k").none() = nb::none(), nb::arg("seqused_k").none() = nb::none(),
        nb::arg("max_seqlen_q") = 0, nb::arg("max_seqlen_k") = 0, nb::arg("block_table").none() = nb::none(),
        nb::arg("workspace").none() = nb::none(), nb::arg("stream") = 0, nb::arg("bf16_bits") = false,
        nb::arg("workspace_alloc").none() = nb::none(), nb::arg("sinks").none() = nb::none(),
        nb::arg("q_descale").none() = nb::none(), nb::arg("k_descale").none() = nb::none(),
        nb::arg("v_descale").none() = nb::none(),
        "Writes out (and lse when given). Varlen when cu_seqlens_q/k are given; block_table (b, "
        "max_blocks_per_seq) int32 makes k/v paged caches (num_blocks, page_size, hk, d) of a varlen "
        "call, whose key counts come from seqused_k (or cu_seqlens_k, then optional). rng_state: int64 "
        "{seed, offset} on q's device, read instead of options.dropout_seed/offset. workspace: 1-D "
        "uint8, 256-byte aligned, on q's device, of forward_workspace_size(...) bytes (None when 0). "
        "workspace_alloc: a callable that gets the bytes the call needs when the workspace (or none) "
        "holds less, and returns such an array; or a KeptWorkspace, whose kept array is the workspace "
        "when none is given. sinks: (h) float32 attention sinks (docs/sinks.md). FP8: float8_e4m3fn q, k "
        "and v (CPU backends) with optional (b, hk) float32 q_descale, k_descale, v_descale, into a "
        "bfloat16 or float16 out.");

  m.def("forward_workspace_size", &forward_workspace_size, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::kw_only(),
        nb::arg("options"), nb::arg("alibi_slopes").none() = nb::none(), nb::arg("cu_seqlens_q").none() = nb::none(),
        nb::arg("cu_seqlens_k").none() = nb::none(), nb::arg("seqused_k").none() = nb::none(),
        nb::arg("max_seqlen_q") = 0, nb::arg("max_seqlen_k") = 0, nb::arg("block_table").none() = nb::none(),
        nb::arg("bf16_bits") = false, nb::arg("sinks").none() = nb::none(),
        "Bytes of workspace forward needs for these inputs and options (0 when none); reads only "
        "shapes, dtypes and devices.");

  m.def("backward", &backward, nb::arg("dout"), nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"),
        nb::arg("lse"), nb::arg("dq"), nb::arg("dk"), nb::arg("dv"), nb::arg("softmax_d"), nb::kw_only(),
        nb::arg("options"), nb::arg("alibi_slopes").none() = nb::none(), nb::arg("rng_state").none() = nb::none(),
        nb::arg("cu_seqlens_q").none() = nb::none(), nb::arg("cu_seqlens_k").none() = nb::none(),
        nb::arg("seqused_k").none() = nb::none(), nb::arg("max_seqlen_q") = 0, nb::arg("max_seqlen_k") = 0,
        nb::arg("workspace").none() = nb::none(), nb::arg("stream") = 0, nb::arg("bf16_bits") = false,
        nb::arg("workspace_alloc").none() = nb::none(), nb::arg("sinks").none() = nb::none(),
        nb::arg("dsinks").none() = nb::none(),
        "Writes dq, dk, dv and softmax_d (and dsinks, the (h) float32 gradient of the forward's "
        "sinks, when given with them). workspace: 1-D uint8, 256-byte aligned, on q's device, of "
        "backward_workspace_size(...) bytes (None when 0); too small a workspace raises Error. Or "
        "workspace_alloc, as for forward.");

  m.def("backward_workspace_size", &backward_workspace_size, nb::arg("dout"), nb::arg("q"), nb::arg("k"),
        nb::arg("v"), nb::arg("out"), nb::arg("lse"), nb::kw_only(), nb::arg("options"),
        nb::arg("alibi_slopes").none() = nb::none(), nb::arg("cu_seqlens_q").none() = nb::none(),
        nb::arg("cu_seqlens_k").none() = nb::none(), nb::arg("seqused_k").none() = nb::none(),
        nb::arg("max_seqlen_q") = 0, nb::arg("max_seqlen_k") = 0, nb::arg("bf16_bits") = false,
        nb::arg("sinks").none() = nb::none(),
        "Bytes of workspace backward needs for these inputs and options (0 when none); reads only "
        "shapes, dtypes and devices.");

  m.def("forward_kvcache", &forward_kvcache, nb::arg("q"), nb::arg("k_cache"), nb::arg("v_cache"), nb::arg("out"),
        nb::arg("lse").none(), nb::kw_only(), nb::arg("options"), nb::arg("k").none() = nb::none(),
        nb::arg("v").none() = nb::none(), nb::arg("cache_seqlens").none() = nb::none(),
        nb::arg("cache_batch_idx").none() = nb::none(),
        nb::arg("cache_leftpad").none() = nb::none(), nb::arg("block_table").none() = nb::none(),
        nb::arg("rotary_cos").none() = nb::none(), nb::arg("rotary_sin").none() = nb::none(),
        nb::arg("rotary_interleaved") = false, nb::arg("alibi_slopes").none() = nb::none(),
        nb::arg("workspace").none() = nb::none(), nb::arg("stream") = 0, nb::arg("bf16_bits") = false,
        nb::arg("workspace_alloc").none() = nb::none(), nb::arg("sinks").none() = nb::none(),
        nb::arg("q_descale").none() = nb::none(), nb::arg("k_descale").none() = nb::none(),
        nb::arg("v_descale").none() = nb::none(),
        "Appends k/v into the caches in place (rotated when rotary_cos/sin are given), then attends. "
        "workspace: as for forward, of forward_kvcache_workspace_size(...) bytes; or workspace_alloc. "
        "sinks: (h) float32 attention sinks. FP8: float8_e4m3fn q, caches and k/v with optional "
        "(b, hk) float32 q_descale, k_descale, v_descale, no rotary, into a bfloat16 or float16 out.");

  m.def("forward_kvcache_workspace_size", &forward_kvcache_workspace_size, nb::arg("q"), nb::arg("k_cache"),
        nb::arg("v_cache"), nb::kw_only(), nb::arg("options"), nb::arg("k").none() = nb::none(),
        nb::arg("v").none() = nb::none(), nb::arg("cache_seqlens").none() = nb::none(),
        nb::arg("cache_batch_idx").none() = nb::none(),
        nb::arg("cache_leftpad").none() = nb::none(), nb::arg("block_table").none() = nb::none(),
        nb::arg("rotary_cos").none() = nb::none(), nb::arg("rotary_sin").none() = nb::none(),
        nb::arg("rotary_interleaved") = false, nb::arg("alibi_slopes").none() = nb::none(),
        nb::arg("bf16_bits") = false, nb::arg("sinks").none() = nb::none(),
        "Bytes of workspace forward_kvcache needs for these inputs and options (0 when none); reads "
        "only shapes, dtypes and devices.");

  m.def("combine", &combine, nb::arg("out_partial"), nb::arg("lse_partial"), nb::arg("out"),
        nb::arg("lse").none() = nb::none(), nb::kw_only(), nb::arg("stream") = 0, nb::arg("bf16_bits") = false,
        "Merges partial (out, lse) pairs over disjoint key sets.");

  m.def("build_info", &flashattn::build_info);
  // Waits for the current CUDA device; raises ValueError for an index value that the device-side
  // check of an earlier call found bad (a no-op without CUDA).
  m.def("check_index_errors", &flashattn::check_index_errors, nb::call_guard<nb::gil_scoped_release>());
  m.def("compiled_backends", &compiled_backend_names);
}
