// tests/cuda/cuda_test_util.h — running the CUDA backend on test problems built by
// tests/cpp/test_util.h (host tensors): every buffer is mirrored byte for byte into device memory,
// so the host params' strides and offsets stay valid; outputs (poisoned, gaps included) travel
// both ways, so a stray or missing write shows on the host exactly as with the CPU backends.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "api/validate.h"
#include "common/params.h"
#include "cuda/cuda_backend.h"
#include "cuda/device_query.h"
#include "cuda/sm90/sm90_fwd.h"
#include "cuda/sm90/sm90_registry.h"
#include "cuda/sm80/sm80_registry.h"
#include "cuda/sm80/sm80_smem.h"
#include "test_util.h"

namespace fa_test::cuda {

// Whether a CUDA device is usable; otherwise why not.
inline bool gpu_available(std::string* why) {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess || n == 0) {
    if (why) *why = err != cudaSuccess ? cudaGetErrorString(err) : "no CUDA device";
    return false;
  }
  return true;
}

// Whether this GPU and build run the sm90 family; otherwise why not.
inline bool sm90_available(std::string* why) {
  if (!gpu_available(why)) return false;
  if (flashattn::cuda::current_compute_capability() != 90) {
    *why = "the sm90 family needs a compute capability 9.0 GPU";
    return false;
  }
  using flashattn::cuda::sm90::compiled_head_dims;
  using flashattn::cuda::sm90::Family;
  if (compiled_head_dims(Family::fwd, flashattn::common::Storage::bf16) == "none" &&
      compiled_head_dims(Family::fwd, flashattn::common::Storage::f16) == "none") {
    *why = "this build has no sm90 kernels (CMAKE_CUDA_ARCHITECTURES without 90a)";
    return false;
  }
  return true;
}

// The kernel families this GPU and build run (FLASHATTN_CUDA_FAMILY values), for tests that check
// each of them; why sm90 is missing, where it is, goes to the test's output.
inline std::vector<const char*> families_here() {
  std::string why;
  if (sm90_available(&why)) return {"sm80", "sm90"};
  std::printf("NOT RUN on the sm90 family: %s\n", why.c_str());
  return {"sm80"};
}

// Whether the sm90 forward serves paged caches of `page` rows in this build: built with its paged
// kernels (FLASHATTN_SM90_FWD_PAGED) and a page of whole 16-row boxes; otherwise why not goes to
// the test's output.
inline bool sm90_takes_pages(int page) {
  if (!flashattn::cuda::sm90::fwd_paged_built()) {
    std::printf("NOT RUN on the sm90 family: paged caches (built without -DFLASHATTN_SM90_FWD_PAGED=1)\n");
    return false;
  }
  if (page % flashattn::cuda::sm90::kFwdPageChunkRows != 0) {
    std::printf("NOT RUN on the sm90 family: pages of %d rows (it takes multiples of %d)\n", page,
                flashattn::cuda::sm90::kFwdPageChunkRows);
    return false;
  }
  return true;
}

// Skips (saying why) where the sm90 family cannot run: no compute capability 9.0 GPU, or no
// sm_90a kernels in the build.
#define FA_SKIP_WITHOUT_SM90()                                                           \
  do {                                                                                   \
    std::string fa_why_;                                                                 \
    if (!::fa_test::cuda::sm90_available(&fa_why_)) GTEST_SKIP() << "NOT RUN: " << fa_why_; \
  } while (0)

#define FA_SKIP_WITHOUT_GPU()                                                         \
  do {                                                                                \
    std::string fa_why_;                                                              \
    if (!::fa_test::cuda::gpu_available(&fa_why_))                                    \
      GTEST_SKIP() << "NOT RUN: this test needs a CUDA GPU (" << fa_why_ << ")";      \
  } while (0)

