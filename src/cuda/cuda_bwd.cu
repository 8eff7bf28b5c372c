// src/cuda/cuda_bwd.cu — which CUDA backward kernel serves a call, its workspace, and the call.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "cuda/cuda_backend.h"
#include "cuda/cuda_common.h"
#include "cuda/sm80/sm80_bwd.h"
#include "cuda/sm80/sm80_registry.h"
#include "flashattn/error.h"

namespace flashattn::cuda {
namespace {

int bwd_head_dim(const common::AttentionParams& p) { return detail::head_dim_for(sm80::Family::bwd, p); }

// The workspace layout: the fp32 dQ accumulator (rows rounded per sequence to kBwdTileRowsHost, see
// sm80_bwd_kernel.cuh; the instantiated head dim wide), then (deterministic) the counters.
struct Layout {
  int m_blocks = 0;
  std::size_t dq_accum_bytes = 0;
  std::size_t counter_bytes = 0;
};

Layout layout_of(const common::AttentionParams& p, std::int64_t total_q_rows) {
  constexpr std::size_t kTile = sm80::kBwdTileRowsHost;
  Layout l;
  l.m_blocks = (p.max_seqlen_q + sm80::kBwdRowBlock - 1) / sm80::kBwdRowBlock;
  // Bounds both layouts (dense: b · ⌈sq⌉ ≤ total + b · kTile rows), so the size needs no cu_seqlens.
  const std::size_t rows = std::size_t(total_q_rows) + (std::size_t(p.batch) + 1) * kTile;
  l.dq_accum_bytes =
      detail::workspace_align_up(rows * std::size_t(p.heads) * std::size_t(bwd_head_dim(p)) * sizeof(float));
  if (p.deterministic) {
    l.counter_bytes =
        detail::workspace_align_up(std::size_t(p.batch) * std::size_t(p.heads) * std::size_t(l.m_blocks) * sizeof(int));
  }
  return l;
}

}  // namespace

bool can_serve_backward(const common::AttentionParams& p, std::string* why_not) {
  if (!detail::can_serve_common(p, sm80::Family::bwd,
                                {{"q", &p.q},
                                 {"k", &p.k},
                                 {"v", &p.v},
                                 {"out", &p.out},
                                 {"dout", &p.dout},
                                 {"dq", &p.dq},
                                 {"dk", &p.dk},
                                 {"dv", &p.dv}},
                                why_not)) {
    return false;
  }
  // The smallest configuration (sm80_bwd.h) must fit a block's shared memory on this device.
  const int head_dim = bwd_head_dim(p);
  return detail::smem_fits("backward", head_dim, sm80::bwd_min_smem_bytes(head_dim), why_not);
}

std::size_t backward_workspace_size(const common::AttentionParams& p, std::int64_t total_q_rows) {
  const Layout l = layout_of(p, total_q_rows);
  return l.dq_accum_bytes + l.counter_bytes;
}

void backward(const common::AttentionParams& p, std::int64_t total_q_rows, void* workspace, void* stream,
              const std::uint64_t* rng_state) {
  std::string why;
  if (!can_serve_backward(p, &why)) throw Error("flashattn::backward (CUDA): " + why);
  // SPEC §5 special cases: nothing to compute (dk/dv of no rows are zeros only when there are keys).
  if (p.batch == 0 || (p.max_seqlen_q == 0 && p.max_seqlen_k == 0)) return;
  const Layout l = layout_of(p, total_q_rows);
  sm80::BwdScratch ws;
  ws.dq_accum = static_cast<float*>(workspace);
  ws.dq_accum_bytes = l.dq_accum_bytes;
  ws.m_blocks = l.m_blocks;
  if (p.deterministic) {
    ws.counters = reinterpret_cast<int*>(static_cast<char*>(workspace) + l.dq_accum_bytes);
    ws.counter_bytes = l.counter_bytes;
  }
  const int head_dim = bwd_head_dim(p);
  auto* s = static_cast<cudaStream_t>(stream);
  const cudaError_t err = sm80::dispatch_bwd(p.storage, head_dim, p, ws, rng_state, s);
  if (err != cudaSuccess) {
    throw Error(std::string("flashattn::backward (CUDA): kernel launch failed: ") + cudaGetErrorString(err));
  }
}

}  // namespace flashattn::cuda
