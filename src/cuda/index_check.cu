// src/cuda/index_check.cu — the device-side index check (see index_check.h).
#include "cuda/index_check.h"

#include "cuda/index_check.cuh"

#include <cuda_runtime.h>

#include <atomic>
#include <climits>
#include <cstdlib>
#include <mutex>
#include <string>

#include "flashattn/error.h"

namespace flashattn::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kMaxDevices = 64;

using Record = IndexRecord;

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

// A kernel launched as the check's programmatic dependent (the sm80 forward of a paged call on
// sm_90, unless a build sets FLASHATTN_SM80_FWD_PAGED_CHECK_OVERLAP=0) may start now, beside it:
// it waits for the check to finish before it stores anything. (No effect on kernels launched the
// usual way after it.)
__device__ __forceinline__ void let_dependents_start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#if !defined(FLASHATTN_SM80_FWD_PAGED_CHECK_OVERLAP) || FLASHATTN_SM80_FWD_PAGED_CHECK_OVERLAP
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
#endif
}

// Without a block table: one thread per sequence.
__global__ void __launch_bounds__(kThreads) check_indices_kernel(const common::IndexBounds ib, Record* mirror) {
  let_dependents_start();
  const int b = blockIdx.x * kThreads + threadIdx.x;
  if (b >= ib.batch) return;
  const common::IndexViolation v = common::check_sequence_indices(ib, b);
  if (v) record_index_violation(&g_record, mirror, v, int(ib.api));
}

// With a block table: a block per sequence. Thread 0 checks its other rules, then every thread
// the block_table entries of its pages, kPagedUnroll loads in flight at a time (one thread walking
// a sequence's 256 pages of 16 rows entry by entry took 36 µs of a 196 µs decoding step), and the
// first bad entry is recorded, as the host's check would name it.
constexpr int kPagedThreads = 256;
constexpr int kPagedUnroll = 8;

__global__ void __launch_bounds__(kPagedThreads) check_paged_indices_kernel(const common::IndexBounds ib, Record* mirror) {
  __shared__ long long pages;
  __shared__ int first_bad;
  let_dependents_start();
  const int b = blockIdx.x;
  if (threadIdx.x == 0) {
    long long len = 0;
    const common::IndexViolation v = common::check_sequence_scalars(ib, b, &len);
    if (v) record_index_violation(&g_record, mirror, v, int(ib.api));
    pages = v ? 0 : common::block_table_pages(ib, len);
    first_bad = INT_MAX;
  }
  __syncthreads();
  const std::int32_t* row = ib.block_table + b * ib.block_table_batch_stride;
  for (long long base = threadIdx.x; base < pages; base += kPagedThreads * kPagedUnroll) {
    std::int32_t page[kPagedUnroll];
#pragma unroll
    for (int u = 0; u < kPagedUnroll; ++u) {
      const long long blk = base + u * kPagedThreads;
      page[u] = blk < pages ? __ldg(row + blk) : 0;
    }
#pragma unroll
    for (int u = 0; u < kPagedUnroll; ++u) {
      const long long blk = base + u * kPagedThreads;
      if (blk < pages && (page[u] < 0 || page[u] >= ib.cache_rows)) atomicMin(&first_bad, int(blk));
    }
  }
  __syncthreads();
  if (threadIdx.x == 0 && first_bad != INT_MAX) {
    record_index_violation(&g_record, mirror, common::check_block_table_entry(ib, b, first_bad), int(ib.api));
  }
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

// The current device's record in device memory.
Record* device_record() {
  static std::atomic<Record*> records[kMaxDevices];  // static storage: null = not asked yet
  const int device = current_device();
  Record* known = records[device].load(std::memory_order_relaxed);
  if (known != nullptr) return known;
  void* address = nullptr;
  if (cudaGetSymbolAddress(&address, g_record) != cudaSuccess) {
    throw Error(std::string("flashattn (CUDA): index check: ") + cudaGetErrorString(cudaGetLastError()));
  }
  records[device].store(static_cast<Record*>(address), std::memory_order_relaxed);
  return static_cast<Record*>(address);
}

}  // namespace

const int* index_error_flag() { return &device_record()->state; }

namespace {
bool folding_allowed() {
  const char* env = std::getenv("FLASHATTN_INDEX_CHECK_FOLD");
  return env == nullptr || std::string(env) != "0";
}
}  // namespace

bool index_check_foldable(const common::IndexBounds& ib) {
  return ib.block_table == nullptr && ib.batch <= kIndexFoldMaxBatch && folding_allowed();
}

bool index_check_foldable_paged(const common::IndexBounds& ib) {
  return ib.block_table != nullptr && folding_allowed();
}

IndexFold fold_index_check(const common::IndexBounds& ib) {
  IndexFold f;
  f.bounds = ib;
  f.record = device_record();
  f.mirror = mirror_of(current_device());
  return f;
}

void check_indices(const common::IndexBounds& ib, void* stream) {
  if (!ib.any() || ib.batch <= 0) return;
  Record* mirror = mirror_of(current_device());
  if (ib.block_table != nullptr) {
    check_paged_indices_kernel<<<ib.batch, kPagedThreads, 0, static_cast<cudaStream_t>(stream)>>>(ib, mirror);
  } else {
    const int blocks = (ib.batch + kThreads - 1) / kThreads;
    check_indices_kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(ib, mirror);
  }
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
