// Paged attention on the CPU, reading K/V in place from the block pool (no gather): decodes (one
// new query token per sequence) and a prompt's first chunk. The two entry points at the end share
// their tasks among the threads of the enclosing OpenMP region (outside one: the calling thread).
//
// Cache of one layer: [kv_heads, num_blocks, block_size, head_dim]. q: [seqs, heads, head_dim]
// with a row stride of q_stride elements; out: [seqs, heads, head_dim], contiguous. The `group`
// query heads that share a KV head are served together, so each key and value row is read once.
// With AVX-512, or AVX2 + FMA, the inner loops are vectorised by hand (16 or 8 key rows per dot
// pass, register tiles of query rows for the weighted values); elsewhere the compiler does what
// it can.
#pragma once

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "attention_amx.h"
#include "common.h"
#include "flash_prefill.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace qw {

// Both passes take `n` consecutive rows (of d elements) of one block and `group` query heads;
// scores are [group, stride]. First pass: scores[g][j] = q[g] . keys[j] (q already scaled).
template <typename T, typename A>
void dots_scalar(const A* q, const T* keys, int64_t n, int64_t d, int64_t group, int64_t stride,
                 A* scores) {
  for (int64_t g = 0; g < group; ++g)
    for (int64_t j = 0; j < n; ++j) {
      A sum = 0;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < d; ++i) sum += q[g * d + i] * load(keys[j * d + i]);
      scores[g * stride + j] = sum;
    }
}

// Second pass: acc[g] += sum over j of weights[g][j] * values[j].
template <typename T, typename A>
void weigh_scalar(const A* weights, const T* values, int64_t n, int64_t d, int64_t group,
                  int64_t stride, A* acc) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t g = 0; g < group; ++g) {
      const A p = weights[g * stride + j];
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) acc[g * d + i] += p * load(values[j * d + i]);
    }
}

#if defined(__AVX512F__)
constexpr int64_t kMaxHeadDim = 256;

inline bool vectorised(int64_t d) { return d % 32 == 0 && d <= kMaxHeadDim; }

