// src/cuda/cuda_backend.cu — which CUDA kernel serves a call, and the call itself.
#include "cuda/cuda_backend.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "cuda/sm80/sm80_fwd.h"
#include "flashattn/error.h"

namespace flashattn::cuda {
namespace {

// Global ↔ shared copies move 16 bytes per thread: 8 elements of fp16 / bf16.
constexpr int kVectorBytes = 16;
constexpr int kVectorElems = 8;
constexpr int kMaxGridYZ = 65535;  // CUDA's limit on gridDim.y and gridDim.z (heads, batch)

bool aligned(const common::RowHeadTensor& t) {
  return reinterpret_cast<std::uintptr_t>(t.data) % kVectorBytes == 0 && t.batch_stride % kVectorElems == 0 &&
         t.row_stride % kVectorElems == 0 && t.head_stride % kVectorElems == 0;
}

int fwd_head_dim(const common::AttentionParams& p) {
  const int need = std::max(p.head_dim, p.head_dim_v);
  for (int d : sm80::kFwdHeadDims) {
    if (need <= d) return d;
  }
  return 0;
}

template <common::Storage kStorage>
cudaError_t run_sm80(const common::AttentionParams& p, int head_dim, const std::uint64_t* rng_state,
                     cudaStream_t stream) {
  switch (head_dim) {
    case 64: return sm80::run_fwd<kStorage, 64>(p, rng_state, stream);
    case 128: return sm80::run_fwd<kStorage, 128>(p, rng_state, stream);
    default: return sm80::run_fwd<kStorage, 256>(p, rng_state, stream);
  }
}

}  // namespace

bool can_serve_forward(const common::AttentionParams& p, std::string* why_not) {
  auto no = [&](const std::string& why) {
    if (why_not) *why_not = why;
    return false;
  };
  if (p.storage != common::Storage::f16 && p.storage != common::Storage::bf16) {
    return no("the CUDA kernels take fp16 or bf16 only");
  }
  if (fwd_head_dim(p) == 0) {
    return no("no sm80 forward kernel for head dim " + std::to_string(std::max(p.head_dim, p.head_dim_v)) +
              " (compiled: 64, 128, 256)");
  }
  const struct {
    const char* name;
    const common::RowHeadTensor* t;
  } tensors[] = {{"q", &p.q}, {"k", &p.k}, {"v", &p.v}, {"out", &p.out}};
  for (const auto& [name, t] : tensors) {
    if (!aligned(*t)) {
      return no(std::string(name) +
                ": the CUDA kernels need a 16-byte aligned data pointer and batch/row/head strides that are "
                "multiples of 8 elements");
    }
  }
  if (p.heads > kMaxGridYZ || p.batch > kMaxGridYZ) return no("more than 65535 heads or batch entries");
  return true;
}

void forward(const common::AttentionParams& p, void* stream, const std::uint64_t* rng_state) {
  std::string why;
  if (!can_serve_forward(p, &why)) throw Error("flashattn::forward (CUDA): " + why);
  if (p.batch == 0 || p.max_seqlen_q == 0) return;  // nothing to compute (SPEC §5 special cases)
  const int head_dim = fwd_head_dim(p);
  auto* s = static_cast<cudaStream_t>(stream);
  const cudaError_t err = p.storage == common::Storage::f16
                              ? run_sm80<common::Storage::f16>(p, head_dim, rng_state, s)
                              : run_sm80<common::Storage::bf16>(p, head_dim, rng_state, s);
  if (err != cudaSuccess) {
    throw Error(std::string("flashattn::forward (CUDA): kernel launch failed: ") + cudaGetErrorString(err));
  }
}

std::string compiled_kernels() { return "sm80 fwd: f16/bf16 x head dim 64, 128, 256"; }

}  // namespace flashattn::cuda
