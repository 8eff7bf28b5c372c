// src/cuda/family.h — the CUDA backend's kernel families and the ordered choice between them.
//
// A family is a set of kernels written for one GPU generation: sm90 (Hopper: TMA, wgmma, warp
// specialisation; sm_90a only) and sm80 (portable: mma.sync, cp.async; sm80 and newer). For each
// call the backend asks the families in order of preference — sm90, then sm80 — and the first
// that serves it runs it; each family that declines says why, and when none serves, the call is
// refused with all the reasons. FLASHATTN_CUDA_FAMILY=sm80|sm90 (read at each call; unset or
// "auto": the ordered choice) restricts the choice to one family, so that tests and benchmarks
// can run the sm80 kernels on a Hopper GPU, or make sure that the sm90 ones ran.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/params.h"

namespace flashattn::cuda {

enum class Family { sm90, sm80 };

const char* family_name(Family family);

// The family FLASHATTN_CUDA_FAMILY forces, if any. Throws flashattn::Error on a value other than
// "", "auto", "sm80" or "sm90".
bool forced_family(Family* family);

struct FamilyChoice {
  bool served = false;
  Family family = Family::sm80;  // when served
  int head_dim = 0;              // the instantiated head dim that runs the call
  std::string why_not;           // when not served: each family's reason
};

// The family that runs the forward of p on the current device (validated params).
FamilyChoice choose_forward_family(const common::AttentionParams& p);

// Why family `family` does not serve the forward of p on the current device ("" when it does);
// *head_dim receives the instantiated head dim that would run it. preferring: in the ordered
// choice a family also declines calls it computes but another family runs better (the sm90
// family leaves split-KV decoding to sm80); a forced choice asks only whether it can.
std::string forward_refusal(Family family, const common::AttentionParams& p, int* head_dim, bool preferring);

// The splits of the key tiles the chosen family's forward of p uses when a workspace holds their
// partials (1: none; the sm90 family splits only where built with FLASHATTN_SM90_FWD_SPLIT).
int family_num_splits(const FamilyChoice& choice, const common::AttentionParams& p);

// The forward of p in the chosen family and head dim (cuda::forward's contract for the rest).
void family_forward(const FamilyChoice& choice, const common::AttentionParams& p, const std::uint64_t* rng_state,
                    void* workspace, std::size_t workspace_bytes, cudaStream_t stream);

// The family that runs the backward of p (the same ordered choice; head_dim is set for sm90), its
// workspace and the call.
FamilyChoice choose_backward_family(const common::AttentionParams& p);
std::size_t family_backward_workspace_size(const FamilyChoice& choice, const common::AttentionParams& p,
                                           std::int64_t total_q_rows);
// cuda::backward_workspace_bound: over the families the choice may take (a forced one only).
std::size_t family_backward_workspace_bound(const common::AttentionParams& p, std::int64_t total_q_rows);
void family_backward(const FamilyChoice& choice, const common::AttentionParams& p, std::int64_t total_q_rows,
                     void* workspace, cudaStream_t stream, const std::uint64_t* rng_state);

// The kernels compiled into this build, family by family.
std::string compiled_kernels_of_families();

}  // namespace flashattn::cuda
