// src/api/validate.h — SPEC §5: every check of a call, done before anything is written, and the
// translation of a valid call into common::AttentionParams for the backends.
#pragma once

#include <string>

#include "common/index_check.h"
#include "common/params.h"
#include "flashattn/flashattn.h"

namespace flashattn::detail {

// A validated call: the backend-neutral parameter block plus what dispatch needs to know.
struct Problem {
  common::AttentionParams params;
  DType dtype = DType::f16;
  Device device = {};
  bool is_backward = false;
  bool is_kvcache = false;
  // Varlen: the packed row counts of q and k (rows past cu_seqlens[b] belong to no sequence).
  std::int64_t total_q = 0, total_k = 0;
  // The call's index tensors and the extents their values must respect (common/index_check.h).
  // On the host validation has checked the values; on a GPU the backend checks them on the device.
  common::IndexBounds index_bounds;
};

// The message of a broken index rule ("<api>: <argument>: <rule>; expected <x>, got <y>"), for the
// host validation and for a violation the CUDA index check found on the device.
std::string index_violation_message(const char* api, const common::IndexViolation& v);

// Each throws flashattn::Error naming the argument, the rule, the expected and the actual value.
// `api` prefixes messages ("flashattn::forward").
Problem validate_forward(const ForwardInputs& in, const ForwardOutputs& out, const Options& opt,
                         const char* api = "flashattn::forward");
Problem validate_backward(const BackwardInputs& in, const BackwardOutputs& out, const Options& opt,
                          const char* api = "flashattn::backward");
// For the KV cache the params describe the attention AFTER k_new/v_new are appended: the caller
// must point params.cache_seqlens at the updated lengths (see src/api/kvcache.cpp).
Problem validate_kvcache(const KVCacheInputs& in, const ForwardOutputs& out, const Options& opt,
                         const char* api = "flashattn::forward_kvcache");
void validate_combine(const CombineInputs& in, const ForwardOutputs& out,
                      const char* api = "flashattn::combine");

}  // namespace flashattn::detail
