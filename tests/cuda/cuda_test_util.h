// tests/cuda/cuda_test_util.h — running the CUDA backend on test problems built by
// tests/cpp/test_util.h (host tensors): every buffer is mirrored byte for byte into device memory,
// so the host params' strides and offsets stay valid; outputs (poisoned, gaps included) travel
// both ways, so a stray or missing write shows on the host exactly as with the CPU backends.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "api/validate.h"
#include "common/params.h"
#include "cuda/cuda_backend.h"
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

#define FA_SKIP_WITHOUT_GPU()                                                         \
  do {                                                                                \
    std::string fa_why_;                                                              \
    if (!::fa_test::cuda::gpu_available(&fa_why_))                                    \
      GTEST_SKIP() << "NOT RUN: this test needs a CUDA GPU (" << fa_why_ << ")";      \
  } while (0)

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
  // A device copy of `bytes` host bytes (nullptr for 0 bytes).
  void* upload(const void* host, std::size_t bytes) {
    if (bytes == 0) return nullptr;
    void* dev = nullptr;
    FA_CUDA_CHECK(cudaMalloc(&dev, bytes));
    ptrs_.push_back(dev);
    FA_CUDA_CHECK(cudaMemcpy(dev, host, bytes, cudaMemcpyHostToDevice));
    return dev;
  }
  // A device copy of everything a test tensor's view covers, from its data pointer on.
  void* mirror(const Tensor& t) {
    if (!t.defined()) return nullptr;
    return upload(t.data(), bytes_of(t));
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

// Lets a test change the device params before the launch (paged K/V, cache_batch_idx, ...).
using ParamsHook = std::function<void(flashattn::common::AttentionParams&, DeviceArena&)>;

// Poisoned outputs, the call validated on the host views (the same params the CPU backends get),
// every pointer swapped for its device mirror, flashattn::cuda::forward, results copied back.
inline ForwardResult run_cuda_forward(const AttnProblem& p, const ParamsHook& hook = {},
                                      const std::uint64_t* host_rng_state = nullptr) {
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
  if (p.is_varlen()) {
    dp.cu_seqlens_q = static_cast<const std::int32_t*>(dev.mirror(p.cu_seqlens_q));
    dp.cu_seqlens_k = static_cast<const std::int32_t*>(dev.mirror(p.cu_seqlens_k));
    if (p.seqused_k.defined()) dp.seqused_k = static_cast<const std::int32_t*>(dev.mirror(p.seqused_k));
  }
  if (dp.alibi_slopes != nullptr) dp.alibi_slopes = static_cast<const float*>(dev.mirror(p.alibi_slopes));
  const std::uint64_t* d_rng = nullptr;
  if (host_rng_state != nullptr) {
    d_rng = static_cast<const std::uint64_t*>(dev.upload(host_rng_state, 2 * sizeof(std::uint64_t)));
  }
  if (hook) hook(dp, dev);

  flashattn::cuda::forward(dp, nullptr, d_rng);
  FA_CUDA_CHECK(cudaDeviceSynchronize());
  DeviceArena::download(r.out, d_out);
  if (d_lse) DeviceArena::download(r.lse, d_lse);
  return r;
}

}  // namespace fa_test::cuda
