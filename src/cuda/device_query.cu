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

// One slot per (attribute, device), holding the value plus one; static storage: zero = not asked
// yet. (The minor version is 0 on an H100/H200: stored as it is, it would be asked again on every
// call, three times per forward call through the family choice.)
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
    if (known > 0) return known - 1;
  }
  int value = 0;
  if (cudaDeviceGetAttribute(&value, attr, device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  if (cacheable && value >= 0) cache[slot][device].store(value + 1, std::memory_order_relaxed);
  return value;
}

}  // namespace flashattn::cuda