// Shared memory per block of the GPU classes whose tile choices the tests run (sm80_smem.h).
inline constexpr int kSmemH100 = 227 * 1024;  // H100, H200
inline constexpr int kSmemA100 = 163 * 1024;  // A100, A30
inline constexpr int kSmemSm86 = 99 * 1024;   // sm86 / sm89: RTX 30xx / 40xx, A10, L4, L40

// For its lifetime, the environment variable `name` is `value` ("" unsets it); the previous
// value is restored.
class EnvOverride {
 public:
  EnvOverride(const char* name, const char* value) : name_(name) {
    const char* old = std::getenv(name);
    had_old_ = old != nullptr;
    if (had_old_) old_ = old;
    if (*value) {
      setenv(name, value, 1);
    } else {
      unsetenv(name);
    }
  }
  ~EnvOverride() {
    if (had_old_) {
      setenv(name_.c_str(), old_.c_str(), 1);
    } else {
      unsetenv(name_.c_str());
    }
  }
  EnvOverride(const EnvOverride&) = delete;
  EnvOverride& operator=(const EnvOverride&) = delete;

 private:
  std::string name_;
  bool had_old_ = false;
  std::string old_;
};

// For its lifetime, the calls run in the kernel family `family` alone ("sm80", "sm90"; "": the
// ordered choice) — FLASHATTN_CUDA_FAMILY (cuda/family.h).
class FamilyOverride : public EnvOverride {
 public:
  explicit FamilyOverride(const char* family) : EnvOverride("FLASHATTN_CUDA_FAMILY", family) {}
};

// For its lifetime, the sm80 kernels choose their tiles as on a GPU with `bytes` of shared memory
// per block (a cap: on this GPU the smaller tiles then run); the calls run in the sm80 family,
// whose tiles these are.
class SmemLimitCap {
 public:
  explicit SmemLimitCap(int bytes) : family_("sm80") { flashattn::cuda::sm80::set_smem_limit_for_testing(bytes); }
  ~SmemLimitCap() { flashattn::cuda::sm80::set_smem_limit_for_testing(0); }
  SmemLimitCap(const SmemLimitCap&) = delete;
  SmemLimitCap& operator=(const SmemLimitCap&) = delete;

 private:
  FamilyOverride family_;
};

// Records a skip (GTEST_SKIP from a helper: the test is reported as skipped unless something else
// fails) saying why a part of it did not run.
inline void record_not_run(const std::string& why) { GTEST_SKIP() << "NOT RUN: " << why; }

// Whether this build compiled a kernel of `family` for the dtype and head dims of p. A restricted
// build (FLASHATTN_CUDA_DTYPES / FLASHATTN_CUDA_HEAD_DIMS, the `dev` preset) leaves some out: then
// the reason, naming the build options, is recorded as a skip and false returned, so the test
// reports what it could not run instead of failing on the refusal.
inline bool kernel_built(flashattn::cuda::sm80::Family family, flashattn::common::Storage storage, int head_dim,
                         int head_dim_v) {
  const int need = head_dim > head_dim_v ? head_dim : head_dim_v;
  if (flashattn::cuda::sm80::compiled_head_dim(family, storage, need) != 0) return true;
  record_not_run(flashattn::cuda::sm80::missing_kernel_reason(family, storage, need));
  return false;
}
inline bool kernel_built(flashattn::cuda::sm80::Family family, const flashattn::common::AttentionParams& p) {
  return kernel_built(family, p.storage, p.head_dim, p.head_dim_v);
}

// The kernels' storage type of a test dtype.
inline flashattn::common::Storage storage_of(DType t) {
  using flashattn::common::Storage;
  return t == DType::bf16 ? Storage::bf16 : t == DType::f16 ? Storage::f16 : Storage::f32;
}

