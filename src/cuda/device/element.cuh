// src/cuda/device/element.cuh — the CUTLASS element type of each 16-bit storage type, for the
// launchers of every kernel family.
#pragma once

#include <cutlass/numeric_types.h>

#include "common/params.h"

namespace flashattn::cuda::device {

template <common::Storage kStorage>
struct ElementOf;
template <>
struct ElementOf<common::Storage::f16> {
  using type = cutlass::half_t;
};
template <>
struct ElementOf<common::Storage::bf16> {
  using type = cutlass::bfloat16_t;
};

}  // namespace flashattn::cuda::device
