// src/cuda/cuda_common.h — what every CUDA kernel family checks before it accepts a call: dtype,
// an instantiated head dim, 16-byte alignment of the tensors it reads and writes with vector
// accesses, and the grid limits. Host code only.
#pragma once

#include <algorithm>
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

inline bool aligned(const common::RowHeadTensor& t) {
  return reinterpret_cast<std::uintptr_t>(t.data) % kVectorBytes == 0 && t.batch_stride % kVectorElems == 0 &&
         t.row_stride % kVectorElems == 0 && t.head_stride % kVectorElems == 0;
}

// The smallest instantiated head dim that holds max(d, dv), or 0.
template <std::size_t N>
int instantiated_head_dim(const common::AttentionParams& p, const int (&dims)[N]) {
  const int need = std::max(p.head_dim, p.head_dim_v);
  for (int d : dims) {
    if (need <= d) return d;
  }
  return 0;
}

// The checks shared by all families; `family` names the kernels in messages ("sm80 backward").
// heads_in_grid: the head count that becomes a grid dimension.
template <std::size_t N>
bool can_serve_common(const common::AttentionParams& p, const int (&dims)[N], const char* family,
                      std::initializer_list<std::pair<const char*, const common::RowHeadTensor*>> tensors,
                      std::string* why_not) {
  auto no = [&](const std::string& why) {
    if (why_not) *why_not = why;
    return false;
  };
  if (p.storage != common::Storage::f16 && p.storage != common::Storage::bf16) {
    return no("the CUDA kernels take fp16 or bf16 only");
  }
  if (instantiated_head_dim(p, dims) == 0) {
    std::string compiled;
    for (int d : dims) compiled += (compiled.empty() ? "" : ", ") + std::to_string(d);
    return no(std::string("no ") + family + " kernel for head dim " +
              std::to_string(std::max(p.head_dim, p.head_dim_v)) + " (compiled: " + compiled + ")");
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
