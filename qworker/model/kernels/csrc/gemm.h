// out = x W^T (+ bias) for bfloat16 and float32. W is repacked once into blocks of 16 output
// columns, k-major ([n/16][k/step][16][step], step 2 for bfloat16, 1 for float32), the same layout
// for every instruction set:
// - AVX-512: one instruction multiplies a broadcast element (bfloat16: a pair, by AVX512-BF16) of
//   an x row with 16 columns; a register tile of 8 rows x 3 blocks (48 columns) accumulates in
//   float. 1.1-3x oneDNN's speed at decode batch sizes on a Zen 4, level with it at 2,048 rows.
// - AVX2 + FMA: a block is two 8-lane halves; a bfloat16 pair of 8 columns widens to two float
//   vectors by a shift and a mask (no conversion instruction needed), then two FMAs. A tile of 6
//   (float32) or 4 (bfloat16) rows x 16 columns; rows go in chunks that stay in L2.
// Threads split the columns evenly, so each streams its share of W once per row chunk.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common.h"

#if defined(__AVX512F__) || defined(__AVX2__)
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
// (O: the output's type, T's or float: a bfloat16 product kept in float)
template <typename T, int MR, int NR, typename O = T>
void gemm_tile(const T* x, const T* wp, const T* bias, O* out, int64_t k, int64_t n, int64_t m0,
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
    for (int i = 0; i < MR; ++i) {
      if constexpr (std::is_same_v<O, float>)
        _mm512_storeu_ps(out + (m0 + i) * n + col, _mm512_add_ps(acc[i][j], b));
      else
        Op::narrow(out + (m0 + i) * n + col, _mm512_add_ps(acc[i][j], b));
    }
  }
}

// all rows of NR consecutive blocks of columns, 8 rows at a time
template <typename T, int NR, typename O = T>
void gemm_columns(const T* x, const T* wp, const T* bias, O* out, int64_t m, int64_t k, int64_t n,
                  int64_t nb0) {
  int64_t m0 = 0;
  for (; m0 + 8 <= m; m0 += 8) gemm_tile<T, 8, NR, O>(x, wp, bias, out, k, n, m0, nb0);
  switch (m - m0) {  // the last rows, in a smaller tile
    case 7: return gemm_tile<T, 7, NR, O>(x, wp, bias, out, k, n, m0, nb0);
    case 6: return gemm_tile<T, 6, NR, O>(x, wp, bias, out, k, n, m0, nb0);
    case 5: return gemm_tile<T, 5, NR, O>(x, wp, bias, out, k, n, m0, nb0);
    case 4: return gemm_tile<T, 4, NR, O>(x, wp, bias, out, k, n, m0, nb0);
    case 3: return gemm_tile<T, 3, NR, O>(x, wp, bias, out, k, n, m0, nb0);
    case 2: return gemm_tile<T, 2, NR, O>(x, wp, bias, out, k, n, m0, nb0);
    case 1: return gemm_tile<T, 1, NR, O>(x, wp, bias, out, k, n, m0, nb0);
    default: return;
  }
}
#endif


#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define QW_GEMM_AVX2 1
template <> struct GemmOp<float> {
  static constexpr bool kServed = true;
  static constexpr int64_t kStep = 1;
  static constexpr int kRows = 6;  // 12 accumulators + 2 weight vectors + 1 broadcast
  static void weights(const float* w, __m256* v) {  // 16 columns at one k
    v[0] = _mm256_loadu_ps(w);
    v[1] = _mm256_loadu_ps(w + 8);
  }
  static void broadcast(const float* x, __m256* v) { v[0] = _mm256_broadcast_ss(x); }
  static __m256 widen(const float* p) { return _mm256_loadu_ps(p); }
  static void narrow(float* out, __m256 v) { _mm256_storeu_ps(out, v); }
};

inline __m256 bf16_even(__m256i pairs) {  // the first of each (k, k + 1) pair, as floats
  return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
}
inline __m256 bf16_odd(__m256i pairs) {
  return _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(int32_t(0xffff0000u))));
}

