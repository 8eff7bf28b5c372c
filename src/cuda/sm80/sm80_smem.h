// src/cuda/sm80/sm80_smem.h — the shared memory one block may use on the current device, which
// decides the tiles the sm80 kernels run with: 227 KiB on H100/H200, 163 KiB on A100, 99 KiB on
// the sm86/sm89 GPUs (RTX 30xx/40xx, A10, L4, L40). Where the preferred tile of a kernel does not
// fit, its launcher takes a smaller one (sm80_fwd.h, sm80_bwd.h say which).
#pragma once

namespace flashattn::cuda::sm80 {

// Bytes of shared memory a block of the current device may opt into
// (cudaDevAttrMaxSharedMemoryPerBlockOptin), asked once per device; when the device cannot be
// asked, a value above every tile (the launch then reports the CUDA error). Capped by
// set_smem_limit_for_testing.
int smem_per_block_limit();

// Caps smem_per_block_limit() at `bytes` (0 removes the cap), so that a test runs the tile choice
// of a GPU with less shared memory on this one. Affects calls that start after it returns.
void set_smem_limit_for_testing(int bytes);

}  // namespace flashattn::cuda::sm80
