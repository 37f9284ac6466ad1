// Prefill attention, flash style (AVX2 + FMA, float accumulation): one task is a tile of up to
// kFlashRows query rows (consecutive tokens x the `group` heads of one KV head) against that
// sequence's keys, read in panels of at most kFlashKeys keys (never across a block). Per panel:
// scores = K . Q^T by a register-tiled product (keys broadcast, read in place in float32), an
// online softmax (running max and sum per row, the output so far rescaled), then
// output += P . V, again register-tiled. No [rows, context] score matrix: a task's working set
// (under 150 KB) stays in L2 whatever the context, and both products run at FMA rate.
// attention.h's `attend` does the rest (double, odd head sizes, decodes).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "common.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define QW_FLASH_PREFILL 1

namespace qw {

constexpr int64_t kFlashRows = 48;   // query rows of one task
constexpr int64_t kFlashKeys = 128;  // keys of one panel
constexpr int64_t kFlashMaxDim = 256;
constexpr float kMasked = -1e30f;    // a finite "minus infinity" (-ffast-math assumes no infs)

inline bool flash_serves(int64_t head_dim, int64_t group) {
  return head_dim % 16 == 0 && head_dim <= kFlashMaxDim && group <= kFlashRows;
}

// e^x, vectorised (Cephes' polynomial, as avx_mathfun); x far below the float range gives 0
inline __m256 exp8(__m256 x) {
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i n = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(y, _mm256_castsi256_ps(n)));
}

// Scores are held transposed, [keys, rows] ("st"): the product takes the queries transposed
// once per task (not the keys once per panel), and the softmax runs 8 rows to a vector. Rows are
// padded to whole tiles of kRowTile (padding rows: zero queries, never stored).
constexpr int64_t kRowTile = 24;

