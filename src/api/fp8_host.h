// src/api/fp8_host.h — FP8 (float8_e4m3) forward calls on the CPU backends, by way of fp32.
#pragma once

#include "flashattn/flashattn.h"

namespace flashattn::detail {

// A validated forward with float8_e4m3 q, k and v on host memory: q, k and v widened to fp32 —
// q multiplied by q_descale · k_descale of its K/V head, since S = scale · (q_descale·q) ·
// (k_descale·k)ᵀ; k and v exactly — the fp32 forward of the same options into an fp32 out and the
// caller's lse, then out multiplied by v_descale (the output is linear in v) and rounded to the
// caller's bf16 or f16 out. Paged K/V are widened page by page as they are, so pages that
// sequences with different descales share stay one copy. Host memory: four bytes per element of
// q, k, v and out for the call.
void forward_fp8_on_host(const ForwardInputs& in, const ForwardOutputs& out, const Options& opt);

// The same for a validated KV-cache call with float8_e4m3 q, caches and new rows (no rotary): the
// caches and new rows are widened exactly, the fp32 KV-cache call appends and attends, and — when
// rows were appended — the widened caches are narrowed back into the caller's, every element
// (e4m3 → fp32 → e4m3 gives back the same bits, the new rows included). Host memory: four bytes
// per element of the caches besides.
void forward_kvcache_fp8_on_host(const KVCacheInputs& in, const ForwardOutputs& out, const Options& opt);

}  // namespace flashattn::detail
