// src/common/macros.h — portability macros for headers compiled by both the host compiler and nvcc.
#pragma once

#if defined(__CUDACC__)
#define FA_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FA_HOST_DEVICE inline
#endif