// A dtype for which this build compiled a kernel of `family` at head dim d, bf16 before f16, for
// tests whose subject is not the dtype: they then run in a build restricted to one dtype
// (FLASHATTN_CUDA_DTYPES) instead of failing on the refusal. Where neither is built the skip is
// recorded, naming the build options, and false returned.
inline bool built_dtype(flashattn::cuda::sm80::Family family, int head_dim, DType* dtype) {
  namespace fc = flashattn::cuda;
  for (DType t : {DType::bf16, DType::f16}) {
    if (fc::sm80::compiled_head_dim(family, storage_of(t), head_dim) != 0) {
      *dtype = t;
      return true;
    }
  }
  return kernel_built(family, flashattn::common::Storage::bf16, head_dim, head_dim);
}

// Whether this build compiled bf16 kernels of head dim d for both families' forward (backward
// where asked) — the family-choice tests compare the two on one call; when not, the skip names
// the build options and false is returned.
inline bool both_families_built(int d, bool backward = false) {
  namespace fc = flashattn::cuda;
  const auto storage = flashattn::common::Storage::bf16;
  if (!kernel_built(backward ? fc::sm80::Family::bwd : fc::sm80::Family::fwd, storage, d, d)) return false;
  if (fc::sm90::compiled_head_dim(backward ? fc::sm90::Family::bwd : fc::sm90::Family::fwd, storage, d) != d) {
    record_not_run("no sm90 " + std::string(backward ? "backward" : "forward") + " kernel for bf16 and head dim " +
                   std::to_string(d) + " in this build (FLASHATTN_CUDA_HEAD_DIMS)");
    return false;
  }
  return true;
}

