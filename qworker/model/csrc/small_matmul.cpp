// y = x W^T (+ bias) for a few rows of x in bfloat16: decode steps of small batches. There every
// weight byte is read once per step, so the step is bound by memory bandwidth; oneDNN reaches
// about a third of it at one row. Here each weight row is streamed once and dotted with every row
// of x by the AVX512-BF16 pair instruction, in float. Built and loaded by qworker/model/native.py.
#include <cstdint>

#include "common.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

using qw::bf16;
using qw::load;
using qw::store;

constexpr int64_t kMaxRows = 8;

#if defined(__AVX512BF16__)
// x: [m, k], w: [n, k], out: [m, n]; k a multiple of 32, m <= kMaxRows
bool small_matmul(const bf16* x, const bf16* w, const bf16* bias, bf16* out, int64_t m,
                  int64_t n, int64_t k) {
  if (k % 32 != 0 || m < 1 || m > kMaxRows) return false;
#pragma omp parallel for schedule(static)
  for (int64_t o = 0; o < n; ++o) {
    const bf16* row = w + o * k;
    __m512 even[kMaxRows], odd[kMaxRows];  // two chains per row hide the instruction's latency
    for (int64_t r = 0; r < m; ++r) even[r] = odd[r] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 64 <= k; i += 64) {
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(row + i);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(row + i + 32);
      for (int64_t r = 0; r < m; ++r) {
        even[r] = _mm512_dpbf16_ps(even[r], (__m512bh)_mm512_loadu_si512(x + r * k + i), w0);
        odd[r] = _mm512_dpbf16_ps(odd[r], (__m512bh)_mm512_loadu_si512(x + r * k + i + 32), w1);
      }
    }
    if (i < k) {
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(row + i);
      for (int64_t r = 0; r < m; ++r)
        even[r] = _mm512_dpbf16_ps(even[r], (__m512bh)_mm512_loadu_si512(x + r * k + i), w0);
    }
    const float b = bias != nullptr ? load(bias[o]) : 0.0f;
    for (int64_t r = 0; r < m; ++r)
      store(out + r * n + o, _mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r])) + b);
  }
  return true;
}
#else
bool small_matmul(const bf16*, const bf16*, const bf16*, bf16*, int64_t, int64_t, int64_t) {
  return false;
}
#endif

}  // namespace

// returns 0 when it did not compute (shape or CPU not served): the caller uses its own matmul
extern "C" int qw_small_matmul_bf16(const void* x, const void* w, const void* bias, void* out,
                                    int64_t m, int64_t n, int64_t k) {
  return small_matmul(static_cast<const bf16*>(x), static_cast<const bf16*>(w),
                      static_cast<const bf16*>(bias), static_cast<bf16*>(out), m, n, k);
}
