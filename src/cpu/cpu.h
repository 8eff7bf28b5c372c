// src/cpu/cpu.h — the CPU backends behind the API layer. Each function reads and writes tensors
// only through common::AttentionParams (src/common/params.h), so dense, varlen and paged batches
// share one code path. Validation has already happened: these functions trust their input.
#pragma once

#include "common/params.h"

namespace flashattn::cpu {

// How the reference computes.
enum class RefPrecision {
  fp64,               // the oracle: fp64 everywhere, from the stored low-precision inputs
  emulate_storage,    // "naive_lowprec" of SPEC §7: fp32 math, every materialised intermediate
                      // (scores, probabilities, products, gradients) rounded to the input dtype
};

// Where the reference puts its results when the caller wants them unrounded (tests): fp64 arrays
// indexed by the SAME element offsets as the corresponding output tensors of the params
// (q_offset(p.out, ...), lse_index(...), k_offset(p.dk, ...)), so size each like that tensor's
// storage. When a sink is given, the reference writes there instead of into the params' outputs.
struct Fp64Outputs {
  double* out = nullptr;
  double* lse = nullptr;
  double* dq = nullptr;
  double* dk = nullptr;
  double* dv = nullptr;
  double* softmax_d = nullptr;
};

// Naive attention: materialises each (sq × sk) score matrix of one (batch, head).
// Forward writes out and lse (lse may be null).
void reference_forward(const common::AttentionParams& p, RefPrecision precision = RefPrecision::fp64,
                       const Fp64Outputs* sink = nullptr);
// Backward writes dq, dk, dv and softmax_d. It recomputes the forward itself (it does not read
// p.out or p.lse), so it is the exact gradient of the function SPEC §2 defines.
void reference_backward(const common::AttentionParams& p,
                        RefPrecision precision = RefPrecision::fp64,
                        const Fp64Outputs* sink = nullptr);

// The tiled CPU flash backend: online softmax forward, recomputing backward, threads over
// (batch, head, row blocks), memory O(tiles), deterministic for any num_threads (≥ 1).
void flash_forward(const common::AttentionParams& p, int num_threads);
void flash_backward(const common::AttentionParams& p, int num_threads);

}  // namespace flashattn::cpu
