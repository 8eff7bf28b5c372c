// One instantiation per file keeps each CuTe translation unit small (time and memory of nvcc).
#include "cuda/sm80/sm80_fwd_launch.cuh"

namespace flashattn::cuda::sm80 {
template cudaError_t run_fwd_split<common::Storage::f16, 64>(const common::AttentionParams&, const SplitKvPartials&,
                                                              const std::uint64_t*, cudaStream_t);
}  // namespace flashattn::cuda::sm80
