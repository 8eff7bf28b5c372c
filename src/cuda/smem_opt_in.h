// src/cuda/smem_opt_in.h — a kernel's opt-in to more than 48 KiB of dynamic shared memory, made
// once per (kernel, device) rather than before every launch. Host code only.
#pragma once

#include <cuda_runtime.h>

#include <atomic>

namespace flashattn::cuda {

inline constexpr int kSmemOptInDevices = 64;

// The per-device flags of one kernel ("opted in on device i"): a static of the launcher
// instantiation that launches it, false at load.
using SmemOptInFlags = std::atomic<bool>[kSmemOptInDevices];

// cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) on the current
// device unless `done` says it was made there: the call goes to the driver (under the context's
// lock) and counted on every launch of a decoding step. An attribute lasts as long as the device's
// primary context, which the library takes to last the process, as its other per-device caches do
// (index_check.cu, device_query.cu). Two threads may both make it the first time, which is
// harmless. When the device cannot be told, the attribute is set as before, every time.
template <class Kernel>
cudaError_t opt_in_dynamic_smem(Kernel* kernel, int bytes, SmemOptInFlags& done) {
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();  // this probe's error is not the launch's
    device = -1;
  }
  const bool known = device >= 0 && device < kSmemOptInDevices;
  if (known && done[device].load(std::memory_order_acquire)) return cudaSuccess;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess && known) done[device].store(true, std::memory_order_release);
  return err;
}

}  // namespace flashattn::cuda
