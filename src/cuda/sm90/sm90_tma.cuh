// src/cuda/sm90/sm90_tma.cuh — the global tensors the Hopper kernels' TMA descriptors are built
// over, from a call's row/head/batch strides (host code, shared by the forward and the backward).
#pragma once

#include <cute/tensor.hpp>

#include <cstdint>

#include "common/params.h"

namespace flashattn::cuda::sm90 {

// The global tensor (rows, cols, heads, batch) of a q- or k-like argument, as TMA reads it. Rows and
// columns past (rows, cols) read as zeros. The stride of an axis of extent 1 is never used; it is
// replaced by 16 bytes, which a TMA descriptor accepts whatever the caller's view held there.
template <class Element>
auto gmem_rows(const common::RowHeadTensor& t, int rows, int cols, int heads, int batch) {
  using namespace cute;
  constexpr std::int64_t kAnyStride = 16 / sizeof(Element);
  auto stride_of = [&](std::int64_t stride, int extent) { return extent > 1 ? stride : kAnyStride; };
  return make_tensor(make_gmem_ptr(static_cast<const Element*>(t.data)),
                     make_shape(std::int32_t(rows), std::int32_t(cols), std::int32_t(heads), std::int32_t(batch)),
                     make_stride(stride_of(t.row_stride, rows), _1{}, stride_of(t.head_stride, heads),
                                 stride_of(t.batch_stride, batch)));
}

}  // namespace flashattn::cuda::sm90
