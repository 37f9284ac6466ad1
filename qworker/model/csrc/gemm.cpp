// out = x W^T (+ bias) for bfloat16 and float32 on AVX-512. W is repacked once into blocks of 16
// output columns, k-major ([n/16][k/step][16][step], step 2 for bfloat16, 1 for float32), so one
// instruction multiplies a broadcast element (bfloat16: a pair, by AVX512-BF16) of an x row with
// 16 columns; a register tile of 8 rows x 3 blocks (48 columns) accumulates in float. Threads
// split the columns, so each streams its share of W once per call. Here that is 1.1-3x oneDNN's
// speed at decode batch sizes and level with it at 2,048 rows. Built by qworker/model/native.py.
#include <cstdint>
#include <cstring>

#include "common.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using qw::bf16;

#if defined(__AVX512F__)
struct Float32 {
  using T = float;
  static constexpr int64_t kStep = 1;
  static __m512 madd(__m512 acc, const float* x, __m512i w) {
    return _mm512_fmadd_ps(_mm512_set1_ps(*x), _mm512_castsi512_ps(w), acc);
  }
  static __m512 widen(const float* p) { return _mm512_loadu_ps(p); }
  static void narrow(float* out, __m512 v) { _mm512_storeu_ps(out, v); }
};
#endif

#if defined(__AVX512BF16__)
struct BFloat16 {
  using T = bf16;
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
template <typename Op, int MR, int NR>
void tile(const typename Op::T* x, const typename Op::T* wp, const typename Op::T* bias,
          typename Op::T* out, int64_t k, int64_t n, int64_t m0, int64_t nb0) {
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

template <typename Op, int NR>
void column_blocks(const typename Op::T* x, const typename Op::T* wp, const typename Op::T* bias,
                   typename Op::T* out, int64_t m, int64_t k, int64_t n, int64_t nb0) {
  int64_t m0 = 0;
  for (; m0 + 8 <= m; m0 += 8) tile<Op, 8, NR>(x, wp, bias, out, k, n, m0, nb0);
  switch (m - m0) {  // the last rows, in a smaller tile
    case 7: return tile<Op, 7, NR>(x, wp, bias, out, k, n, m0, nb0);
    case 6: return tile<Op, 6, NR>(x, wp, bias, out, k, n, m0, nb0);
    case 5: return tile<Op, 5, NR>(x, wp, bias, out, k, n, m0, nb0);
    case 4: return tile<Op, 4, NR>(x, wp, bias, out, k, n, m0, nb0);
    case 3: return tile<Op, 3, NR>(x, wp, bias, out, k, n, m0, nb0);
    case 2: return tile<Op, 2, NR>(x, wp, bias, out, k, n, m0, nb0);
    case 1: return tile<Op, 1, NR>(x, wp, bias, out, k, n, m0, nb0);
    default: return;
  }
}

template <typename Op>
int gemm(const void* x, const void* wp, const void* bias, void* out, int64_t m, int64_t n,
         int64_t k) {
  using T = typename Op::T;
  if (k % Op::kStep != 0 || n % 16 != 0 || m < 1) return 0;
  const auto* xs = static_cast<const T*>(x);
  const auto* ws = static_cast<const T*>(wp);
  const auto* bs = static_cast<const T*>(bias);
  auto* os = static_cast<T*>(out);
  const int64_t blocks = n / 16, groups = (blocks + 2) / 3;
#pragma omp parallel for schedule(static)
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t nb0 = g * 3;
    if (nb0 + 3 <= blocks) {
      column_blocks<Op, 3>(xs, ws, bs, os, m, k, n, nb0);
    } else {
      for (int64_t nb = nb0; nb < blocks; ++nb) column_blocks<Op, 1>(xs, ws, bs, os, m, k, n, nb);
    }
  }
  return 1;
}
#endif

}  // namespace

// each returns 0 when it did not compute (shape or CPU not served): the caller uses its own matmul
extern "C" int qw_gemm_f32(const void* x, const void* wp, const void* bias, void* out, int64_t m,
                           int64_t n, int64_t k) {
#if defined(__AVX512F__)
  return gemm<Float32>(x, wp, bias, out, m, n, k);
#else
  return 0;
#endif
}

extern "C" int qw_gemm_bf16(const void* x, const void* wp, const void* bias, void* out, int64_t m,
                            int64_t n, int64_t k) {
#if defined(__AVX512BF16__)
  return gemm<BFloat16>(x, wp, bias, out, m, n, k);
#else
  return 0;
#endif
}

// which of the two the build serves: bit 0 float32, bit 1 bfloat16
extern "C" int qw_gemm_available() {
  int served = 0;
#if defined(__AVX512F__)
  served |= 1;
#endif
#if defined(__AVX512BF16__)
  served |= 2;
#endif
  return served;
}
