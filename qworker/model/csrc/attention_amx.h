// A decode's attention on AMX tiles (bfloat16): one sequence's query heads of one KV head (up to
// 16), its keys and values read in place from the paged cache.
// - Scores: keys are the A operand as they lie (16 tokens x 32 dimensions a tile, rows a head_dim
//   apart), the queries the B operand, transposed into dimension pairs once per task, a head a
//   column; a C tile is 16 tokens x the heads. Two chunks of 16 tokens go at a time.
// - Softmax per head, as attention.h does it (probabilities normalised, then rounded to bfloat16,
//   as torch's CPU flash attention rounds them before P.V).
// - P.V: the probabilities are the A operand (the heads x 32 tokens); a B tile is 16 pairs of
//   tokens x 16 dimensions, made by interleaving the value rows of tokens 2i and 2i + 1 (one
//   unpack per 32 dimensions, which puts the dimensions in the unpack's lane order; the sums are
//   put back in dimension order once, at the end). Tokens past the context are zeros.
#pragma once

#include "amx_tiles.h"

#if defined(QW_AMX)
#define QW_ATTENTION_AMX 1

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"

namespace qw::amx {

constexpr int64_t kWindow = 256;  // tokens scored before their scores are transposed
constexpr int64_t kAhead = 64;    // tokens ahead whose keys and values are fetched early

inline bool attention_serves(int64_t group, int64_t head_dim, int64_t block_size) {
  return group <= kCols && (head_dim == 64 || head_dim == 128) && block_size % kRows == 0;
}

struct AttentionScratch {  // one thread's buffers, reused across its tasks
  std::vector<float> scores_t;  // [tokens, 16]: a C tile's rows, a token each
  std::vector<float> scores;    // [group, tokens]
  std::vector<bf16> probs;      // [16, tokens]: the A tiles of P.V (rows past the group unused)
  alignas(64) bf16 queries[4][kRows][2 * kCols];  // B tiles: 32 dimensions of every head each
  alignas(64) bf16 values[4][kRows][2 * kCols];   // B tiles: 32 tokens x 16 dimensions each
  alignas(64) float sums[4][kRows][kCols];
};

// the cache row of token t of one KV head
struct Rows {
  const bf16* cache;
  const int64_t* table;
  int64_t kv_head, num_blocks, block_size, head_dim;
  const bf16* at(int64_t t) const {
    return cache + ((kv_head * num_blocks + table[t / block_size]) * block_size + t % block_size) *
                       head_dim;
  }
};

// the cache lines of up to 32 rows from token t (t a multiple of 16; rows past len are left)
inline void prefetch_rows(const Rows& rows, int64_t t, int64_t len) {
  const int64_t lines = rows.head_dim * int64_t(sizeof(bf16)) / 64;
  for (int64_t chunk = t; chunk < std::min(len, t + 2 * kRows); chunk += kRows) {
    const char* p = reinterpret_cast<const char*>(rows.at(chunk));
    for (int64_t i = 0; i < std::min<int64_t>(kRows, len - chunk) * lines; ++i)
      _mm_prefetch(p + 64 * i, _MM_HINT_T0);
  }
}

// scores_t [end - begin rounded up to 16][16] = keys [begin, end) . queries^T, S slices of 32
// dimensions (begin a multiple of 32)
template <int S>
void key_scores(const Rows& keys, int64_t begin, int64_t len, float* scores_t) {
  static_assert(S == 2 || S == 4);
  const int64_t stride = keys.head_dim * sizeof(bf16);
  scores_t -= begin * kCols;
  for (int64_t t = begin; t < len; t += 2 * kRows) {
    const bool two = t + kRows < len;  // chunks of 16 never cross a block (block_size % 16 == 0)
    const bf16* first = keys.at(t);
    const bf16* second = two ? keys.at(t + kRows) : first;
    if (t + kAhead < len) prefetch_rows(keys, t + kAhead, len);
    _tile_zero(0);
    _tile_zero(1);
#define QW_SLICE(s, b)                                   \
  _tile_loadd(2, first + (s) * kDepth, stride);          \
  _tile_dpbf16ps(0, 2, b);                               \
  _tile_loadd(7, second + (s) * kDepth, stride);         \
  _tile_dpbf16ps(1, 7, b);
    QW_SLICE(0, 3)
    QW_SLICE(1, 4)
    if constexpr (S == 4) {
      QW_SLICE(2, 5)
      QW_SLICE(3, 6)
    }
#undef QW_SLICE
    _tile_stored(0, scores_t + t * kCols, kCols * sizeof(float));
    if (two) _tile_stored(1, scores_t + (t + kRows) * kCols, kCols * sizeof(float));
  }
}

inline __mmask16 first_lanes(int64_t m) {
  return m >= 16 ? __mmask16(0xFFFF) : m <= 0 ? __mmask16(0) : __mmask16((1u << m) - 1);
}

// tokens [begin, end) of row g of scores = column g of scores_t (those tokens), scaled
inline void transpose_scores(const float* scores_t, int64_t begin, int64_t end, int64_t padded,
                             int64_t group, float scale, float* scores) {
  const __m512i column = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(kCols));
  for (int64_t g = 0; g < group; ++g)
    for (int64_t t = begin; t < end; t += kRows)
      _mm512_storeu_ps(scores + g * padded + t,
                       _mm512_mul_ps(_mm512_i32gather_ps(column, scores_t + (t - begin) * kCols + g,
                                                         sizeof(float)),
                                     _mm512_set1_ps(scale)));
}

