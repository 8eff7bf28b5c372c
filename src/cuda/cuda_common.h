// src/cuda/cuda_common.h — what every CUDA kernel family checks before it accepts a call (dtype,
// 16-byte alignment of the tensors it reads and writes with vector accesses or TMA, the grid
// limits) and the workspace alignment they share. Host code only.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "common/params.h"

namespace flashattn::cuda::detail {

// Global accesses move 16 bytes: 8 fp16 / bf16 elements.
inline constexpr int kVectorBytes = 16;
inline constexpr int kVectorElems = 8;
inline constexpr int kMaxGridYZ = 65535;  // CUDA's limit on gridDim.y and gridDim.z
// Every region of a caller's workspace starts on this boundary (the API layer checks the base).
inline constexpr std::size_t kWorkspaceAlign = 256;

inline std::size_t workspace_align_up(std::size_t bytes) {
  return (bytes + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
}

inline bool aligned(const common::RowHeadTensor& t) {
  return reinterpret_cast<std::uintptr_t>(t.data) % kVectorBytes == 0 && t.batch_stride % kVectorElems == 0 &&
         t.row_stride % kVectorElems == 0 && t.head_stride % kVectorElems == 0;
}

// The checks every family makes: dtype, 16-byte alignment of `tensors` (those the kernels access
// with 16-byte vectors or TMA), the grid limits.
inline bool can_serve_layout(const common::AttentionParams& p,
                             std::initializer_list<std::pair<const char*, const common::RowHeadTensor*>> tensors,
                             std::string* why_not) {
  auto no = [&](const std::string& why) {
    if (why_not) *why_not = why;
    return false;
  };
  if (p.storage != common::Storage::f16 && p.storage != common::Storage::bf16) {
    return no("the CUDA kernels take fp16 or bf16 only");
  }
  for (const auto& [name, t] : tensors) {
    if (!aligned(*t)) {
      return no(std::string(name) +
                ": the CUDA kernels need a 16-byte aligned data pointer and batch/row/head strides that are "
                "multiples of 8 elements");
    }
  }
  if (p.heads > kMaxGridYZ || p.batch > kMaxGridYZ) return no("more than 65535 heads or batch entries");
  return true;
}

}  // namespace flashattn::cuda::detail
