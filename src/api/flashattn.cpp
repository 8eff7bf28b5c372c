// src/api/flashattn.cpp — the public entry points: validate (SPEC §5), choose a backend, run.
#include "flashattn/flashattn.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "api/fp8_host.h"
#include "api/validate.h"
#include "common/numeric.h"
#include "cpu/cpu.h"
#ifdef FLASHATTN_WITH_CUDA
#include <cstdlib>

#include "cuda/cuda_backend.h"
#include "cuda/index_check.h"
#include "cuda/kvcache_append.h"
#include "cuda/uncovered.h"
#endif

namespace flashattn {
namespace {

using detail::Problem;

int resolve_threads(const Options& opt) {
  if (opt.num_threads > 0) return opt.num_threads;
  return std::max(1u, std::thread::hardware_concurrency());
}

// The CUDA forward's kernel family, chosen with the backend and run by run_forward: the choice
// asks the device and every family, once per call rather than once per question.
#ifdef FLASHATTN_WITH_CUDA
using ForwardFamily = cuda::FamilyChoice;
#else
struct ForwardFamily {};
#endif

// Backend choice: an ordered list of "can this backend serve it?" checks, each with a reason.
// Validation has already passed, so the question is only where the tensors live and what was
// asked for. family (optional): receives the chosen family of a CUDA forward.
Support choose_backend(const Problem& pr, const Options& opt, ForwardFamily* family = nullptr) {
  Support s;
  if (pr.device.type == DeviceType::cuda) {
#ifdef FLASHATTN_WITH_CUDA
    if (pr.is_backward) {
      std::string why;
      if (!cuda::can_serve_backward(pr.params, &why)) {
        s.reason = why;
        return s;
      }
    } else {
      cuda::FamilyChoice choice = cuda::choose_forward_family(pr.params);
      if (!choice.served) {
        s.reason = choice.why_not;
        return s;
      }
      if (family != nullptr) *family = std::move(choice);
    }
    s.ok = true;
    s.backend = Backend::cuda;
#else
    (void)family;
    s.reason = "no CUDA backend is compiled into this build (configure with -DFLASHATTN_CUDA=ON)";
#endif
    return s;
  }
  s.ok = true;
  s.backend = opt.backend == Backend::cpu_reference ? Backend::cpu_reference : Backend::cpu;
  return s;
}

Support require_backend(const Problem& pr, const Options& opt, const char* api, ForwardFamily* family = nullptr) {
  Support s = choose_backend(pr, opt, family);
  if (!s.ok) throw Error(std::string(api) + ": " + s.reason);
  return s;
}

#ifdef FLASHATTN_WITH_CUDA
// --- index values in device memory (src/cuda/index_check.h) ------------------------------------

const char* index_api_name(int api) {
  switch (common::IndexApi(api)) {
    case common::IndexApi::backward: return "flashattn::backward";
    case common::IndexApi::forward_kvcache: return "flashattn::forward_kvcache";
    default: return "flashattn::forward";
  }
}

// A violation that the device-side check of an earlier call recorded: the next CUDA call on the
// device throws it (that call does not run).
void raise_pending_index_violation() {
  const common::IndexViolation v = cuda::take_pending_index_violation();
  if (v) {
    throw Error(detail::index_violation_message(index_api_name(v.api), v) +
                " (found on the device by an earlier call, whose kernels then read and wrote nothing)");
  }
}

bool synchronous_index_check(const Options& opt) {
  static const bool from_environment = [] {
    const char* value = std::getenv("FLASHATTN_CHECK_INDICES");
    return value != nullptr && std::string(value) == "1";
  }();
  return opt.check_indices || from_environment;
}

// Before a CUDA call's kernels: an earlier call's violation, then the check of this call's index
// tensors, whose flag every kernel of the call reads at its start. launch false: the call's first
// kernel launches the check or folds it into its prologue (forward_kvcache: cuda::kvcache_append).
void start_index_check(Problem& pr, void* stream, bool launch = true) {
  raise_pending_index_violation();
  if (!pr.index_bounds.any()) return;
  pr.params.index_error = cuda::index_error_flag();
  if (launch) cuda::check_indices(pr.index_bounds, stream);
}

// After them: when asked for, wait and throw this call's violation.
void finish_index_check(const Problem& pr, const Options& opt, void* stream) {
  if (!pr.index_bounds.any() || !synchronous_index_check(opt)) return;
  const common::IndexViolation v = cuda::take_index_violation(stream);
  if (v) throw Error(detail::index_violation_message(index_api_name(v.api), v));
}
#endif

// split_kv: device workspace the CUDA forward may use for split-KV (see split_kv_workspace_size);
// too little or none runs unsplit. family: what require_backend chose for a CUDA forward.
void run_forward(const Problem& pr, const Support& s, const Options& opt, Stream stream, Workspace split_kv = {},
                 const ForwardFamily& family = {}) {
#ifdef FLASHATTN_WITH_CUDA
  if (s.backend == Backend::cuda) {
    cuda::forward(family, pr.params, stream.handle, opt.dropout_rng_state, split_kv.data, split_kv.bytes);
    cuda::fill_uncovered_rows(pr.params, pr.total_q, pr.total_k, false, stream.handle);
    return;
  }
#else
  (void)stream;
  (void)split_kv;
  (void)family;
#endif
  if (s.backend == Backend::cpu_reference) {
    cpu::reference_forward(pr.params, cpu::RefPrecision::fp64, nullptr, resolve_threads(opt));
  } else {
    cpu::flash_forward(pr.params, resolve_threads(opt));
  }
  cpu::fill_uncovered_rows(pr.params, pr.total_q, pr.total_k, false);
}

// Rows of q across the batch: b · sq, or total_q for a varlen batch.
[[maybe_unused]] std::int64_t total_q_rows(const TensorView& q, const Varlen& varlen) {
  return varlen.enabled() ? q.shape[0] : q.shape[0] * q.shape[1];
}

// SPEC §4: device scratch comes from the caller; too little of it (or a misaligned pointer) is an
// argument error, raised before anything is written.
[[maybe_unused]] void check_workspace(const char* api, const Workspace& ws, std::size_t need) {
  constexpr std::size_t kAlign = 256;
  if (need == 0) return;
  if (ws.data == nullptr || ws.bytes < need) {
    throw Error(std::string(api) + ": workspace: too small (ask the matching *_workspace_size); expected at least " +
                std::to_string(need) + " bytes, got " + std::to_string(ws.data == nullptr ? 0 : ws.bytes));
  }
  if (reinterpret_cast<std::uintptr_t>(ws.data) % kAlign != 0) {
    throw Error(std::string(api) + ": workspace: must be 256-byte aligned; expected an aligned pointer, got offset " +
                std::to_string(reinterpret_cast<std::uintptr_t>(ws.data) % kAlign));
  }
}

// The workspace a CUDA call runs with: the caller's, or, where that holds less than `need` and
// the caller gave Workspace::grow, the one grow returns — asked once, after validation and
// before anything is written, and checked for its size and alignment.
[[maybe_unused]] Workspace grown_workspace(const char* api, const Workspace& ws, std::size_t need) {
  constexpr std::size_t kAlign = 256;
  if (ws.grow == nullptr || need == 0 || (ws.data != nullptr && ws.bytes >= need)) return ws;
  const Workspace given = ws.grow(ws.grow_context, need);
  const std::size_t offset = reinterpret_cast<std::uintptr_t>(given.data) % kAlign;
  if (given.data == nullptr || given.bytes < need || offset != 0) {
    throw Error(std::string(api) + ": workspace: grow must return at least " + std::to_string(need) +
                " bytes, 256-byte aligned; got " + std::to_string(given.data == nullptr ? 0 : given.bytes) +
                " bytes at alignment offset " + std::to_string(offset));
  }
  return {given.data, given.bytes};
}

// --- split-KV workspace of the CUDA forward ---------------------------------------------------
// The bytes the CUDA forward can use for split-KV partials (cuda::forward_workspace_size), from
// shapes and options only, so that the size query and the call agree. It is optional: forward and
// forward_kvcache run unsplit without it. In forward_kvcache's workspace it follows the KV-cache
// region.
[[maybe_unused]] std::size_t split_kv_workspace_size(DType dtype, const Device& device, std::int64_t batch,
                                                     std::int64_t seqlen_q, std::int64_t seqlen_k, std::int64_t heads,
                                                     std::int64_t heads_k, std::int64_t head_dim,
                                                     std::int64_t head_dim_v, const Options& opt, bool paged) {
#ifdef FLASHATTN_WITH_CUDA
  if (device.type != DeviceType::cuda || (dtype != DType::f16 && dtype != DType::bf16)) return 0;
  common::AttentionParams p;
  p.storage = dtype == DType::f16 ? common::Storage::f16 : common::Storage::bf16;
  p.batch = int(batch);
  p.max_seqlen_q = int(seqlen_q);
  p.max_seqlen_k = int(seqlen_k);
  p.heads = int(heads);
  p.heads_k = int(heads_k);
  p.head_dim = int(head_dim);
  p.head_dim_v = int(head_dim_v);
  // What decides the kernel variant and the visible key range, as validation would set it.
  p.causal = opt.causal;
  p.window_left = opt.window_left;
  p.window_right = opt.window_right;
  p.softcap = opt.softcap;
  p.dropout_p = opt.dropout_p;
  p.num_splits = opt.num_splits;
  static const float kAnySlopes = 0.0f;  // only "given or not" matters here
  p.alibi_slopes = opt.alibi_slopes.defined() ? &kAnySlopes : nullptr;
  // Paged K/V take other kernels (no short-sequence tile): only "paged or not" matters here.
  static const std::int32_t kAnyPageTable = 0;
  p.block_table = paged ? &kAnyPageTable : nullptr;
  return cuda::forward_workspace_size(p);
#else
  (void)dtype, (void)device, (void)batch, (void)seqlen_q, (void)seqlen_k, (void)heads, (void)heads_k;
  (void)head_dim, (void)head_dim_v, (void)opt, (void)paged;
  return 0;
#endif
}

// The split-KV part of forward_kvcache's workspace: the cache is (b_cache, sk_cache, hk, d), or
// paged (pages, page_size, hk, d) with block_table (b, pages per sequence).
[[maybe_unused]] std::size_t kvcache_split_kv_workspace_size(const KVCacheInputs& in, const Options& opt) {
  if (in.q.ndim != 4 || in.k_cache.ndim != 4 || in.v_cache.ndim != 4) return 0;
  const std::int64_t capacity =
      in.block_table.defined() && in.block_table.ndim == 2 ? in.block_table.shape[1] * in.k_cache.shape[1]
                                                           : in.k_cache.shape[1];
  return split_kv_workspace_size(in.q.dtype, in.q.device, in.q.shape[0], in.q.shape[1], capacity, in.q.shape[2],
                                 in.k_cache.shape[2], in.q.shape[3], in.v_cache.shape[3], opt,
                                 in.block_table.defined());
}

// n rounded up to the 256-byte alignment of every workspace region.
[[maybe_unused]] std::size_t workspace_align(std::size_t n) {
  constexpr std::size_t kAlign = 256;
  return (n + kAlign - 1) / kAlign * kAlign;
}

// The part of `ws` from byte `offset` on (none when offset leaves nothing).
[[maybe_unused]] Workspace workspace_from(const Workspace& ws, std::size_t offset) {
  if (ws.data == nullptr || ws.bytes <= offset) return {};
  return {static_cast<char*>(ws.data) + offset, ws.bytes - offset};
}

template <class Validate>
Support support_of(Validate&& validate, const Options& opt) {
  try {
    const Problem pr = validate();
    return choose_backend(pr, opt);
  } catch (const Error& e) {
    Support s;
    s.reason = e.what();
    return s;
  }
}

}  // namespace

void forward(const ForwardInputs& in, const ForwardOutputs& out, const Options& opt, Workspace workspace,
             Stream stream) {
  Problem pr = detail::validate_forward(in, out, opt);
  ForwardFamily family;
  const Support s = require_backend(pr, opt, "flashattn::forward", &family);
  // FP8 inputs (validation admits them on the CPU backends only): by way of fp32.
  if (pr.dtype == DType::f8e4m3) {
    detail::forward_fp8_on_host(in, out, opt);
    return;
  }
#ifdef FLASHATTN_WITH_CUDA
  if (s.backend == Backend::cuda) {
    if (workspace.grow != nullptr) {
      workspace = grown_workspace("flashattn::forward", workspace, cuda::forward_workspace_size(family, pr.params));
    }
    start_index_check(pr, stream.handle);
    run_forward(pr, s, opt, stream, workspace, family);
    finish_index_check(pr, opt, stream.handle);
    return;
  }
#endif
  run_forward(pr, s, opt, stream, workspace);
}

void backward(const BackwardInputs& in, const BackwardOutputs& out, const Options& opt, Workspace workspace,
              Stream stream) {
  Problem pr = detail::validate_backward(in, out, opt);
  const Support s = require_backend(pr, opt, "flashattn::backward");
#ifdef FLASHATTN_WITH_CUDA
  if (s.backend == Backend::cuda) {
    const std::int64_t rows = total_q_rows(in.q, in.varlen);
    const std::size_t need = cuda::backward_workspace_size(pr.params, rows);
    workspace = grown_workspace("flashattn::backward", workspace, need);
    check_workspace("flashattn::backward", workspace, need);
    start_index_check(pr, stream.handle);
    cuda::backward(pr.params, rows, workspace.data, stream.handle, opt.dropout_rng_state);
    cuda::fill_uncovered_rows(pr.params, pr.total_q, pr.total_k, true, stream.handle);
    finish_index_check(pr, opt, stream.handle);
    return;
  }
#else
  (void)workspace;
  (void)stream;
#endif
  if (s.backend == Backend::cpu_reference) {
    cpu::reference_backward(pr.params, cpu::RefPrecision::fp64, nullptr, resolve_threads(opt));
  } else {
    cpu::flash_backward(pr.params, resolve_threads(opt));
  }
  cpu::fill_uncovered_rows(pr.params, pr.total_q, pr.total_k, true);
}

void forward_kvcache(const KVCacheInputs& in, const ForwardOutputs& out, const Options& opt, Workspace workspace,
                     Stream stream) {
  Problem pr = detail::validate_kvcache(in, out, opt);
  ForwardFamily family;
  const Support s = require_backend(pr, opt, "flashattn::forward_kvcache", &family);
  // FP8 inputs (validation admits them on the CPU backends only): by way of fp32.
  if (pr.dtype == DType::f8e4m3) {
    detail::forward_kvcache_fp8_on_host(in, out, opt);
    return;
  }
  common::AttentionParams& p = pr.params;

  common::AppendArgs a;
  a.cache_seqlens = in.cache_seqlens.defined() ? static_cast<const std::int32_t*>(in.cache_seqlens.data) : nullptr;
  if (in.k_new.defined()) {
    a.k_new = in.k_new.data;
    a.v_new = in.v_new.data;
    a.seqlen_new = int(in.k_new.shape[1]);
    for (int i = 0; i < 3; ++i) {
      a.k_new_strides[i] = in.k_new.stride[i];
      a.v_new_strides[i] = in.v_new.stride[i];
    }
  }
  if (in.rotary_cos.defined()) {
    a.rotary_cos = in.rotary_cos.data;
    a.rotary_sin = in.rotary_sin.data;
    a.rotary_cos_stride = in.rotary_cos.stride[0];
    a.rotary_sin_stride = in.rotary_sin.stride[0];
    a.rotary_dim = int(2 * in.rotary_cos.shape[1]);
    a.rotary_interleaved = in.rotary_interleaved;
  }
  const bool q_positions_per_row = common::rotary_q_positions_per_row(p);
  // Left padding moves where the attention's keys start, not where the append writes (absolute
  // rows): the params get it after the append.
  const auto* leftpad = in.cache_leftpad.defined() ? static_cast<const std::int32_t*>(in.cache_leftpad.data) : nullptr;

#ifdef FLASHATTN_WITH_CUDA
  if (s.backend == Backend::cuda) {
    // Append and rotate on the device, on the caller's stream: the lengths after the append and
    // the rotated q go to the workspace's KV-cache region, where the attention reads them.
    const cuda::KvcacheWorkspace region = cuda::kvcache_workspace(
        p.batch, in.q.numel(), dtype_size(in.q.dtype), in.k_new.defined(), in.rotary_cos.defined());
    // Only the KV-cache region is required; the split-KV part after it is optional (asked of
    // grow in full, as forward_kvcache_workspace_size counts it).
    if (workspace.grow != nullptr) {
      // With rotary the attention reads the rotated q, a contiguous copy at an aligned offset of
      // the workspace, and the family is chosen again for it below: sized here for the family that
      // layout gets (the address a stand-in with the region's alignment; nothing reads it), so
      // that the split-KV part fits the family that runs.
      ForwardFamily sized_for = family;
      if (a.rotary_dim > 0) {
        common::AttentionParams rotated = p;
        rotated.q = common::contiguous_q(reinterpret_cast<void*>(std::uintptr_t{256}), p);
        ForwardFamily guess = cuda::choose_forward_family(rotated);
        if (guess.served) sized_for = std::move(guess);
      }
      const std::size_t need = workspace_align(region.bytes) + cuda::forward_workspace_size(sized_for, p);
      workspace = grown_workspace("flashattn::forward_kvcache", workspace, need);
    }
    check_workspace("flashattn::forward_kvcache", workspace, region.bytes);
    start_index_check(pr, stream.handle, false);
    // Without an append kernel the check may fold into the attention's first kernel: the sm80
    // forward's checks it (with rotary the append kernel runs, so the family chosen here stands;
    // with no query row no kernel runs, and the check keeps its own).
    cuda::kvcache_append(p, a, q_positions_per_row, region, workspace.data, stream.handle, pr.index_bounds,
                         family.family == cuda::Family::sm80 && p.max_seqlen_q > 0);
    p.k_leftpad = leftpad;
    // The rotated q is a contiguous copy in the workspace, whose layout the family choice also
    // reads: chosen again for it.
    if (a.rotary_dim > 0) family = cuda::choose_forward_family(p);
    run_forward(pr, s, opt, stream, workspace_from(workspace, region.bytes), family);
    finish_index_check(pr, opt, stream.handle);
    return;
  }
#else
  (void)workspace;
#endif

  // Lengths after the append: what the attention reads.
  std::vector<std::int32_t> seqlens_after;
  if (a.cache_seqlens) {
    seqlens_after.assign(a.cache_seqlens, a.cache_seqlens + p.batch);
    for (std::int32_t& len : seqlens_after) len += a.seqlen_new;
  }
  if (a.k_new) cpu::append_kv(p, a);

  std::vector<std::uint8_t> q_rotated;
  if (a.rotary_dim > 0) {
    q_rotated.resize(std::size_t(in.q.numel()) * dtype_size(in.q.dtype));
    cpu::rotate_q(p, a, q_positions_per_row, q_rotated.data());
    p.q = common::contiguous_q(q_rotated.data(), p);
  }
  if (!seqlens_after.empty()) p.cache_seqlens = seqlens_after.data();
  p.k_leftpad = leftpad;
  run_forward(pr, s, opt, stream);
}

void combine(const CombineInputs& in, const ForwardOutputs& out, Workspace, Stream stream) {
  detail::validate_combine(in, out);
  if (in.out_partial.device.type != DeviceType::cpu) {
#ifdef FLASHATTN_WITH_CUDA
    const TensorView& op = in.out_partial;
    cuda::CombineParams c;
    c.splits = int(op.shape[0]);
    c.batch = int(op.shape[1]);
    c.max_seqlen_q = int(op.shape[2]);
    c.heads = int(op.shape[3]);
    c.head_dim_v = int(op.shape[4]);
    c.out_partial = static_cast<const float*>(op.data);
    c.out_partial_split_stride = op.stride[0];
    c.out_partial_batch_stride = op.stride[1];
    c.out_partial_row_stride = op.stride[2];
    c.out_partial_head_stride = op.stride[3];
    c.lse_partial = static_cast<const float*>(in.lse_partial.data);
    c.lse_partial_split_stride = in.lse_partial.stride[0];
    c.lse_partial_batch_stride = in.lse_partial.stride[1];
    c.lse_partial_head_stride = in.lse_partial.stride[2];
    c.out.data = out.out.data;
    c.out.batch_stride = out.out.stride[0];
    c.out.row_stride = out.out.stride[1];
    c.out.head_stride = out.out.stride[2];
    c.out_storage = out.out.dtype == DType::f16    ? common::Storage::f16
                    : out.out.dtype == DType::bf16 ? common::Storage::bf16
                                                   : common::Storage::f32;
    if (out.lse.defined()) {
      c.lse = static_cast<float*>(out.lse.data);
      c.lse_batch_stride = out.lse.stride[0];
      c.lse_head_stride = out.lse.stride[1];
    }
    cuda::combine(c, stream.handle);
    return;
#else
    (void)stream;
    throw Error("flashattn::combine: no CUDA backend is compiled into this build (configure with -DFLASHATTN_CUDA=ON)");
#endif
  }
  cpu::CombineArgs a;
  a.out_partial = static_cast<const float*>(in.out_partial.data);
  for (int i = 0; i < 5; ++i) a.op_strides[i] = in.out_partial.stride[i];
  a.lse_partial = static_cast<const float*>(in.lse_partial.data);
  a.out = out.out.data;
  for (int i = 0; i < 4; ++i) a.out_strides[i] = out.out.stride[i];
  a.out_storage = out.out.dtype == DType::f16 ? common::Storage::f16
                  : out.out.dtype == DType::bf16 ? common::Storage::bf16
                                                 : common::Storage::f32;
  a.lse = out.lse.defined() ? static_cast<float*>(out.lse.data) : nullptr;
  a.splits = int(in.out_partial.shape[0]);
  a.batch = int(in.out_partial.shape[1]);
  a.seqlen_q = int(in.out_partial.shape[2]);
  a.heads = int(in.out_partial.shape[3]);
  a.head_dim_v = int(in.out_partial.shape[4]);
  cpu::combine(a);
}

std::size_t forward_workspace_size(const ForwardInputs& in, const Options& opt) {
  // The CPU backends keep their scratch on the host heap; no device workspace is needed. CUDA
  // tensors: the optional split-KV partials (only shapes are read).
  const TensorView& q = in.q;
  // K/V have q's rank, or 4 as paged caches (num_blocks, page_size, hk, d) of a varlen call.
  const int kv_rank = in.block_table.defined() ? 4 : q.ndim;
  if (q.ndim < 3 || in.k.ndim != kv_rank || in.v.ndim != kv_rank) return 0;
  const int n = q.ndim;
  const bool varlen = in.varlen.enabled();
  const std::int64_t batch = varlen ? in.varlen.cu_seqlens_q.shape[0] - 1 : q.shape[0];
  const std::int64_t seqlen_q = varlen ? in.varlen.max_seqlen_q : q.shape[1];
  const std::int64_t seqlen_k = varlen ? in.varlen.max_seqlen_k : in.k.shape[1];
  return split_kv_workspace_size(q.dtype, q.device, batch, seqlen_q, seqlen_k, q.shape[n - 2],
                                 in.k.shape[kv_rank - 2], q.shape[n - 1], in.v.shape[kv_rank - 1], opt,
                                 in.block_table.defined());
}
std::size_t backward_workspace_size(const BackwardInputs& in, const Options& opt) {
#ifdef FLASHATTN_WITH_CUDA
  // Only shapes are read: the params the kernels size their buffers by, without validation.
  if (in.q.device.type != DeviceType::cuda || in.q.ndim < 3) return 0;
  common::AttentionParams p;
  // The dtype picks the compiled head dim (builds may compile different sets per dtype).
  p.storage = in.q.dtype == DType::bf16 ? common::Storage::bf16 : common::Storage::f16;
  p.heads = int(in.q.shape[in.q.ndim - 2]);
  p.head_dim = int(in.q.shape[in.q.ndim - 1]);
  p.head_dim_v = in.v.ndim > 0 ? int(in.v.shape[in.v.ndim - 1]) : p.head_dim;
  p.deterministic = opt.deterministic;
  if (in.varlen.enabled()) {
    p.batch = int(in.varlen.cu_seqlens_q.shape[0] - 1);
    p.max_seqlen_q = in.varlen.max_seqlen_q;
    // The packed rows and the varlen mode, as the validated call has them: the sm90 backward lays
    // its scratch rows out per sequence (total_q + (batch + 1) row blocks, which may exceed
    // batch · max_seqlen_q). Only compared with nullptr here, never read.
    static const int kVarlenMarker = 0;
    p.cu_seqlens_q = &kVarlenMarker;
    p.total_q = in.q.shape[0];
  } else {
    p.batch = int(in.q.shape[0]);
    p.max_seqlen_q = int(in.q.shape[1]);
  }
  // The kernel family that serves the call also depends on the outputs' layouts, unknown here:
  // the largest need among those that could.
  return cuda::backward_workspace_bound(p, total_q_rows(in.q, in.varlen));
#else
  (void)in;
  (void)opt;
  return 0;
#endif
}
std::size_t forward_kvcache_workspace_size(const KVCacheInputs& in, const Options& opt) {
  (void)opt;
#ifdef FLASHATTN_WITH_CUDA
  // CUDA tensors: the KV-cache region (lengths after the append, rotated q; see
  // cuda::kvcache_workspace) first, then what the attention needs, each part 256-byte aligned.
  // Only shapes are read.
  if (in.q.device.type != DeviceType::cuda || in.q.ndim != 4) return 0;
  const std::size_t kvcache_bytes = cuda::kvcache_workspace(in.q.shape[0], in.q.numel(), dtype_size(in.q.dtype),
                                                            in.k_new.defined(), in.rotary_cos.defined())
                                        .bytes;
  return workspace_align(kvcache_bytes) + kvcache_split_kv_workspace_size(in, opt);
#else
  (void)in;
  return 0;
#endif
}

Support can_implement(const ForwardInputs& in, const ForwardOutputs& out, const Options& opt) {
  return support_of([&] { return detail::validate_forward(in, out, opt); }, opt);
}
Support can_implement(const BackwardInputs& in, const BackwardOutputs& out, const Options& opt) {
  return support_of([&] { return detail::validate_backward(in, out, opt); }, opt);
}
Support can_implement(const KVCacheInputs& in, const ForwardOutputs& out, const Options& opt) {
  return support_of([&] { return detail::validate_kvcache(in, out, opt); }, opt);
}

void check_index_errors() {
#ifdef FLASHATTN_WITH_CUDA
  const common::IndexViolation v = cuda::take_device_index_violation();
  if (v) throw Error(detail::index_violation_message(index_api_name(v.api), v));
#endif
}

std::vector<Backend> compiled_backends() {
#ifdef FLASHATTN_WITH_CUDA
  return {Backend::cpu, Backend::cpu_reference, Backend::cuda};
#else
  return {Backend::cpu, Backend::cpu_reference};
#endif
}

std::string build_info() {
#ifdef FLASHATTN_WITH_CUDA
  return std::string("flashattn ") + FLASHATTN_VERSION + " (backends: cpu, cpu_reference, cuda; CUDA: " +
         cuda::compiled_kernels() + ")";
#else
  return std::string("flashattn ") + FLASHATTN_VERSION + " (backends: cpu, cpu_reference; CUDA: not built)";
#endif
}

}  // namespace flashattn