// softmax of each row of scores over the first len, rounded to bfloat16 into probs (zeros up to
// padded)
inline void softmax_rows(int64_t len, int64_t padded, int64_t group, float* scores,
                         bf16* probs) {
  for (int64_t g = 0; g < group; ++g) {
    float* sr = scores + g * padded;
    __m512 tops = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < len; t += kCols)
      tops = _mm512_mask_max_ps(tops, first_lanes(len - t), tops, _mm512_loadu_ps(sr + t));
    const float top = _mm512_reduce_max_ps(tops);
    float total = 0;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < len; ++t) total += (sr[t] = std::exp(sr[t] - top));
    const __m512 inv = _mm512_set1_ps(1.0f / total);
    bf16* pr = probs + g * padded;
    for (int64_t t = 0; t < padded; t += kCols) {
      const __m512 p = _mm512_mul_ps(_mm512_maskz_loadu_ps(first_lanes(len - t), sr + t), inv);
      const __m256bh rounded = _mm512_cvtneps_pbh(p);  // to nearest even
      std::memcpy(pr + t, &rounded, sizeof rounded);
    }
  }
}

// 16 pairs of tokens from t (zeros past len) x 64 dimensions from k0, as four B tiles
inline void value_pairs(const Rows& values, int64_t t, int64_t len, int64_t k0,
                        bf16 (*tiles)[kRows][2 * kCols]) {
  int64_t block = t / values.block_size, offset = t % values.block_size;
  const bf16* base = values.at(t) - offset * values.head_dim;
  const __m512i zero = _mm512_setzero_si512();
  __m512i row[2][2];  // [token of the pair][32 dimensions]
  for (int64_t i = 0; i < 2 * kRows; ++i, ++offset) {
    if (t + i >= len) {  // past the context (and maybe past the table's last block)
      row[i % 2][0] = row[i % 2][1] = zero;
    } else {
      if (offset == values.block_size) {
        offset = 0;
        ++block;
        base = values.cache + (values.kv_head * values.num_blocks + values.table[block]) *
                                  values.block_size * values.head_dim;
      }
      const bf16* v = base + offset * values.head_dim + k0;
      row[i % 2][0] = _mm512_loadu_si512(v);
      row[i % 2][1] = _mm512_loadu_si512(v + kDepth);
    }
    if (i % 2 == 1) {
      for (int h = 0; h < 2; ++h) {
        _mm512_store_si512(tiles[2 * h][i / 2], _mm512_unpacklo_epi16(row[0][h], row[1][h]));
        _mm512_store_si512(tiles[2 * h + 1][i / 2], _mm512_unpackhi_epi16(row[0][h], row[1][h]));
      }
    }
  }
}

