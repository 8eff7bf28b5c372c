// src/cuda/device/cp_async.cuh — small asynchronous copies global → shared (cp.async, sm80 and
// newer) shared by the kernel families: the 4-byte form that brings index entries (block_table
// pages, row statistics) into shared memory without a register waiting for each load.
#pragma once

#include <cute/arch/util.hpp>

namespace flashattn::cuda::device {

// 4-byte cp.async global → shared (.ca: the L2-only .cg form copies 16 bytes only). Completes with
// the issuing thread's cp.async groups (cute::cp_async_fence / cute::cp_async_wait).
__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem) {
  const std::uint32_t dst = cute::cast_smem_ptr_to_uint(smem);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(gmem));
}

}  // namespace flashattn::cuda::device
