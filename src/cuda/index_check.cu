// src/cuda/index_check.cu — the device-side index check (see index_check.h).
#include "cuda/index_check.h"

#include <cuda_runtime.h>

#include <atomic>
#include <mutex>
#include <string>

#include "flashattn/error.h"

namespace flashattn::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kMaxDevices = 64;

// One violation, as plain data (a __device__ variable cannot have constructors). state: 0 none,
// 1 recorded (set by the first thread that finds one; the others leave the record alone).
struct Record {
  int state;
  int rule, side, batch, entry, api;
  long long value, bound;
};

// Per device (a __device__ variable exists once per device context), zero at load.
__device__ Record g_record;

// The host's view: mapped, pinned host memory, one record per device, written by the device.
std::once_flag g_mirror_once[kMaxDevices];
std::atomic<Record*> g_mirror[kMaxDevices];  // static storage: null until a check ran on the device

int current_device() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) {
    throw Error("flashattn (CUDA): cannot tell the current device for the index check");
  }
  return device;
}

Record* mirror_of(int device) {
  std::call_once(g_mirror_once[device], [device] {
    void* host = nullptr;
    if (cudaHostAlloc(&host, sizeof(Record), cudaHostAllocMapped | cudaHostAllocPortable) != cudaSuccess) {
      cudaGetLastError();
      throw Error("flashattn (CUDA): cannot allocate the pinned host record of the index check");
    }
    *static_cast<Record*>(host) = Record{};
    g_mirror[device].store(static_cast<Record*>(host), std::memory_order_release);
  });
  return g_mirror[device].load(std::memory_order_acquire);
}

__global__ void __launch_bounds__(kThreads) check_indices_kernel(const common::IndexBounds ib, Record* mirror) {
  const int b = blockIdx.x * kThreads + threadIdx.x;
  if (b >= ib.batch) return;
  const common::IndexViolation v = common::check_sequence_indices(ib, b);
  if (!v || atomicCAS(&g_record.state, 0, 1) != 0) return;
  const Record r{1, int(v.rule), int(v.side), v.batch, v.entry, int(ib.api), v.value, v.bound};
  g_record = r;
  // The host reads the mirror without synchronising: its fields first, then the state.
  Record* m = mirror;
  m->rule = r.rule, m->side = r.side, m->batch = r.batch, m->entry = r.entry, m->api = r.api;
  m->value = r.value, m->bound = r.bound;
  __threadfence_system();
  *reinterpret_cast<volatile int*>(&m->state) = 1;
}

common::IndexViolation violation_of(const Record& r) {
  common::IndexViolation v;
  v.rule = common::IndexRule(r.rule);
  v.side = common::IndexSide(r.side);
  v.batch = r.batch;
  v.entry = r.entry;
  v.value = r.value;
  v.bound = r.bound;
  v.api = r.api;
  return v;
}

// Copies out the device's record and clears it and the mirror (after the device is idle, so no
// check still in flight can set them again behind the clear).
common::IndexViolation take(int device) {
  if (cudaDeviceSynchronize() != cudaSuccess) {
    throw Error(std::string("flashattn (CUDA): index check: ") + cudaGetErrorString(cudaGetLastError()));
  }
  Record r{};
  const Record zero{};
  if (cudaMemcpyFromSymbol(&r, g_record, sizeof r) != cudaSuccess || cudaMemcpyToSymbol(g_record, &zero, sizeof zero) != cudaSuccess) {
    throw Error(std::string("flashattn (CUDA): index check: ") + cudaGetErrorString(cudaGetLastError()));
  }
  *mirror_of(device) = zero;
  return r.state != 0 ? violation_of(r) : common::IndexViolation{};
}

}  // namespace

const int* index_error_flag() {
  static std::atomic<const int*> flags[kMaxDevices];  // static storage: null = not asked yet
  const int device = current_device();
  const int* known = flags[device].load(std::memory_order_relaxed);
  if (known != nullptr) return known;
  void* address = nullptr;
  if (cudaGetSymbolAddress(&address, g_record) != cudaSuccess) {
    throw Error(std::string("flashattn (CUDA): index check: ") + cudaGetErrorString(cudaGetLastError()));
  }
  const int* flag = &static_cast<const Record*>(address)->state;
  flags[device].store(flag, std::memory_order_relaxed);
  return flag;
}

void check_indices(const common::IndexBounds& ib, void* stream) {
  if (!ib.any() || ib.batch <= 0) return;
  Record* mirror = mirror_of(current_device());
  const int blocks = (ib.batch + kThreads - 1) / kThreads;
  check_indices_kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(ib, mirror);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw Error(std::string("flashattn (CUDA): index check launch failed: ") + cudaGetErrorString(err));
}

common::IndexViolation take_index_violation(void* stream) {
  if (cudaStreamSynchronize(static_cast<cudaStream_t>(stream)) != cudaSuccess) {
    throw Error(std::string("flashattn (CUDA): index check: ") + cudaGetErrorString(cudaGetLastError()));
  }
  const int device = current_device();
  if (reinterpret_cast<volatile int&>(mirror_of(device)->state) == 0) return {};
  return take(device);
}

common::IndexViolation take_pending_index_violation() {
  const int device = current_device();
  const Record* mirror = g_mirror[device].load(std::memory_order_acquire);
  if (mirror == nullptr || reinterpret_cast<const volatile int&>(mirror->state) == 0) return {};
  return take(device);
}

common::IndexViolation take_device_index_violation() {
  const int device = current_device();
  Record* mirror = g_mirror[device].load(std::memory_order_acquire);
  if (mirror == nullptr) return {};  // no check ever ran on this device
  if (cudaDeviceSynchronize() != cudaSuccess) {
    throw Error(std::string("flashattn (CUDA): index check: ") + cudaGetErrorString(cudaGetLastError()));
  }
  if (reinterpret_cast<volatile int&>(mirror->state) == 0) return {};
  return take(device);
}

}  // namespace flashattn::cuda
