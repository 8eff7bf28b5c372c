// src/cuda/dependent_launch.h — a kernel launched as the programmatic dependent of the kernel
// before it on the same stream (sm_90 and newer: `programmaticStreamSerializationAllowed`), so
// that its blocks may start once that kernel's blocks have all begun or executed
// `griddepcontrol.launch_dependents`; it must wait (`griddepcontrol.wait`) before it reads what
// that kernel writes. The caller decides where the GPU allows it. Host code only.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace flashattn::cuda {

template <class... Params, class... Args>
cudaError_t launch_as_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t smem_bytes,
                                cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, static_cast<Args&&>(args)...);
}

}  // namespace flashattn::cuda