template <> struct GemmOp<bf16> {
  static constexpr bool kServed = true;
  static constexpr int64_t kStep = 2;
  static constexpr int kRows = 4;  // 8 accumulators + 4 weight vectors + 2 broadcasts
  static void weights(const bf16* w, __m256* v) {  // 16 columns at k and k + 1: [half][k]
    for (int h = 0; h < 2; ++h) {
      const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 * h));
      v[2 * h] = bf16_even(pairs);
      v[2 * h + 1] = bf16_odd(pairs);
    }
  }
  static void broadcast(const bf16* x, __m256* v) {
    int32_t pair;
    std::memcpy(&pair, x, sizeof pair);
    const __m256i both = _mm256_set1_epi32(pair);
    v[0] = bf16_even(both);
    v[1] = bf16_odd(both);
  }
  static __m256 widen(const bf16* p) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }
  static void narrow(bf16* out, __m256 v) {  // to nearest even, NaN kept, as torch rounds
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, odd),
                                                   _mm256_set1_epi32(0x7fff)), 16);
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    r = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r),
                                             _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc0)), nan));
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(packed));
  }
};

// MR rows x one block of 16 columns (two accumulator arrays, not one 2-D array: GCC keeps those
// in registers, where it spilled half of a [MR][2] array to the stack every k step)
template <typename T, int MR>
void gemm_tile(const T* x, const T* wp, const T* bias, T* out, int64_t k, int64_t n, int64_t m0,
               int64_t nb) {
  using Op = GemmOp<T>;
  constexpr int S = Op::kStep;
  __m256 lo[MR], hi[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) lo[i] = hi[i] = _mm256_setzero_ps();
  const T* block = wp + nb * k * 16;
  const T* rows = x + m0 * k;
  for (int64_t p = 0; p < k / S; ++p) {
    __m256 w[2 * S];
    Op::weights(block + p * S * 16, w);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      __m256 xs[S];
      Op::broadcast(rows + i * k + p * S, xs);
#pragma GCC unroll 2
      for (int s = 0; s < S; ++s) {
        lo[i] = _mm256_fmadd_ps(xs[s], w[s], lo[i]);
        hi[i] = _mm256_fmadd_ps(xs[s], w[S + s], hi[i]);
      }
    }
  }
  const int64_t col = nb * 16;
  const __m256 b_lo = bias != nullptr ? Op::widen(bias + col) : _mm256_setzero_ps();
  const __m256 b_hi = bias != nullptr ? Op::widen(bias + col + 8) : _mm256_setzero_ps();
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    Op::narrow(out + (m0 + i) * n + col, _mm256_add_ps(lo[i], b_lo));
    Op::narrow(out + (m0 + i) * n + col + 8, _mm256_add_ps(hi[i], b_hi));
  }
}

// rows [m0, m1) of one block, kRows at a time, the rest in one smaller tile
template <typename T, int MR = GemmOp<T>::kRows>
void gemm_rows(const T* x, const T* wp, const T* bias, T* out, int64_t m0, int64_t m1, int64_t k,
               int64_t n, int64_t nb) {
  if constexpr (MR > 0) {
    for (; m0 + MR <= m1; m0 += MR) gemm_tile<T, MR>(x, wp, bias, out, k, n, m0, nb);
    if (m0 < m1) gemm_rows<T, MR - 1>(x, wp, bias, out, m0, m1, k, n, nb);
  }
}

constexpr int64_t kRowChunkBytes = 192 << 10;  // of x: stays in L2 while W's blocks stream by
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
#elif defined(QW_GEMM_AVX2)
  if constexpr (GemmOp<T>::kServed) {
    const int64_t blocks = n / 16, parts = omp_get_num_threads();
    const int64_t chunk = std::max<int64_t>(GemmOp<T>::kRows,
                                            kRowChunkBytes / int64_t(k * sizeof(T)));
#pragma omp for schedule(static)
    for (int64_t part = 0; part < parts; ++part) {  // even shares of whole blocks
      const int64_t first = blocks * part / parts, end = blocks * (part + 1) / parts;
      for (int64_t m0 = 0; m0 < m; m0 += chunk)
        for (int64_t nb = first; nb < end; ++nb)
          gemm_rows<T>(x, wp, bias, out, m0, std::min(m, m0 + chunk), k, n, nb);
    }
  }
#endif
}

}  // namespace qw
