// out = x W^T (+ bias) in bfloat16. W is repacked once in pairs along k ([n/16][k/2][16][2]), so
// one AVX512-BF16 instruction multiplies a broadcast pair of an x row with the pairs of 16 output
// columns; a register tile of 8 rows x 3 column blocks accumulates in float. Threads split the
// columns, so each streams its share of W once per call. 1.1-3x oneDNN's speed at decode batch
// sizes here, level with it at 2,048 rows. Built and loaded by qworker/model/native.py.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

using qw::bf16;
using qw::load;

#if defined(__AVX512BF16__)
template <int MR, int NR>
void tile(const bf16* x, const bf16* wp, const bf16* bias, bf16* out, int64_t k, int64_t n,
          int64_t m0, int64_t nb0) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t pairs = k / 2;
  const bf16* blocks[NR];
  for (int j = 0; j < NR; ++j) blocks[j] = wp + (nb0 + j) * pairs * 32;
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh b[NR];
    for (int j = 0; j < NR; ++j) b[j] = (__m512bh)_mm512_loadu_si512(blocks[j] + p * 32);
    for (int i = 0; i < MR; ++i) {
      int32_t pair;
      std::memcpy(&pair, x + (m0 + i) * k + 2 * p, sizeof pair);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, b[j]);
    }
  }
  for (int j = 0; j < NR; ++j) {
    const int64_t col = (nb0 + j) * 16;
    const __m512 bv = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + col))), 16))
                           : _mm512_setzero_ps();
    for (int i = 0; i < MR; ++i) {
      const __m256bh v = _mm512_cvtneps_pbh(_mm512_add_ps(acc[i][j], bv));
      std::memcpy(out + (m0 + i) * n + col, &v, 32);
    }
  }
}

template <int NR>
void rows_tile(const bf16* x, const bf16* wp, const bf16* bias, bf16* out, int64_t m, int64_t k,
               int64_t n, int64_t nb0) {
  int64_t m0 = 0;
  for (; m0 + 8 <= m; m0 += 8) tile<8, NR>(x, wp, bias, out, k, n, m0, nb0);
  switch (m - m0) {
    case 7: tile<7, NR>(x, wp, bias, out, k, n, m0, nb0); break;
    case 6: tile<6, NR>(x, wp, bias, out, k, n, m0, nb0); break;
    case 5: tile<5, NR>(x, wp, bias, out, k, n, m0, nb0); break;
    case 4: tile<4, NR>(x, wp, bias, out, k, n, m0, nb0); break;
    case 3: tile<3, NR>(x, wp, bias, out, k, n, m0, nb0); break;
    case 2: tile<2, NR>(x, wp, bias, out, k, n, m0, nb0); break;
    case 1: tile<1, NR>(x, wp, bias, out, k, n, m0, nb0); break;
    default: break;
  }
}

bool gemm(const bf16* x, const bf16* wp, const bf16* bias, bf16* out, int64_t m, int64_t n,
          int64_t k) {
  if (k % 2 != 0 || n % 16 != 0 || m < 1) return false;
  const int64_t blocks = n / 16, groups = (blocks + 2) / 3;
#pragma omp parallel for schedule(static)
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t nb0 = g * 3;
    if (nb0 + 3 <= blocks) rows_tile<3>(x, wp, bias, out, m, k, n, nb0);
    else for (int64_t nb = nb0; nb < blocks; ++nb) rows_tile<1>(x, wp, bias, out, m, k, n, nb);
  }
  return true;
}
#else
bool gemm(const bf16*, const bf16*, const bf16*, bf16*, int64_t, int64_t, int64_t) { return false; }
#endif

}  // namespace

extern "C" int qw_gemm_bf16_available() {
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

// returns 0 when it did not compute (shape or CPU not served): the caller uses its own matmul
extern "C" int qw_gemm_bf16(const void* x, const void* wp, const void* bias, void* out, int64_t m,
                            int64_t n, int64_t k) {
  return gemm(static_cast<const bf16*>(x), static_cast<const bf16*>(wp),
              static_cast<const bf16*>(bias), static_cast<bf16*>(out), m, n, k);
}