// out [group, head_dim] = probs . values, 64 dimensions at a time in four C tiles
inline void weigh_values(const Rows& values, int64_t len, int64_t padded, int64_t group,
                         const bf16* probs, AttentionScratch& buf, bf16* out) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const int64_t d = values.head_dim;
  for (int64_t k0 = 0; k0 < d; k0 += 2 * kDepth) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t t = 0; t < padded; t += kDepth) {
      if (k0 == 0 && t + kAhead < len) prefetch_rows(values, t + kAhead, len);
      value_pairs(values, t, len, k0, buf.values);
      _tile_loadd(4, probs + t, padded * sizeof(bf16));
      _tile_loadd(5, buf.values[0], 64);
      _tile_loadd(6, buf.values[1], 64);
      _tile_loadd(7, buf.values[2], 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_dpbf16ps(1, 4, 6);
      _tile_dpbf16ps(2, 4, 7);
      _tile_loadd(5, buf.values[3], 64);
      _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, buf.sums[0], 64);
    _tile_stored(1, buf.sums[1], 64);
    _tile_stored(2, buf.sums[2], 64);
    _tile_stored(3, buf.sums[3], 64);
    for (int64_t g = 0; g < group; ++g)
      for (int h = 0; h < 2; ++h) {  // the unpacks' lanes back in dimension order
        const __m512 lo = _mm512_load_ps(buf.sums[2 * h][g]);
        const __m512 hi = _mm512_load_ps(buf.sums[2 * h + 1][g]);
        bf16* dst = out + g * d + k0 + h * kDepth;
        const __m256bh a = _mm512_cvtneps_pbh(_mm512_permutex2var_ps(lo, first, hi));
        const __m256bh b = _mm512_cvtneps_pbh(_mm512_permutex2var_ps(lo, second, hi));
        std::memcpy(dst, &a, sizeof a);
        std::memcpy(dst + kCols, &b, sizeof b);
      }
  }
}

// q: [group, head_dim] of one sequence's decode token; out likewise. The tiles must be configured
// (configure()) on this thread.
inline void attend_decode(const bf16* q, int64_t len, const Rows& keys, const Rows& values,
                          int64_t group, float scale, AttentionScratch& buf, bf16* out) {
  const int64_t d = keys.head_dim, padded = (len + kDepth - 1) / kDepth * kDepth;
  buf.scores_t.resize(std::min(padded, kWindow) * kCols);
  buf.scores.resize(group * padded);
  buf.probs.resize(kRows * padded);
  std::memset(buf.queries, 0, sizeof buf.queries);
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < d; ++i)
      buf.queries[i / kDepth][i % kDepth / 2][2 * g + i % 2] = q[g * d + i];
  _tile_loadd(3, buf.queries[0], 64);
  _tile_loadd(4, buf.queries[1], 64);
  if (d == 128) {
    _tile_loadd(5, buf.queries[2], 64);
    _tile_loadd(6, buf.queries[3], 64);
  }
  for (int64_t t = 0; t < len; t += kWindow) {  // a window's C tiles are still in L1 when read
    const int64_t end = std::min(len, t + kWindow);
    if (d == 128) key_scores<4>(keys, t, end, buf.scores_t.data());
    else key_scores<2>(keys, t, end, buf.scores_t.data());
    transpose_scores(buf.scores_t.data(), t, end, padded, group, scale, buf.scores.data());
  }
  softmax_rows(len, padded, group, buf.scores.data(), buf.probs.data());
  weigh_values(values, len, padded, group, buf.probs.data(), buf, out);
}

}  // namespace qw::amx

#endif
