// src/cuda/device_query.h — facts about the current CUDA device that the families' planning
// needs (SMs, shared memory per block, compute capability), each asked once per device.
#pragma once

#include <cuda_runtime.h>

namespace flashattn::cuda {

// Attribute `attr` of the current device, asked once per (device, attribute) for the attributes
// below; 0 when it cannot be asked (the CUDA error is cleared, so that the next launch does not
// report it). Supported: cudaDevAttrMultiProcessorCount, cudaDevAttrMaxSharedMemoryPerBlockOptin,
// cudaDevAttrComputeCapabilityMajor, cudaDevAttrComputeCapabilityMinor.
int current_device_attribute(cudaDeviceAttr attr);

// SMs of the current device (0 when it cannot be asked).
inline int current_sm_count() { return current_device_attribute(cudaDevAttrMultiProcessorCount); }

// Compute capability of the current device as major · 10 + minor (90 for an H100/H200; 0 when
// it cannot be asked).
inline int current_compute_capability() {
  return current_device_attribute(cudaDevAttrComputeCapabilityMajor) * 10 +
         current_device_attribute(cudaDevAttrComputeCapabilityMinor);
}

}  // namespace flashattn::cuda