// st[4 keys (KT of them), 24 rows] = keys[j] . qt[:, rows]; qt is [d, rp], keys [n, d]
template <int KT>
void qk_tile(const float* qt, int64_t rp, const float* keys, int64_t d, float* st) {
  static_assert(KT == 4 || KT == 1);
#define QW_KEYS(X) X(0) X(1) X(2) X(3)
#define QW_DECLARE(k) __m256 a##k = _mm256_setzero_ps(), b##k = a##k, c##k = a##k;
#define QW_STEP(k)                                                   \
  if constexpr (k < KT) {                                            \
    const __m256 kv = _mm256_broadcast_ss(keys + k * d + i);         \
    a##k = _mm256_fmadd_ps(kv, q0, a##k);                            \
    b##k = _mm256_fmadd_ps(kv, q1, b##k);                            \
    c##k = _mm256_fmadd_ps(kv, q2, c##k);                            \
  }
#define QW_STORE(k)                                                  \
  if constexpr (k < KT) {                                            \
    _mm256_storeu_ps(st + k * rp, a##k);                             \
    _mm256_storeu_ps(st + k * rp + 8, b##k);                         \
    _mm256_storeu_ps(st + k * rp + 16, c##k);                        \
  }
  // spelled out by macro: with arrays of accumulators GCC stores each to the stack every step
  QW_KEYS(QW_DECLARE)
  for (int64_t i = 0; i < d; ++i) {
    const __m256 q0 = _mm256_loadu_ps(qt + i * rp), q1 = _mm256_loadu_ps(qt + i * rp + 8);
    const __m256 q2 = _mm256_loadu_ps(qt + i * rp + 16);
    QW_KEYS(QW_STEP)
  }
  QW_KEYS(QW_STORE)
#undef QW_KEYS
#undef QW_DECLARE
#undef QW_STEP
#undef QW_STORE
}

// out[MR rows, 16 dims] += sum over j < n of st[j, rows] * v[j, 16 dims]; st [n, rp], v [n, d]
template <int MR>
void pv_tile(const float* st, int64_t rp, const float* v, int64_t n, int64_t d, float* out) {
  static_assert(MR == 6 || MR == 1);
#define QW_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
#define QW_LOAD(r)                                                   \
  __m256 lo##r = _mm256_setzero_ps(), hi##r = lo##r;                 \
  if constexpr (r < MR) {                                            \
    lo##r = _mm256_loadu_ps(out + r * d);                            \
    hi##r = _mm256_loadu_ps(out + r * d + 8);                        \
  }
#define QW_STEP(r)                                                   \
  if constexpr (r < MR) {                                            \
    const __m256 pv = _mm256_broadcast_ss(st + j * rp + r);          \
    lo##r = _mm256_fmadd_ps(pv, v0, lo##r);                          \
    hi##r = _mm256_fmadd_ps(pv, v1, hi##r);                          \
  }
#define QW_STORE(r)                                                  \
  if constexpr (r < MR) {                                            \
    _mm256_storeu_ps(out + r * d, lo##r);                            \
    _mm256_storeu_ps(out + r * d + 8, hi##r);                        \
  }
  QW_ROWS(QW_LOAD)
  for (int64_t j = 0; j < n; ++j) {
    const __m256 v0 = _mm256_loadu_ps(v + j * d), v1 = _mm256_loadu_ps(v + j * d + 8);
    QW_ROWS(QW_STEP)
  }
  QW_ROWS(QW_STORE)
#undef QW_ROWS
#undef QW_LOAD
#undef QW_STEP
#undef QW_STORE
}

struct FlashScratch {  // one thread's buffers, reused across its tasks
  std::vector<float> buf;
};

// The online softmax of one panel of n keys, 8 rows at a time: masks each row past its visible
// keys (vis: the first row's count, rows of one token share it), turns scores into weights
// against the new running max, updates the running sums and returns in `keep` the factor of the
// output so far.
inline void panel_softmax(float* st, int64_t rp, int64_t n, const float* vis, float* top,
                          float* total, float* keep) {
  for (int64_t r = 0; r < rp; r += 8) {
    const __m256 visible = _mm256_loadu_ps(vis + r);
    __m256 mx = _mm256_set1_ps(kMasked);
    for (int64_t j = 0; j < n; ++j) {
      const __m256 hidden = _mm256_cmp_ps(_mm256_set1_ps(float(j)), visible, _CMP_GE_OQ);
      const __m256 x = _mm256_blendv_ps(_mm256_loadu_ps(st + j * rp + r),
                                        _mm256_set1_ps(kMasked), hidden);
      _mm256_storeu_ps(st + j * rp + r, x);
      mx = _mm256_max_ps(mx, x);
    }
    const __m256 old = _mm256_loadu_ps(top + r), now = _mm256_max_ps(old, mx);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(st + j * rp + r), now));
      _mm256_storeu_ps(st + j * rp + r, e);
      sum = _mm256_add_ps(sum, e);
    }
    const __m256 factor = exp8(_mm256_sub_ps(old, now));
    _mm256_storeu_ps(keep + r, factor);
    _mm256_storeu_ps(total + r, _mm256_fmadd_ps(_mm256_loadu_ps(total + r), factor, sum));
    _mm256_storeu_ps(top + r, now);
  }
}

// One task: `count` consecutive query tokens of one sequence through one KV head, the i-th
// attending to the first len0 + i tokens; count x group <= kFlashRows.
template <typename T>
void flash_attend(const T* q, int64_t q_stride, int64_t count, int64_t len0, const int64_t* table,
                  int64_t kv_head, T* out, int64_t out_stride, const T* k_cache, const T* v_cache,
                  int64_t num_blocks, int64_t bs, int64_t group, int64_t d, double scale,
                  FlashScratch& scratch) {
  const int64_t rows = count * group, len = len0 + count - 1;
  const int64_t rp = (rows + kRowTile - 1) / kRowTile * kRowTile;
  constexpr int64_t P = kFlashKeys;
  scratch.buf.assign(d * rp + rp * d + 2 * P * d + P * rp + 5 * rp, 0.0f);
  float* qt = scratch.buf.data();  // [d, rp] scaled queries, transposed
  float* acc = qt + d * rp;        // [rp, d] output so far, unnormalised
  float* kw = acc + rp * d;        // [P, d] the panel's keys widened (bfloat16 only)
  float* vw = kw + P * d;          // [P, d] its values widened (bfloat16 only)
  float* st = vw + P * d;          // [P, rp] scores, then weights
  float* top = st + P * rp;        // [rp] running max
  float* total = top + rp;         // [rp] running sum of weights
  float* keep = total + rp;        // [rp] this panel's factor of the output so far
  float* vis0 = keep + rp;         // [rp] each row's visible keys
  float* vis = vis0 + rp;          // [rp] of those, in this panel
  for (int64_t r = 0; r < rp; ++r) {
    top[r] = kMasked;
    vis0[r] = float(len0 + std::min(r, rows - 1) / group);
    if (r >= rows) continue;
    const T* src = q + (r / group) * q_stride + (r % group) * d;
    for (int64_t i = 0; i < d; ++i) qt[i * rp + r] = load(src[i]) * float(scale);
  }
  for (int64_t t = 0; t < len;) {
    const int64_t n = std::min({P, bs - t % bs, len - t});
    const int64_t at = ((kv_head * num_blocks + table[t / bs]) * bs + t % bs) * d;
    const float* keys = nullptr;
    const float* values = nullptr;
    if constexpr (std::is_same_v<T, float>) {
      keys = k_cache + at;
      values = v_cache + at;
    } else {
      for (int64_t j = 0; j < n * d; ++j) kw[j] = load(k_cache[at + j]);
      for (int64_t j = 0; j < n * d; ++j) vw[j] = load(v_cache[at + j]);
      keys = kw;
      values = vw;
    }
    for (int64_t r0 = 0; r0 < rp; r0 += kRowTile) {
      int64_t j = 0;
      for (; j + 4 <= n; j += 4) qk_tile<4>(qt + r0, rp, keys + j * d, d, st + j * rp + r0);
      for (; j < n; ++j) qk_tile<1>(qt + r0, rp, keys + j * d, d, st + j * rp + r0);
    }
    for (int64_t r = 0; r < rp; ++r) vis[r] = vis0[r] - float(t);
    panel_softmax(st, rp, n, vis, top, total, keep);
    for (int64_t r = 0; r < rows; ++r)
      if (keep[r] != 1.0f)
        for (int64_t i = 0; i < d; ++i) acc[r * d + i] *= keep[r];
    int64_t r = 0;
    for (; r + 6 <= rows; r += 6)
      for (int64_t k = 0; k < d; k += 16) pv_tile<6>(st + r, rp, values + k, n, d, acc + r * d + k);
    for (; r < rows; ++r)
      for (int64_t k = 0; k < d; k += 16) pv_tile<1>(st + r, rp, values + k, n, d, acc + r * d + k);
    t += n;
  }
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = out + (r / group) * out_stride + (r % group) * d;
    const float inv = 1.0f / total[r];
    for (int64_t i = 0; i < d; ++i) store(dst + i, acc[r * d + i] * inv);
  }
}

}  // namespace qw
#endif
