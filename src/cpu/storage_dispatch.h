// src/cpu/storage_dispatch.h — call a generic lambda with a value of the storage element type.
#pragma once

#include "common/numeric.h"
#include "common/params.h"

namespace flashattn::cpu {

// fn(T{}) with T = f16_t, bf16_t or float, chosen by the runtime storage tag.
template <class Fn>
void with_storage(common::Storage storage, Fn&& fn) {
  switch (storage) {
    case common::Storage::f16: fn(common::f16_t{}); break;
    case common::Storage::bf16: fn(common::bf16_t{}); break;
    case common::Storage::f32: fn(float{}); break;
  }
}

}  // namespace flashattn::cpu
