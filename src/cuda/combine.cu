// src/cuda/combine.cu — the combine kernel: merges fp32 partial (out, lse) pairs over disjoint
// key sets into out (f16 / bf16 / f32) and lse, row by row, with the operations of
// src/cpu/combine.cpp in the same order.
#include "cuda/combine.h"

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "common/numeric.h"
#include "common/sink.h"
#include "cuda/dependent_launch.h"
#include "cuda/device_query.h"
#include "flashattn/error.h"

namespace flashattn::cuda {
namespace {

constexpr int kWarpSize = 32;
constexpr int kCombineWarps = 4;  // one warp per output row (batch, row, head); 4 rows per CTA
constexpr int kColsPerLane = 8;   // lane l holds columns l, l + 32, …: 256 columns per pass
// Partial rows loaded before the first of them is accumulated: with few rows per launch (decoding)
// each warp must keep many loads in flight to hide the memory latency.
constexpr int kSplitsInFlight = 8;
// The kVec layout (FLASHATTN_COMBINE_VEC; by default after the split kernel): 4 adjacent columns
// per lane (one 16-byte load), 128 per pass, and twice the splits in flight (sm_90a: 210 registers
// against 128, no spills).
constexpr int kVecColsPerLane = 4;
constexpr int kVecSplitsInFlight = 16;
constexpr float kInf = __builtin_huge_valf();
constexpr int kQuietNaNBits = 0x7fc00000;

template <common::Storage kStorage>
struct StorageType;
template <>
struct StorageType<common::Storage::f16> {
  using type = common::f16_t;
};
template <>
struct StorageType<common::Storage::bf16> {
  using type = common::bf16_t;
};
template <>
struct StorageType<common::Storage::f32> {
  using type = float;
};

// Grid: ⌈b · max_seqlen_q · h / kCombineWarps⌉ CTAs of kCombineWarps warps.
// kVec (FLASHATTN_COMBINE_VEC where the partials allow it: combine() below): lane l holds the 4
// adjacent columns 4l … 4l + 3 of a 128-column pass (one 16-byte load per split) and keeps
// kVecSplitsInFlight splits' rows in flight, the first of them issued beside the splits' lse — one
// trip to memory less per row and fewer batches of loads after it. The sums are the same, in the
// same order.
template <common::Storage kOutStorage, bool kVec>
__global__ void __launch_bounds__(kCombineWarps * kWarpSize) combine_kernel(const __grid_constant__ CombineParams c) {
  using OutElement = typename StorageType<kOutStorage>::type;
  constexpr int kLaneCols = kVec ? kVecColsPerLane : kColsPerLane;
  constexpr int kPassCols = kLaneCols * kWarpSize;
  constexpr int kInFlight = kVec ? kVecSplitsInFlight : kSplitsInFlight;
  // Column k of lane l in a pass: adjacent (kVec) or strided by the warp.
  auto lane_col = [](int lane, int k) { return kVec ? lane * kLaneCols + k : lane + k * kWarpSize; };
  const int lane = threadIdx.x % kWarpSize;
  // Heads fastest: the warps of a CTA write neighbouring heads of one output row.
  const std::int64_t task = std::int64_t(blockIdx.x) * kCombineWarps + threadIdx.x / kWarpSize;
  const int head = int(task % c.heads);
  const std::int64_t batch_row = task / c.heads;
  const int row = int(batch_row % c.max_seqlen_q);
  const int batch = int(batch_row / c.max_seqlen_q);
  if (batch >= c.batch) return;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Launched as the split kernel's programmatic dependent (CombineParams::after_primary): nothing
  // that kernel writes is read before it has finished. (Returns at once after a usual launch.)
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
  // The index check's flag (a violation found by the split kernel or before it: nothing is
  // written then), loaded beside the splits' lse rather than before them; the reads below stay
  // inside the partials whatever cu_seqlens_q holds.
  const int index_failed = c.index_error != nullptr ? *c.index_error : 0;
  const bool varlen = c.cu_seqlens_q != nullptr;
  if (varlen && row >= c.cu_seqlens_q[batch + 1] - c.cu_seqlens_q[batch]) return;

  const float* lse_splits = c.lse_partial + std::int64_t(batch) * c.lse_partial_batch_stride +
                            std::int64_t(head) * c.lse_partial_head_stride + row;
  auto lse_of = [&](int s) { return lse_splits[std::int64_t(s) * c.lse_partial_split_stride]; };
  const float* out_splits = c.out_partial + std::int64_t(batch) * c.out_partial_batch_stride +
                            std::int64_t(row) * c.out_partial_row_stride +
                            std::int64_t(head) * c.out_partial_head_stride;
  // Lane l's columns of split s's partial row in the pass from col0 (0 past the row or the splits).
  auto load_part = [&](int s, int col0, float (&part)[kLaneCols]) {
    const float* o = out_splits + std::int64_t(s) * c.out_partial_split_stride + col0;
    if constexpr (kVec) {
      // head_dim_v is a multiple of 4 here: a lane's 4 columns are all in the row or none is.
      const bool in = s < c.splits && col0 + lane_col(lane, 0) < c.head_dim_v;
      const float4 x = in ? *reinterpret_cast<const float4*>(o + lane_col(lane, 0)) : make_float4(0.f, 0.f, 0.f, 0.f);
      part[0] = x.x, part[1] = x.y, part[2] = x.z, part[3] = x.w;
    } else {
#pragma unroll
      for (int k = 0; k < kLaneCols; ++k) {
        const bool in = s < c.splits && col0 + lane_col(lane, k) < c.head_dim_v;
        part[k] = in ? o[lane_col(lane, k)] : 0.0f;
      }
    }
  };
  // kVec: the first pass's first splits, loaded now, beside the lse below (a split that turns out
  // not to contribute is loaded for nothing; its row is inside the partials all the same).
  float first[kVec ? kInFlight : 1][kLaneCols];
  if constexpr (kVec) {
#pragma unroll
    for (int j = 0; j < kInFlight; ++j) load_part(j, 0, first[j]);
  }

  // Every lane computes the row's lse (the loads are broadcasts). The arithmetic is the host's,
  // step for step, with explicit rounding so that nothing is contracted into an FMA: a row with
  // one contributing split is reproduced bit for bit (lse_s + log 1, weight exp 0 = 1); with
  // more, expf / logf may differ from the host library's by an ulp.
  float max_lse = -kInf;
  bool nan_split = false;
  for (int s = 0; s < c.splits; ++s) {
    const float l = lse_of(s);
    nan_split = nan_split || isnan(l);
    if (isfinite(l)) max_lse = fmaxf(max_lse, l);
  }
  // The head's attention sink (common/sink.h; −∞: none), added here once, never in a split.
  const float sink = c.sinks != nullptr ? c.sinks[head] : -kInf;
  // No split saw a key: out = 0, lse = the sink, +∞ without one, as for a fully masked row (SPEC
  // §2.5). A split whose lse is NaN (a NaN score among its keys) makes the row's out and lse NaN,
  // as in the unsplit attention; no split is summed then.
  const bool empty = max_lse == -kInf || nan_split;
  float lse = nan_split ? __int_as_float(kQuietNaNBits) : common::empty_row_lse(sink);
  if (!empty) {
    // The sink is one more term of the sum, measured like the splits from the largest of them
    // (a NaN sink takes the max and makes the row NaN; −∞ adds 0).
    if (sink > max_lse || isnan(sink)) max_lse = sink;
    float sum = c.sinks != nullptr ? expf(__fsub_rn(sink, max_lse)) : 0.0f;
    for (int s = 0; s < c.splits; ++s) {
      const float l = lse_of(s);
      if (isfinite(l)) sum = __fadd_rn(sum, expf(__fsub_rn(l, max_lse)));
    }
    lse = __fadd_rn(max_lse, logf(sum));
  }

  if (index_failed != 0) return;
  const std::int64_t out_row0 = varlen ? c.cu_seqlens_q[batch] : 0;
  OutElement* out_row = static_cast<OutElement*>(c.out.data) +
                        (varlen ? 0 : std::int64_t(batch) * c.out.batch_stride) +
                        (out_row0 + row) * c.out.row_stride + std::int64_t(head) * c.out.head_stride;
  for (int col0 = 0; col0 < c.head_dim_v; col0 += kPassCols) {
    float acc[kLaneCols];
#pragma unroll
    for (int k = 0; k < kLaneCols; ++k) acc[k] = nan_split ? lse : 0.0f;
    for (int s0 = 0; !empty && s0 < c.splits; s0 += kInFlight) {
      // Weights and partial rows of kInFlight splits first, then the sums in split order.
      bool contributes[kInFlight];
      float weight[kInFlight];
      float part[kInFlight][kLaneCols];
#pragma unroll
      for (int j = 0; j < kInFlight; ++j) {
        const int s = s0 + j;
        const float l = s < c.splits ? lse_of(s) : -kInf;
        // A split without a finite lse is skipped, whatever its out_partial holds.
        contributes[j] = isfinite(l);
        weight[j] = contributes[j] ? expf(__fsub_rn(l, lse)) : 0.0f;
        bool prefetched = false;
        if constexpr (kVec) {
          if (col0 == 0 && s0 == 0) {
#pragma unroll
            for (int k = 0; k < kLaneCols; ++k) part[j][k] = first[j][k];
            prefetched = true;
          }
        }
        if (!prefetched) load_part(contributes[j] ? s : c.splits, col0, part[j]);
      }
#pragma unroll
      for (int j = 0; j < kInFlight; ++j) {
        if (!contributes[j]) continue;
#pragma unroll
        for (int k = 0; k < kLaneCols; ++k) acc[k] = __fadd_rn(acc[k], __fmul_rn(weight[j], part[j][k]));
      }
    }
#pragma unroll
    for (int k = 0; k < kLaneCols; ++k) {
      const int col = col0 + lane_col(lane, k);
      if (col < c.head_dim_v) out_row[col] = common::from_float<OutElement>(acc[k]);
    }
  }
  if (c.lse != nullptr && lane == 0) {
    c.lse[(varlen ? 0 : std::int64_t(batch) * c.lse_batch_stride) + std::int64_t(head) * c.lse_head_stride +
          out_row0 + row] = lse;
  }
}

// A combine runtime knob (read per call, so that a benchmark can alternate them): "1" on, "0" off,
// unset or anything else `fallback`.
bool knob(const char* name, bool fallback) {
  const char* env = std::getenv(name);
  if (env == nullptr || (env[0] != '0' && env[0] != '1') || env[1] != '\0') return fallback;
  return env[0] == '1';
}

}  // namespace

void combine(const CombineParams& c, void* stream) {
  const std::int64_t rows = std::int64_t(c.batch) * c.max_seqlen_q * c.heads;
  if (rows == 0 || c.head_dim_v == 0) return;
  const std::int64_t blocks = (rows + kCombineWarps - 1) / kCombineWarps;
  if (blocks > INT_MAX) throw Error("flashattn::combine (CUDA): more than 2^31 · 4 rows (b · sq · h)");
  auto* s = static_cast<cudaStream_t>(stream);
  const dim3 grid(static_cast<unsigned>(blocks));
  const dim3 block(kCombineWarps * kWarpSize);
  // Launched as the split kernel's programmatic dependent (FLASHATTN_COMBINE_PDL, on by default on
  // sm_90 and newer), and then in the kVec layout (FLASHATTN_COMBINE_VEC, by default where launched
  // so) where the partials allow its 16-byte loads: on an H100 the two together took 0.6–1.9 µs off
  // every split decoding step timed, the kVec layout alone added 1.5–2.5 µs (src/cuda/README.md).
  const bool pdl = c.after_primary && knob("FLASHATTN_COMBINE_PDL", true) && current_compute_capability() >= 90;
  auto vec_multiple = [](std::int64_t n) { return n % kVecColsPerLane == 0; };
  const bool vec = knob("FLASHATTN_COMBINE_VEC", pdl) && vec_multiple(c.head_dim_v) &&
                   reinterpret_cast<std::uintptr_t>(c.out_partial) % 16 == 0 &&
                   vec_multiple(c.out_partial_split_stride) && vec_multiple(c.out_partial_batch_stride) &&
                   vec_multiple(c.out_partial_row_stride) && vec_multiple(c.out_partial_head_stride);
  using common::Storage;
  void (*kernel)(CombineParams) = nullptr;
  switch (c.out_storage) {
    case Storage::f16: kernel = vec ? combine_kernel<Storage::f16, true> : combine_kernel<Storage::f16, false>; break;
    case Storage::bf16:
      kernel = vec ? combine_kernel<Storage::bf16, true> : combine_kernel<Storage::bf16, false>;
      break;
    case Storage::f32: kernel = vec ? combine_kernel<Storage::f32, true> : combine_kernel<Storage::f32, false>; break;
  }
  cudaError_t err = cudaSuccess;
  if (pdl) {
    err = launch_as_dependent(kernel, grid, block, 0, s, c);
  } else {
    kernel<<<grid, block, 0, s>>>(c);
    err = cudaGetLastError();
  }
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // not left for the next launch to report
    throw Error(std::string("flashattn::combine (CUDA): kernel launch failed: ") + cudaGetErrorString(err));
  }
}

}  // namespace flashattn::cuda
