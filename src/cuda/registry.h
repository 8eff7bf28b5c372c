// src/cuda/registry.h — lookups over a family's table of compiled kernels, shared by the
// registries that tools/codegen/generate.py writes for each family (src/cuda/<arch>/<arch>_registry.cu).
#pragma once

#include <string>

#include "common/params.h"

namespace flashattn::cuda::registry {

// The smallest head dim compiled for (kind, storage) in `table` that holds `need`, or 0.
template <class Entry, class Kind>
int compiled_head_dim(const Entry* table, int count, Kind kind, common::Storage storage, int need) {
  int best = 0;
  for (int i = 0; i < count; ++i) {
    const Entry& k = table[i];
    if (k.compiled && k.family == kind && k.storage == storage && k.head_dim >= need &&
        (best == 0 || k.head_dim < best)) {
      best = k.head_dim;
    }
  }
  return best;
}

// The head dims compiled for (kind, storage), e.g. "64, 128, 256", or "none".
template <class Entry, class Kind>
std::string compiled_head_dims(const Entry* table, int count, Kind kind, common::Storage storage) {
  std::string list;
  for (int i = 0; i < count; ++i) {
    const Entry& k = table[i];
    if (k.compiled && k.family == kind && k.storage == storage) {
      list += (list.empty() ? "" : ", ") + std::to_string(k.head_dim);
    }
  }
  return list.empty() ? "none" : list;
}

inline const char* storage_name(common::Storage storage) {
  return storage == common::Storage::f16 ? "fp16" : storage == common::Storage::bf16 ? "bf16" : "fp32";
}

}  // namespace flashattn::cuda::registry