inline __m512 load16(const bf16* p) {  // 16 bf16 -> 16 floats
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

// 16 vectors -> one vector of their 16 horizontal sums, by a tree of shuffles
inline __m512 sum16(const __m512* v) {
  __m512 h[8], q[4], p[2];
  for (int i = 0; i < 8; ++i)  // 256-bit halves: two tokens per vector
    h[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit lanes: four tokens per vector
    q[i] = _mm512_add_ps(_mm512_shuffle_f32x4(h[2 * i], h[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(h[2 * i], h[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    p[i] = _mm512_add_ps(_mm512_unpacklo_ps(q[2 * i], q[2 * i + 1]),
                         _mm512_unpackhi_ps(q[2 * i], q[2 * i + 1]));
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(p[0], p[1], 0x44),
                                 _mm512_shuffle_ps(p[0], p[1], 0xEE));
  // lane k, element j now holds token 4j + k
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, r);
}

// 16 rows at a time (widened to float once, unless float already), then dotted with every
// query head of the group
template <typename T>
void dots(const float* q, const T* keys, int64_t n, int64_t d, int64_t group, int64_t stride,
          float* scores) {
  int64_t j = 0;
  if (vectorised(d)) {
    alignas(64) float wide[std::is_same_v<T, float> ? 1 : 16 * kMaxHeadDim];
    for (; j + 16 <= n; j += 16) {
      const float* rows = wide;
      if constexpr (std::is_same_v<T, float>) {
        rows = keys + j * d;
      } else {
        for (int64_t i = 0; i < 16 * d; i += 16)
          _mm512_store_ps(wide + i, load16(keys + j * d + i));
      }
      for (int64_t g = 0; g < group; ++g) {
        __m512 acc[16];
        for (int t = 0; t < 16; ++t) {
          acc[t] = _mm512_setzero_ps();
          for (int64_t i = 0; i < d; i += 16)
            acc[t] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * d + i),
                                     _mm512_loadu_ps(rows + t * d + i), acc[t]);
        }
        _mm512_storeu_ps(scores + g * stride + j, sum16(acc));
      }
    }
  }
  dots_scalar(q, keys + j * d, n - j, d, group, stride, scores + j);
}

#if defined(__AVX512BF16__)
// bfloat16 keys and (unscaled) queries: pairs multiplied and summed in float by one instruction
inline bool dots_bf16(const bf16* q, const bf16* keys, int64_t n, int64_t d, int64_t group,
               int64_t stride, float scale, float* scores) {
  if (n % 16 != 0 || !vectorised(d)) return false;
  for (int64_t g = 0; g < group; ++g) {
    __m512bh qv[kMaxHeadDim / 32];
    for (int64_t k = 0; k < d / 32; ++k) qv[k] = (__m512bh)_mm512_loadu_si512(q + g * d + 32 * k);
    for (int64_t j = 0; j < n; j += 16) {
      __m512 acc[16];
      for (int t = 0; t < 16; ++t) {
        acc[t] = _mm512_setzero_ps();
        for (int64_t k = 0; k < d / 32; ++k)
          acc[t] = _mm512_dpbf16_ps(
              acc[t], qv[k], (__m512bh)_mm512_loadu_si512(keys + (j + t) * d + 32 * k));
      }
      _mm512_storeu_ps(scores + g * stride + j, _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
    }
  }
  return true;
}
#endif

// R query rows over 32 dimensions, their sums held in registers across the tokens; each value
// row is widened once for all R
template <int R, typename T>
void weigh_tile(const float* weights, const T* values, int64_t n, int64_t d, int64_t stride,
                float* acc) {
  for (int64_t k = 0; k < d; k += 32) {
    __m512 lo[R], hi[R];
    for (int r = 0; r < R; ++r) {
      lo[r] = _mm512_loadu_ps(acc + r * d + k);
      hi[r] = _mm512_loadu_ps(acc + r * d + k + 16);
    }
    for (int64_t j = 0; j < n; ++j) {
      const __m512 v_lo = load16(values + j * d + k), v_hi = load16(values + j * d + k + 16);
      for (int r = 0; r < R; ++r) {
        const __m512 p = _mm512_set1_ps(weights[r * stride + j]);
        lo[r] = _mm512_fmadd_ps(p, v_lo, lo[r]);
        hi[r] = _mm512_fmadd_ps(p, v_hi, hi[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(acc + r * d + k, lo[r]);
      _mm512_storeu_ps(acc + r * d + k + 16, hi[r]);
    }
  }
}

#if defined(__AVX512BF16__)
// bfloat16 values, two tokens per dot product: the rows of tokens j and j+1 interleaved (one
// unpack per half) meet their two weights rounded to bfloat16, as torch's CPU flash attention
// rounds its probabilities before P.V. The sums build up in the unpacks' order (lane L of `lo`:
// dims 8L..8L+3, of `hi`: 8L+4..8L+7) and are put back in dimension order once, at the end.
template <int R>
void weigh_tile_bf16(const float* weights, const bf16* values, int64_t n, int64_t d,
                     int64_t stride, float* acc) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t k = 0; k < d; k += 32) {
    __m512 lo[R], hi[R];
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
    for (int64_t j0 = 0; j0 < n; j0 += 32) {
      const int64_t m = std::min<int64_t>(32, n - j0);
      alignas(64) uint16_t rounded[R][32];  // this run's weights in bfloat16, zero past m
      for (int r = 0; r < R; ++r) {
        const float* w = weights + r * stride + j0;
        const __m512 w0 = _mm512_maskz_loadu_ps(first_lanes(m), w);
        const __m512 w1 = _mm512_maskz_loadu_ps(first_lanes(m - 16), w + 16);
        _mm256_store_si256(reinterpret_cast<__m256i*>(rounded[r]), (__m256i)_mm512_cvtneps_pbh(w0));
        _mm256_store_si256(reinterpret_cast<__m256i*>(rounded[r] + 16),
                           (__m256i)_mm512_cvtneps_pbh(w1));
      }
      for (int64_t j = 0; j < m; j += 2) {
        const bf16* v = values + (j0 + j) * d + k;
        const __m512i a = _mm512_loadu_si512(v);
        const __m512i b = j + 1 < m ? _mm512_loadu_si512(v + d) : _mm512_setzero_si512();
        const __m512bh low = (__m512bh)_mm512_unpacklo_epi16(a, b);
        const __m512bh high = (__m512bh)_mm512_unpackhi_epi16(a, b);
        for (int r = 0; r < R; ++r) {
          int32_t pair;
          std::memcpy(&pair, rounded[r] + j, sizeof pair);
          const __m512bh p = (__m512bh)_mm512_set1_epi32(pair);
          lo[r] = _mm512_dpbf16_ps(lo[r], low, p);
          hi[r] = _mm512_dpbf16_ps(hi[r], high, p);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      float* out = acc + r * d + k;
      _mm512_storeu_ps(out, _mm512_add_ps(_mm512_loadu_ps(out),
                                          _mm512_permutex2var_ps(lo[r], first, hi[r])));
      _mm512_storeu_ps(out + 16, _mm512_add_ps(_mm512_loadu_ps(out + 16),
                                               _mm512_permutex2var_ps(lo[r], second, hi[r])));
    }
  }
}
#endif

// tile(std::integral_constant<int, R>, r) for tiles of R <= 8 rows from row r, covering `rows`
template <typename Tile>
void in_row_tiles(int64_t rows, Tile&& tile) {
  int64_t r = 0;
  for (; r + 8 <= rows; r += 8) tile(std::integral_constant<int, 8>{}, r);
  switch (rows - r) {
    case 7: return tile(std::integral_constant<int, 7>{}, r);
    case 6: return tile(std::integral_constant<int, 6>{}, r);
    case 5: return tile(std::integral_constant<int, 5>{}, r);
    case 4: return tile(std::integral_constant<int, 4>{}, r);
    case 3: return tile(std::integral_constant<int, 3>{}, r);
    case 2: return tile(std::integral_constant<int, 2>{}, r);
    case 1: return tile(std::integral_constant<int, 1>{}, r);
    default: return;
  }
}

template <typename T>
void weigh(const float* weights, const T* values, int64_t n, int64_t d, int64_t rows,
           int64_t stride, float* acc) {
  if (!vectorised(d)) return weigh_scalar(weights, values, n, d, rows, stride, acc);
  in_row_tiles(rows, [&](auto tile, int64_t r) {
    constexpr int R = decltype(tile)::value;
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, bf16>)
      return weigh_tile_bf16<R>(weights + r * stride, values, n, d, stride, acc + r * d);
#endif
    weigh_tile<R>(weights + r * stride, values, n, d, stride, acc + r * d);
  });
}
#endif


#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define QW_ATTENTION_AVX2 1
constexpr int64_t kMaxHeadDim = 256;

inline bool vectorised(int64_t d) { return d % 16 == 0 && d <= kMaxHeadDim; }

inline __m256 load8(const bf16* p) {  // 8 bf16 -> 8 floats
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

// 8 vectors -> one vector of their 8 horizontal sums
inline __m256 sum8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
  const __m256 c = _mm256_hadd_ps(v[4], v[5]), e = _mm256_hadd_ps(v[6], v[7]);
  const __m256 ab = _mm256_hadd_ps(a, b), ce = _mm256_hadd_ps(c, e);  // per lane: 4 half sums
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, ce, 0x20), _mm256_permute2f128_ps(ab, ce, 0x31));
}

// Up to 64 keys against MR (1..3) query rows held in registers, 32 dimensions at a time: each
// key row is read once for the MR rows (4 loads for 12 FMAs). Each (row, key) leaves an 8-lane
// partial sum in `part` ([MR][64][8], added over the dimension slices), summed up at the end.
template <int MR, typename T>
void dots_rows(const float* q, const T* keys, int64_t n, int64_t d, int64_t stride,
               float* scores) {
  static_assert(MR >= 1 && MR <= 3);
  alignas(32) float part[MR * 64 * 8];
  for (int64_t k = 0; k < d; k += 32) {
#define QW_ROWS(X) X(0) X(1) X(2)
#define QW_LOAD(r)                                                                  \
  __m256 q##r##a = _mm256_setzero_ps(), q##r##b = q##r##a, q##r##c = q##r##a,       \
         q##r##d = q##r##a;                                                         \
  if constexpr (r < MR) {                                                           \
    q##r##a = _mm256_loadu_ps(q + r * d + k);                                       \
    q##r##b = _mm256_loadu_ps(q + r * d + k + 8);                                   \
    q##r##c = _mm256_loadu_ps(q + r * d + k + 16);                                  \
    q##r##d = _mm256_loadu_ps(q + r * d + k + 24);                                  \
  }
#define QW_STEP(r)                                                                  \
  if constexpr (r < MR) {                                                           \
    __m256 sum = _mm256_mul_ps(q##r##a, k0);                                        \
    sum = _mm256_fmadd_ps(q##r##b, k1, sum);                                        \
    sum = _mm256_fmadd_ps(q##r##c, k2, sum);                                        \
    sum = _mm256_fmadd_ps(q##r##d, k3, sum);                                        \
    float* at = part + (r * 64 + j) * 8;                                            \
    _mm256_store_ps(at, k == 0 ? sum : _mm256_add_ps(sum, _mm256_load_ps(at)));     \
  }
    QW_ROWS(QW_LOAD)
    for (int64_t j = 0; j < n; ++j) {
      const T* key = keys + j * d + k;
      const __m256 k0 = load8(key), k1 = load8(key + 8), k2 = load8(key + 16);
      const __m256 k3 = load8(key + 24);
      QW_ROWS(QW_STEP)
    }
#undef QW_ROWS
#undef QW_LOAD
#undef QW_STEP
  }
  for (int r = 0; r < MR; ++r) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
      __m256 v[8];
      for (int t = 0; t < 8; ++t) v[t] = _mm256_load_ps(part + (r * 64 + j + t) * 8);
      _mm256_storeu_ps(scores + r * stride + j, sum8(v));
    }
    for (; j < n; ++j) {
      const float* at = part + (r * 64 + j) * 8;
      float total = 0;
      for (int t = 0; t < 8; ++t) total += at[t];
      scores[r * stride + j] = total;
    }
  }
}

// 8 key rows at a time (widened to float once, unless float already), dotted with every query
// head of the group; with head sizes of whole 32s, query rows by 3 and keys by 64 (dots_rows)
template <typename T>
void dots(const float* q, const T* keys, int64_t n, int64_t d, int64_t group, int64_t stride,
          float* scores) {
  if (d % 32 == 0 && d <= kMaxHeadDim) {
    for (int64_t j = 0; j < n; j += 64) {
      const int64_t m = std::min<int64_t>(64, n - j);
      int64_t r = 0;
      for (; r + 3 <= group; r += 3)
        dots_rows<3>(q + r * d, keys + j * d, m, d, stride, scores + r * stride + j);
      if (group - r == 2) dots_rows<2>(q + r * d, keys + j * d, m, d, stride, scores + r * stride + j);
      if (group - r == 1) dots_rows<1>(q + r * d, keys + j * d, m, d, stride, scores + r * stride + j);
    }
    return;
  }
  int64_t j = 0;
  if (vectorised(d)) {
    alignas(32) float wide[std::is_same_v<T, float> ? 1 : 8 * kMaxHeadDim];
    for (; j + 8 <= n; j += 8) {
      const float* rows = wide;
      if constexpr (std::is_same_v<T, float>) {
        rows = keys + j * d;
      } else {
        for (int64_t i = 0; i < 8 * d; i += 8) _mm256_store_ps(wide + i, load8(keys + j * d + i));
      }
      for (int64_t g = 0; g < group; ++g) {
        __m256 acc[8];
        for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
        for (int64_t i = 0; i < d; i += 8) {
          const __m256 qv = _mm256_loadu_ps(q + g * d + i);
          for (int t = 0; t < 8; ++t)
            acc[t] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(rows + t * d + i), acc[t]);
        }
        _mm256_storeu_ps(scores + g * stride + j, sum8(acc));
      }
    }
  }
  dots_scalar(q, keys + j * d, n - j, d, group, stride, scores + j);
}

// R query rows over 16 dimensions, their sums held in registers across the tokens; each value
// row is widened once for all R
template <int R, typename T>
void weigh_tile(const float* weights, const T* values, int64_t n, int64_t d, int64_t stride,
                float* acc) {
  for (int64_t k = 0; k < d; k += 16) {
    __m256 lo[R], hi[R];
    for (int r = 0; r < R; ++r) {
      lo[r] = _mm256_loadu_ps(acc + r * d + k);
      hi[r] = _mm256_loadu_ps(acc + r * d + k + 8);
    }
    for (int64_t j = 0; j < n; ++j) {
      const __m256 v_lo = load8(values + j * d + k), v_hi = load8(values + j * d + k + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 p = _mm256_broadcast_ss(weights + r * stride + j);
        lo[r] = _mm256_fmadd_ps(p, v_lo, lo[r]);
        hi[r] = _mm256_fmadd_ps(p, v_hi, hi[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(acc + r * d + k, lo[r]);
      _mm256_storeu_ps(acc + r * d + k + 8, hi[r]);
    }
  }
}

template <typename T, int R = 6>
void weigh_rows_tiled(const float* weights, const T* values, int64_t n, int64_t d, int64_t rows,
                      int64_t stride, float* acc) {
  if constexpr (R > 0) {
    for (; rows >= R; rows -= R, weights += R * stride, acc += R * d)
      weigh_tile<R>(weights, values, n, d, stride, acc);
    if (rows > 0) weigh_rows_tiled<T, R - 1>(weights, values, n, d, rows, stride, acc);
  }
}

// MR (1..3) rows over 32 dimensions: 12 accumulators, spelled out (arrays of them GCC stores to
// the stack every step); per value row 4 loads and 3 broadcasts for 12 FMAs
template <int MR, typename T>
void weigh_tile32(const float* weights, const T* values, int64_t n, int64_t d, int64_t stride,
                  float* acc) {
  static_assert(MR >= 1 && MR <= 3);
#define QW_ROWS(X) X(0) X(1) X(2)
#define QW_LOAD(r)                                                                  \
  __m256 a##r = _mm256_setzero_ps(), b##r = a##r, c##r = a##r, e##r = a##r;         \
  if constexpr (r < MR) {                                                           \
    a##r = _mm256_loadu_ps(acc + r * d);                                            \
    b##r = _mm256_loadu_ps(acc + r * d + 8);                                        \
    c##r = _mm256_loadu_ps(acc + r * d + 16);                                       \
    e##r = _mm256_loadu_ps(acc + r * d + 24);                                       \
  }
#define QW_STEP(r)                                                                  \
  if constexpr (r < MR) {                                                           \
    const __m256 p = _mm256_broadcast_ss(weights + r * stride + j);                 \
    a##r = _mm256_fmadd_ps(p, v0, a##r);                                            \
    b##r = _mm256_fmadd_ps(p, v1, b##r);                                            \
    c##r = _mm256_fmadd_ps(p, v2, c##r);                                            \
    e##r = _mm256_fmadd_ps(p, v3, e##r);                                            \
  }
#define QW_STORE(r)                                                                 \
  if constexpr (r < MR) {                                                           \
    _mm256_storeu_ps(acc + r * d, a##r);                                            \
    _mm256_storeu_ps(acc + r * d + 8, b##r);                                        \
    _mm256_storeu_ps(acc + r * d + 16, c##r);                                       \
    _mm256_storeu_ps(acc + r * d + 24, e##r);                                       \
  }
  QW_ROWS(QW_LOAD)
  for (int64_t j = 0; j < n; ++j) {
    const T* v = values + j * d;
    const __m256 v0 = load8(v), v1 = load8(v + 8), v2 = load8(v + 16), v3 = load8(v + 24);
    QW_ROWS(QW_STEP)
  }
  QW_ROWS(QW_STORE)
#undef QW_ROWS
#undef QW_LOAD
#undef QW_STEP
#undef QW_STORE
}

template <typename T>
void weigh(const float* weights, const T* values, int64_t n, int64_t d, int64_t rows,
           int64_t stride, float* acc) {
  if (d % 32 == 0) {  // rows by 3, dims by 32: a decode's group of 3 query heads in one pass
    for (int64_t k = 0; k < d; k += 32) {
      int64_t r = 0;
      for (; r + 3 <= rows; r += 3)
        weigh_tile32<3>(weights + r * stride, values + k, n, d, stride, acc + r * d + k);
      if (rows - r == 2) weigh_tile32<2>(weights + r * stride, values + k, n, d, stride, acc + r * d + k);
      if (rows - r == 1) weigh_tile32<1>(weights + r * stride, values + k, n, d, stride, acc + r * d + k);
    }
    return;
  }
  // float values: the compiler's vectorised loop was as fast on a Zen 1 (bfloat16 tiles: 1.35x)
  if (!vectorised(d) || std::is_same_v<T, float>)
    return weigh_scalar(weights, values, n, d, rows, stride, acc);
  weigh_rows_tiled(weights, values, n, d, rows, stride, acc);
}
#endif

template <typename T, typename A>
void score_rows(const T* q, const A* qf, const T* keys, int64_t n, int64_t d, int64_t group,
                int64_t stride, double scale, A* scores) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, bf16>) {  // whole runs of 16 rows here, the rest below
    const int64_t whole = n - n % 16;
    if (whole > 0 && dots_bf16(q, keys, whole, d, group, stride, float(scale), scores)) {
      keys += whole * d;
      scores += whole;
      n -= whole;
    }
  }
#endif
#if defined(__AVX512F__) || defined(QW_ATTENTION_AVX2)
  if constexpr (!std::is_same_v<A, double>) return dots(qf, keys, n, d, group, stride, scores);
#endif
  dots_scalar(qf, keys, n, d, group, stride, scores);
}

template <typename T, typename A>
void weigh_rows(const A* weights, const T* values, int64_t n, int64_t d, int64_t group,
                int64_t stride, A* acc) {
#if defined(__AVX512F__) || defined(QW_ATTENTION_AVX2)
  if constexpr (!std::is_same_v<A, double>) return weigh(weights, values, n, d, group, stride, acc);
#endif
  weigh_scalar(weights, values, n, d, group, stride, acc);
}

struct Shape {
  int64_t num_seqs, max_blocks, heads, kv_heads, head_dim, num_blocks, block_size, q_stride;
};

#if defined(QW_ATTENTION_AMX)
inline bool amx_serves(const Shape& s) {  // bfloat16 attention of this shape on AMX tiles here
  return amx::attention_serves(s.heads / s.kv_heads, s.head_dim, s.block_size) &&
         amx::tiles_ready();
}
#endif

template <typename T>
struct Scratch {  // one thread's buffers, reused across its tasks
  std::vector<T> raw;                     // [rows, d] the task's queries as given
  std::vector<typename Acc<T>::type> work;  // scaled queries, scores, weighted values
};

// One task: `count` consecutive query tokens of one sequence through one KV head, the i-th
// attending to the first len0 + i cached tokens (a decode is count 1), or with a sliding
// `window` (0: none) to the last `window` of them. Each query token brings `group` heads:
// count x group query rows share every key and value row read.
template <typename T>
void attend(const T* q, int64_t q_stride, int64_t count, int64_t len0, const int64_t* table,
            int64_t kv_head, T* out, int64_t out_stride, const T* k_cache, const T* v_cache,
            const Shape& s, double scale, Scratch<T>& buf, int64_t window = 0) {
  using A = typename Acc<T>::type;
  const int64_t group = s.heads / s.kv_heads, d = s.head_dim, bs = s.block_size;
  const int64_t rows = count * group, len = len0 + count - 1;
  buf.raw.resize(rows * d);
  buf.work.assign(rows * d + rows * len + rows * d, A(0));
  A* qf = buf.work.data();       // [rows, d] queries, scaled
  A* scores = qf + rows * d;     // [rows, len]
  A* acc = scores + rows * len;  // [rows, d] weighted values
  for (int64_t i = 0; i < count; ++i) {
    std::memcpy(buf.raw.data() + i * group * d, q + i * q_stride, group * d * sizeof(T));
  }
  for (int64_t i = 0; i < rows * d; ++i) qf[i] = load(buf.raw[i]) * A(scale);
  // a block's rows of one head are contiguous: walk the context block by block
  auto block_rows = [&](const T* cache, int64_t t) {
    return cache + ((kv_head * s.num_blocks + table[t / bs]) * bs + t % bs) * d;
  };
  // row r sees [first of its token, its visible); the task's keys start at its first row's first
  auto first_of = [&](int64_t r) {
    return window > 0 ? std::max<int64_t>(0, len0 + r / group - window) : int64_t(0);
  };
  const int64_t start = first_of(0);
  for (int64_t t = start; t < len; t += std::min(bs - t % bs, len - t)) {
    score_rows(buf.raw.data(), qf, block_rows(k_cache, t), std::min(bs - t % bs, len - t), d,
               rows, len, scale, scores + t);
  }
  for (int64_t r = 0; r < rows; ++r) {  // softmax over each row's own context; zero past it
    A* sr = scores + r * len;
    const int64_t visible = len0 + r / group, first = first_of(r);
    A top = sr[first];
#pragma omp simd reduction(max : top)
    for (int64_t t = first + 1; t < visible; ++t) top = std::max(top, sr[t]);
    A total = 0;
#pragma omp simd reduction(+ : total)
    for (int64_t t = first; t < visible; ++t) total += (sr[t] = std::exp(sr[t] - top));
    const A inv = A(1) / total;
    for (int64_t t = first; t < visible; ++t) sr[t] *= inv;
    std::fill(sr, sr + first, A(0));
    std::fill(sr + visible, sr + len, A(0));
  }
  for (int64_t t = start; t < len; t += std::min(bs - t % bs, len - t)) {
    weigh_rows(scores + t, block_rows(v_cache, t), std::min(bs - t % bs, len - t), d, rows, len,
               acc);
  }
  for (int64_t i = 0; i < count; ++i)
    for (int64_t j = 0; j < group * d; ++j) store(out + i * out_stride + j, acc[i * group * d + j]);
}

// decodes: one query token per sequence, each with its own block table and context length
template <typename T>
void decode_attention(const T* q, const T* k_cache, const T* v_cache, const int64_t* tables,
                      const int64_t* lens, T* out, const Shape& s, double scale,
                      int64_t window = 0) {
  const int64_t group = s.heads / s.kv_heads, group_width = group * s.head_dim;
#if defined(QW_ATTENTION_AMX)
  if constexpr (std::is_same_v<T, bf16>) {
    if (window == 0 && amx_serves(s)) {  // the tiles take no window: the vector kernel does
      return amx::attention_tasks(s.num_seqs, s.kv_heads, [&](int64_t seq, int64_t h, auto& buf) {
        amx::attend(q + seq * s.q_stride + h * group_width, 0, {1, group, lens[seq]},
                    tables + seq * s.max_blocks, h, k_cache, v_cache, s.num_blocks, s.block_size,
                    s.head_dim, float(scale), buf,
                    out + seq * s.heads * s.head_dim + h * group_width, 0);
      });
    }
  }
#endif
  Scratch<T> buf;
#pragma omp for collapse(2) schedule(dynamic)
  for (int64_t seq = 0; seq < s.num_seqs; ++seq)
    for (int64_t h = 0; h < s.kv_heads; ++h)
      attend(q + seq * s.q_stride + h * group_width, 0, 1, lens[seq],
             tables + seq * s.max_blocks, h, out + seq * s.heads * s.head_dim + h * group_width,
             0, k_cache, v_cache, s, scale, buf, window);
}

#if defined(QW_FLASH_PREFILL)
// the flash tasks (flash_prefill.h): tiles of kFlashRows query rows, each through one KV head
template <typename T>
void flash_prefill(const T* q, const T* k_cache, const T* v_cache, const int64_t* table, T* out,
                   const Shape& s, int64_t cached, int64_t count, double scale) {
  const int64_t group = s.heads / s.kv_heads, group_width = group * s.head_dim;
  const int64_t tile = kFlashRows / group, tiles = (count + tile - 1) / tile;
  FlashScratch buf;
#pragma omp for collapse(2) schedule(dynamic)
  for (int64_t k = 0; k < tiles; ++k)
    for (int64_t h = 0; h < s.kv_heads; ++h) {
      const int64_t first = k * tile;
      flash_attend(q + first * s.q_stride + h * group_width, s.q_stride,
                   std::min(tile, count - first), cached + first + 1, table, h,
                   out + first * s.heads * s.head_dim + h * group_width, s.heads * s.head_dim,
                   k_cache, v_cache, s.num_blocks, s.block_size, group, s.head_dim, scale, buf);
    }
}
#endif

// a prefill chunk: `count` query tokens of one sequence after `cached` tokens, causal; queries
// go in tiles small enough that a tile's scores stay in cache (flash tiles where they serve)
template <typename T>
void prefill_attention(const T* q, const T* k_cache, const T* v_cache, const int64_t* table,
                       T* out, const Shape& s, int64_t cached, int64_t count, double scale,
                       int64_t window = 0) {
  const int64_t group = s.heads / s.kv_heads, group_width = group * s.head_dim;
#if defined(QW_ATTENTION_AMX)
  if constexpr (std::is_same_v<T, bf16>) {  // tiles of as many tokens as 16 rows hold
    if (window == 0 && amx_serves(s)) {  // (a window: the vector kernel)
      const int64_t tile = amx::kRows / group, out_stride = s.heads * s.head_dim;
      return amx::attention_tasks((count + tile - 1) / tile, s.kv_heads,
                                  [&](int64_t k, int64_t h, auto& buf) {
        const int64_t first = k * tile;
        amx::attend(q + first * s.q_stride + h * group_width, s.q_stride,
                    {std::min(tile, count - first), group, cached + first + 1}, table, h,
                    k_cache, v_cache, s.num_blocks, s.block_size, s.head_dim, float(scale), buf,
                    out + first * out_stride + h * group_width, out_stride);
      });
    }
  }
#endif
#if defined(QW_FLASH_PREFILL)
  if constexpr (!std::is_same_v<T, double>) {
    if (window == 0 && flash_serves(s.head_dim, group))
      return flash_prefill(q, k_cache, v_cache, table, out, s, cached, count, scale);
  }
#endif
  const int64_t tile = std::clamp<int64_t>((64 << 10) / (group * (cached + count)), 1, 16);
  const int64_t tiles = (count + tile - 1) / tile;
  Scratch<T> buf;
#pragma omp for collapse(2) schedule(dynamic)
  for (int64_t k = 0; k < tiles; ++k)
    for (int64_t h = 0; h < s.kv_heads; ++h) {
      const int64_t first = k * tile;
      attend(q + first * s.q_stride + h * group_width, s.q_stride,
             std::min(tile, count - first), cached + first + 1, table, h,
             out + first * s.heads * s.head_dim + h * group_width, s.heads * s.head_dim,
             k_cache, v_cache, s, scale, buf, window);
    }
}

}  // namespace qw
