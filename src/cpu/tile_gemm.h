// src/cpu/tile_gemm.h — the register-blocked fp32 micro-GEMM under the CPU flash backend:
//     C (m, n) (+)= A (m, k) · B (k, n)
// with B and C row-major and A either row-major or stored transposed, so that every product the
// forward and backward passes need (Q·Kᵀ, P·V, Pᵀ·dO, dSᵀ·Q, dS·K, …) runs on one kernel without
// transposing a score tile. Written with GCC vector extensions; the sources are compiled with
// -march=native, and one VecF is one register of the widest vector unit that gives them: 512 bits
// with AVX-512, 256 with AVX/AVX2, else 128 (SSE, NEON). A VecF wider than the registers is not
// split into register-sized pieces by GCC but kept in memory, every operation a round trip
// through the stack: with 512-bit VecF on an AVX2 machine the CPU backend ran at 4 GFLOP/s.
#pragma once

#include <cstring>

namespace flashattn::cpu {

// Builds without -march=native get a VecF that no register holds; GCC then notes (-Wpsabi) that
// passing it by value has no fixed ABI. Every function taking one is inline, so no ABI is crossed;
// the note stays off for the rest of every file that includes this header (the warning fires at
// the inlined call sites, so a push/pop here would not cover it).
#pragma GCC diagnostic ignored "-Wpsabi"

#if defined(__AVX512F__)
inline constexpr int kVecWidth = 16;  // fp32 lanes of one VecF: one zmm register
#elif defined(__AVX__)
inline constexpr int kVecWidth = 8;  // one ymm register
#else
inline constexpr int kVecWidth = 4;  // one xmm (SSE) or q (NEON) register
#endif
typedef float VecF __attribute__((vector_size(kVecWidth * sizeof(float))));

inline VecF load_vec(const float* p) {
  VecF v;
  std::memcpy(&v, p, sizeof v);  // an unaligned vector load; memcpy keeps it alias-safe
  return v;
}
inline void store_vec(float* p, VecF v) { std::memcpy(p, &v, sizeof v); }
inline VecF splat(float x) { return VecF{} + x; }

// Where element (r, kk) of A lives.
enum class ALayout {
  row_major,   // a[r · lda + kk]: A (m, k)
  transposed,  // a[kk · lda + r]: Aᵀ (k, m) is stored, e.g. a (keys, queries) score tile read as
               // (queries, keys)
};

// The register block: kMicroRows rows × kMicroVecs vectors of C stay in registers for the whole k
// loop — with 32 vector registers (AVX-512, AArch64) 16 accumulators, with 16 (AVX2, SSE) 12 —
// leaving room for the B row and the broadcast A values, and enough independent FMA chains to
// cover the FMA latency on two FMA ports. AVX2, one thread, bf16 d 128 s 1024: 6 rows ×1.3–1.8
// over 4.
#if defined(__AVX512F__) || defined(__aarch64__)
inline constexpr int kMicroRows = 8;
#else
inline constexpr int kMicroRows = 6;
#endif
inline constexpr int kMicroVecs = 2;

namespace detail {

template <int kRows, int kVecs, ALayout kA, bool kAccumulate>
inline void micro_kernel(int k, const float* __restrict a, int lda, const float* __restrict b,
                         int ldb, float* __restrict c, int ldc) {
  VecF acc[kRows][kVecs];
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < kVecs; ++v) {
      acc[r][v] = kAccumulate ? load_vec(c + r * ldc + v * kVecWidth) : VecF{};
    }
  }
  for (int kk = 0; kk < k; ++kk) {
    VecF bv[kVecs];  // (1, kVecs · 16): row kk of the B panel
#pragma GCC unroll 4
    for (int v = 0; v < kVecs; ++v) bv[v] = load_vec(b + kk * ldb + v * kVecWidth);
#pragma GCC unroll 16
    for (int r = 0; r < kRows; ++r) {
      const float x = kA == ALayout::row_major ? a[r * lda + kk] : a[kk * lda + r];
#pragma GCC unroll 4
      for (int v = 0; v < kVecs; ++v) acc[r][v] += x * bv[v];
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < kVecs; ++v) store_vec(c + r * ldc + v * kVecWidth, acc[r][v]);
  }
}

// The last m mod kMicroRows rows of a column strip: a register block of exactly `rows` rows,
// found by counting kRows down from kMicroRows − 1.
template <int kRows, int kVecs, ALayout kA, bool kAccumulate>
inline void row_tail(int rows, int k, const float* a, int lda, const float* b, int ldb, float* c,
                     int ldc) {
  if constexpr (kRows > 0) {
    if (rows == kRows) {
      micro_kernel<kRows, kVecs, kA, kAccumulate>(k, a, lda, b, ldb, c, ldc);
    } else {
      row_tail<kRows - 1, kVecs, kA, kAccumulate>(rows, k, a, lda, b, ldb, c, ldc);
    }
  }
}

// Rows [0, m) of one column strip of kVecs vectors: full register blocks, then the row tail.
template <int kVecs, ALayout kA, bool kAccumulate>
inline void column_strip(int m, int k, const float* a, int lda, const float* b, int ldb, float* c,
                         int ldc) {
  const auto a_row = [&](int r) { return kA == ALayout::row_major ? a + r * lda : a + r; };
  int r = 0;
  for (; r + kMicroRows <= m; r += kMicroRows) {
    micro_kernel<kMicroRows, kVecs, kA, kAccumulate>(k, a_row(r), lda, b, ldb, c + r * ldc, ldc);
  }
  row_tail<kMicroRows - 1, kVecs, kA, kAccumulate>(m - r, k, a_row(r), lda, b, ldb, c + r * ldc,
                                                   ldc);
}

}  // namespace detail

// C (m, n) = A (m, k) · B (k, n), or C += A · B with kAccumulate.
// Preconditions: n is a multiple of kVecWidth (callers pad their fp32 tiles); B rows and C rows
// hold n readable (and for C writable) floats at strides ldb and ldc. k may be 0 (C = 0 or
// unchanged).
template <ALayout kA, bool kAccumulate>
inline void tile_gemm(int m, int n, int k, const float* a, int lda, const float* b, int ldb,
                      float* c, int ldc) {
  constexpr int kStrip = kMicroVecs * kVecWidth;
  int col = 0;
  for (; col + kStrip <= n; col += kStrip) {
    detail::column_strip<kMicroVecs, kA, kAccumulate>(m, k, a, lda, b + col, ldb, c + col, ldc);
  }
  for (; col < n; col += kVecWidth) {
    detail::column_strip<1, kA, kAccumulate>(m, k, a, lda, b + col, ldb, c + col, ldc);
  }
}

}  // namespace flashattn::cpu
