// src/cuda/sinks.cu — see sinks.h.
#include "cuda/sinks.h"

#include <string>

#include "flashattn/error.h"

namespace flashattn::cuda {
namespace {

constexpr int kThreads = 256;

// Grid (heads), kThreads threads. Thread t takes rows t, t + kThreads, … of each sequence in
// turn; the per-thread sums then meet in a fixed tree. fp32 throughout: the terms are products of
// a weight in [0, 1] (exp(s_h − lse) ≤ 1, as lse includes the sink) and D.
__global__ void __launch_bounds__(kThreads) sink_gradient_kernel(const __grid_constant__ common::AttentionParams p) {
  if (p.index_check_failed()) return;  // a bad cu_seqlens (src/cuda/index_check.h): touch nothing
  const int head = blockIdx.x;
  const float sink = p.sinks[head];
  float sum = 0.0f;
  for (int b = 0; b < p.batch; ++b) {
    const int seqlen_q = p.seqlen_q(b);
    for (int i = threadIdx.x; i < seqlen_q; i += kThreads) {
      const std::int64_t row = p.lse_index(b, head, i);
      // (a row without keys and without a sink has lse = +∞: weight 0, and D = 0 there anyway)
      sum += __expf(sink - p.lse[row]) * p.softmax_d[row];
    }
  }
  __shared__ float partial[kThreads];
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) partial[threadIdx.x] += partial[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) p.dsinks[head] = -partial[0];
}

}  // namespace

void sink_gradient(const common::AttentionParams& p, cudaStream_t stream) {
  if (p.dsinks == nullptr || p.heads == 0) return;
  sink_gradient_kernel<<<p.heads, kThreads, 0, stream>>>(p);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw Error(std::string("flashattn::backward (CUDA): sink gradient launch failed: ") + cudaGetErrorString(err));
  }
}

}  // namespace flashattn::cuda