#define FA_CUDA_CHECK(expr)                                                                   \
  do {                                                                                        \
    const cudaError_t fa_err_ = (expr);                                                       \
    if (fa_err_ != cudaSuccess)                                                               \
      throw std::runtime_error(std::string(#expr) + ": " + cudaGetErrorString(fa_err_));      \
  } while (0)

// Device allocations that live as long as the object.
class DeviceArena {
 public:
  DeviceArena() = default;
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;
  ~DeviceArena() {
    for (void* ptr : ptrs_) cudaFree(ptr);
  }
  // `bytes` of uninitialised device memory, 256-byte aligned (nullptr for 0 bytes).
  void* alloc(std::size_t bytes) {
    if (bytes == 0) return nullptr;
    void* dev = nullptr;
    FA_CUDA_CHECK(cudaMalloc(&dev, bytes));
    ptrs_.push_back(dev);
    return dev;
  }
  // A device copy of `bytes` host bytes (nullptr for 0 bytes).
  void* upload(const void* host, std::size_t bytes) {
    void* dev = alloc(bytes);
    if (dev != nullptr) FA_CUDA_CHECK(cudaMemcpy(dev, host, bytes, cudaMemcpyHostToDevice));
    return dev;
  }
  // A device copy of everything a test tensor's view covers, from its data pointer on.
  void* mirror(const Tensor& t) {
    if (!t.defined()) return nullptr;
    return upload(t.data(), bytes_of(t));
  }
  // The device copy of t as a CUDA tensor view with t's shape and strides, for the public API
  // (undefined stays undefined). Its data pointer is what download() takes.
  flashattn::TensorView mirror_view(const Tensor& t) {
    if (!t.defined()) return {};
    flashattn::TensorView v = t.tv();
    v.data = mirror(t);
    v.device = {flashattn::DeviceType::cuda, 0};
    return v;
  }
  template <class T>
  T* upload_vector(const std::vector<T>& v) {
    return static_cast<T*>(upload(v.data(), v.size() * sizeof(T)));
  }
  static std::size_t bytes_of(const Tensor& t) {
    return std::size_t(t.span()) * flashattn::dtype_size(t.dtype());
  }
  static void download(const Tensor& t, const void* dev) {
    if (dev == nullptr) return;
    FA_CUDA_CHECK(cudaMemcpy(t.data(), dev, bytes_of(t), cudaMemcpyDeviceToHost));
  }

 private:
  std::vector<void*> ptrs_;
};

// A Workspace::grow that records what each call asks and returns `give` (a test's device memory,
// or a short or misaligned piece of it).
struct GrowRecorder {
  std::vector<std::size_t> asked;
  flashattn::Workspace give;
  static flashattn::Workspace grow(void* self, std::size_t need) {
    auto* r = static_cast<GrowRecorder*>(self);
    r->asked.push_back(need);
    return r->give;
  }
  // ws with this recorder as its grow.
  flashattn::Workspace on(flashattn::Workspace ws) {
    ws.grow = &GrowRecorder::grow;
    ws.grow_context = this;
    return ws;
  }
};

// Lets a test change the device params before the launch (paged K/V, cache_batch_idx, ...).
using ParamsHook = std::function<void(flashattn::common::AttentionParams&, DeviceArena&)>;

// Device copies of what the params point to besides the tensors: cu_seqlens, seqused_k, ALiBi
// slopes, attention sinks; and of the {seed, offset} pair when given (returned, else nullptr).
inline const std::uint64_t* mirror_batch_layout(const AttnProblem& p, flashattn::common::AttentionParams& dp,
                                                DeviceArena& dev, const std::uint64_t* host_rng_state) {
  if (p.is_varlen()) {
    dp.cu_seqlens_q = static_cast<const std::int32_t*>(dev.mirror(p.cu_seqlens_q));
    dp.cu_seqlens_k = static_cast<const std::int32_t*>(dev.mirror(p.cu_seqlens_k));
    if (p.seqused_k.defined()) dp.seqused_k = static_cast<const std::int32_t*>(dev.mirror(p.seqused_k));
  }
  if (dp.alibi_slopes != nullptr) dp.alibi_slopes = static_cast<const float*>(dev.mirror(p.alibi_slopes));
  if (dp.sinks != nullptr) dp.sinks = static_cast<const float*>(dev.mirror(p.sinks));
  if (host_rng_state == nullptr) return nullptr;
  return static_cast<const std::uint64_t*>(dev.upload(host_rng_state, 2 * sizeof(std::uint64_t)));
}

// Poisoned outputs, the call validated on the host views (the same params the CPU backends get),
// every pointer swapped for its device mirror, flashattn::cuda::forward, results copied back.
// with_workspace: pass a poisoned (all bits set: NaN) workspace of forward_workspace_size bytes,
// sized after the hook ran, so split-KV may run (a hook setting num_splits forces it).
inline ForwardResult run_cuda_forward(const AttnProblem& p, const ParamsHook& hook = {},
                                      const std::uint64_t* host_rng_state = nullptr, bool with_workspace = false) {
  ForwardResult r = make_forward_outputs(p);
  flashattn::ForwardOutputs outs{r.out.tv(), {}};
  if (p.opt.return_lse) outs.lse = r.lse.tv();
  const flashattn::detail::Problem pr = flashattn::detail::validate_forward(p.forward_inputs(), outs, p.opt);
  flashattn::common::AttentionParams dp = pr.params;

  DeviceArena dev;
  dp.q.data = dev.mirror(p.q);
  dp.k.data = dev.mirror(p.k);
  dp.v.data = dev.mirror(p.v);
  void* d_out = dev.mirror(r.out);
  dp.out.data = d_out;
  float* d_lse = p.opt.return_lse ? static_cast<float*>(dev.mirror(r.lse)) : nullptr;
  dp.lse = d_lse;
  const std::uint64_t* d_rng = mirror_batch_layout(p, dp, dev, host_rng_state);
  if (hook) hook(dp, dev);
  if (!kernel_built(flashattn::cuda::sm80::Family::fwd, dp)) {
    r.not_run = true;
    return r;
  }
  void* workspace = nullptr;
  const std::size_t workspace_bytes = with_workspace ? flashattn::cuda::forward_workspace_size(dp) : 0;
  if (workspace_bytes > 0) {
    const std::vector<std::uint8_t> poison(workspace_bytes, 0xff);
    workspace = dev.upload(poison.data(), workspace_bytes);
  }

  flashattn::cuda::forward(dp, nullptr, d_rng, workspace, workspace_bytes);
  FA_CUDA_CHECK(cudaDeviceSynchronize());
  DeviceArena::download(r.out, d_out);
  if (d_lse) DeviceArena::download(r.lse, d_lse);
  return r;
}

// The backward on the device: inputs (fwd: out and lse of a forward of p) and poisoned outputs
// mirrored as above, a workspace of the reported size filled with NaN bytes (the kernels must
// initialise what they read), flashattn::cuda::backward, gradients copied back.
// stream: where the kernels run; alongside: called after they are launched and before the device
// is synchronised (to run other work concurrently with them).
inline BackwardResult run_cuda_backward(const AttnProblem& p, const ForwardResult& fwd,
                                        const std::uint64_t* host_rng_state = nullptr, cudaStream_t stream = nullptr,
                                        const std::function<void()>& alongside = {}) {
  BackwardResult r = make_backward_outputs(p);
  flashattn::BackwardOutputs outs{r.dq.tv(), r.dk.tv(), r.dv.tv(), r.softmax_d.tv()};
  if (r.dsinks.defined()) outs.dsinks = r.dsinks.tv();
  const flashattn::detail::Problem pr = flashattn::detail::validate_backward(p.backward_inputs(fwd), outs, p.opt);
  flashattn::common::AttentionParams dp = pr.params;
  if (fwd.not_run || !kernel_built(flashattn::cuda::sm80::Family::bwd, dp)) {
    r.not_run = true;
    return r;
  }

  DeviceArena dev;
  dp.q.data = dev.mirror(p.q);
  dp.k.data = dev.mirror(p.k);
  dp.v.data = dev.mirror(p.v);
  dp.dout.data = dev.mirror(p.dout);
  dp.out.data = dev.mirror(fwd.out);
  dp.lse = static_cast<float*>(dev.mirror(fwd.lse));
  void* d_dq = dev.mirror(r.dq);
  void* d_dk = dev.mirror(r.dk);
  void* d_dv = dev.mirror(r.dv);
  void* d_softmax_d = dev.mirror(r.softmax_d);
  dp.dq.data = d_dq;
  dp.dk.data = d_dk;
  dp.dv.data = d_dv;
  dp.softmax_d = static_cast<float*>(d_softmax_d);
  void* d_dsinks = dev.mirror(r.dsinks);  // nullptr without sinks
  dp.dsinks = static_cast<float*>(d_dsinks);
  const std::uint64_t* d_rng = mirror_batch_layout(p, dp, dev, host_rng_state);

  const std::int64_t rows = p.is_varlen() ? p.total_q : std::int64_t(p.cfg.batch) * p.total_q;
  const std::vector<std::uint8_t> poison(flashattn::cuda::backward_workspace_size(dp, rows), 0xff);
  void* workspace = dev.upload(poison.data(), poison.size());
  // The uploads are cudaMemcpy from pageable memory on the legacy default stream, which may return
  // before their last DMA has landed; a non-blocking stream is not ordered after them. Without this
  // wait the poison could land after the call's own memsets on such a stream: deterministic
  // turn counters of −1 (0xff bytes) that never come round (a hang), NaN in the dQ accumulator.
  // Only the legacy stream is waited for: a call already running on another stream stays beside
  // this one (the determinism test's two streams at once).
  if (stream != nullptr) FA_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));

  flashattn::cuda::backward(dp, rows, workspace, stream, d_rng);
  if (alongside) alongside();
  FA_CUDA_CHECK(cudaDeviceSynchronize());
  DeviceArena::download(r.dq, d_dq);
  DeviceArena::download(r.dk, d_dk);
  DeviceArena::download(r.dv, d_dv);
  DeviceArena::download(r.softmax_d, d_softmax_d);
  DeviceArena::download(r.dsinks, d_dsinks);
  return r;
}

}  // namespace fa_test::cuda
