// src/api/fp8_host.h — FP8 (float8_e4m3) forward calls on the CPU backends, by way of fp32.
#pragma once

#include "flashattn/flashattn.h"

namespace flashattn::detail {

// A validated forward with float8_e4m3 q, k and v on host memory: q, k and v widened to fp32 —
// q multiplied by q_descale · k_descale of its K/V head, since S = scale · (q_descale·q) ·
// (k_descale·k)ᵀ; k and v exactly (a paged K/V: each sequence's keys gathered from its pages) —
// the fp32 forward of the same options into an fp32 out and the caller's lse, then out multiplied
// by v_descale (the output is linear in v) and rounded to the caller's bf16 or f16 out. Host
// memory: four bytes per element of q, out and the keys the call reads.
void forward_fp8_on_host(const ForwardInputs& in, const ForwardOutputs& out, const Options& opt);

// The same for a validated KV-cache call with float8_e4m3 q, caches and new rows (no rotary): each
// sequence's keys after the append (cache rows below cache_seqlens, then the new rows) gathered
// exactly into a contiguous fp32 cache, the fp32 KV-cache call on it, then the new rows' bytes
// written into the caller's caches — no other byte of them read or written.
void forward_kvcache_fp8_on_host(const KVCacheInputs& in, const ForwardOutputs& out, const Options& opt);

}  // namespace flashattn::detail
