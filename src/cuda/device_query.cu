// src/cuda/device_query.cu — the cached device attributes of device_query.h.
#include "cuda/device_query.h"

#include <atomic>

namespace flashattn::cuda {
namespace {

constexpr int kMaxCachedDevices = 64;
constexpr cudaDeviceAttr kCachedAttributes[] = {
    cudaDevAttrMultiProcessorCount, cudaDevAttrMaxSharedMemoryPerBlockOptin, cudaDevAttrComputeCapabilityMajor,
    cudaDevAttrComputeCapabilityMinor};
constexpr int kAttributeCount = int(sizeof(kCachedAttributes) / sizeof(kCachedAttributes[0]));

// One slot per (attribute, device); static storage: zero = not asked yet (every cached attribute
// of a working device is positive, but the minor version, which may be 0 and is then re-asked).
std::atomic<int> cache[kAttributeCount][kMaxCachedDevices];

}  // namespace

int current_device_attribute(cudaDeviceAttr attr) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  int slot = -1;
  for (int i = 0; i < kAttributeCount; ++i) {
    if (kCachedAttributes[i] == attr) slot = i;
  }
  const bool cacheable = slot >= 0 && device >= 0 && device < kMaxCachedDevices;
  if (cacheable) {
    const int known = cache[slot][device].load(std::memory_order_relaxed);
    if (known > 0) return known;
  }
  int value = 0;
  if (cudaDeviceGetAttribute(&value, attr, device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  if (cacheable) cache[slot][device].store(value, std::memory_order_relaxed);
  return value;
}

}  // namespace flashattn::cuda
