// Attention on AMX tiles (bfloat16): up to 16 query rows of one sequence through one KV head (a
// decode's group of heads, or a few prefill tokens' groups, each row seeing its own causal
// length), keys and values read in place from the paged cache, 16 tokens (a run that never
// crosses a block) to a tile.
// - Scores: 16 keys as they lie are the A operand (rows a head_dim apart), the queries the B
//   operand, transposed into dimension pairs once per task, a head a column; a C tile is 16
//   tokens x the heads, gathered per head from windows of tokens still in L1.
// - Softmax per head, as attention.h does it (probabilities normalised, then rounded to bfloat16,
//   as torch's CPU flash attention rounds them before P.V).
// - P.V with the values as they lie, too: 16 value rows are a B tile whose k-pairs are (token,
//   dimension 2c or 2c + 1) and whose columns are the pairs c. Multiplied by the probabilities
//   widened to (p, 0) pairs it sums the even dimensions, by (0, p) pairs the odd ones, so no
//   value is ever moved before the tile unit reads it. A last run past the context is copied
//   into zeros first (a block's stale rows never meet a zero probability).
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
constexpr int64_t kAhead = 4;     // runs of 16 ahead whose keys and values are fetched early

inline bool attention_serves(int64_t group, int64_t head_dim, int64_t block_size) {
  return group <= kCols && (head_dim == 64 || head_dim == 128) && block_size % kRows == 0;
}

// the query rows of one task: `count` tokens of `group` heads, the first token seeing len0 keys
struct QueryRows {
  int64_t count, group, len0;
  int64_t rows() const { return count * group; }
  int64_t len() const { return len0 + count - 1; }      // keys the last token sees
  int64_t visible(int64_t r) const { return len0 + r / group; }
};

struct AttentionScratch {  // one thread's buffers, reused across its tasks
  std::vector<int64_t> runs;    // the cache offset of each run of 16 tokens (keys and values)
  std::vector<float> scores_t;  // [window, 16]: C tiles' rows, a token each
  std::vector<float> scores;    // [rows, tokens]
  // (p, 0) and (0, p) bfloat16 pairs, [runs x rows + 16 spare][16]: run r's A tile is the 16 rows
  // from r x rows, its own query rows first, then rows of later runs (sums never read)
  std::vector<uint32_t> even, odd;
  alignas(64) bf16 queries[4][kRows][2 * kCols];  // B tiles: 32 dimensions of every head each
  alignas(64) bf16 tail[kRows][128];              // the last run of values, zero past the context
  alignas(64) float sums[4][kRows][kCols];
};

// the cache offset (elements) of every run of 16 tokens of [0, len), one division per block
inline void list_runs(const int64_t* table, int64_t kv_head, int64_t num_blocks,
                      int64_t block_size, int64_t head_dim, int64_t len,
                      std::vector<int64_t>& runs) {
  runs.clear();
  for (int64_t t = 0; t < len;) {
    const int64_t block = t / block_size, stop = std::min(len, (block + 1) * block_size);
    const int64_t first = (kv_head * num_blocks + table[block]) * block_size;
    for (; t < stop; t += kRows) runs.push_back((first + t % block_size) * head_dim);
  }
}

inline void prefetch_run(const bf16* rows, int64_t head_dim) {
  const char* p = reinterpret_cast<const char*>(rows);
  for (int64_t i = 0; i < kRows * head_dim * int64_t(sizeof(bf16)); i += 64)
    _mm_prefetch(p + i, _MM_HINT_T0);
}

// scores_t [16 runs' tokens][16] = keys . queries^T for runs [first, last), S slices of 32
// dimensions (the queries in tiles 3..3+S)
template <int S>
void key_scores(const bf16* keys, const int64_t* runs, int64_t first, int64_t last,
                int64_t all_runs, int64_t head_dim, float* scores_t) {
  static_assert(S == 2 || S == 4);
  const int64_t stride = head_dim * sizeof(bf16);
  for (int64_t r = first; r < last; r += 2) {
    const bool two = r + 1 < last;
    const bf16* a = keys + runs[r];
    const bf16* b = keys + runs[two ? r + 1 : r];
    for (int64_t ahead = r + kAhead; ahead < std::min(all_runs, r + kAhead + 2); ++ahead)
      prefetch_run(keys + runs[ahead], head_dim);
    _tile_zero(0);
    _tile_zero(1);
#define QW_SLICE(s, q)                       \
  _tile_loadd(2, a + (s) * kDepth, stride);  \
  _tile_dpbf16ps(0, 2, q);                   \
  _tile_loadd(7, b + (s) * kDepth, stride);  \
  _tile_dpbf16ps(1, 7, q);
    QW_SLICE(0, 3)
    QW_SLICE(1, 4)
    if constexpr (S == 4) {
      QW_SLICE(2, 5)
      QW_SLICE(3, 6)
    }
#undef QW_SLICE
    float* at = scores_t + (r - first) * kRows * kCols;
    _tile_stored(0, at, kCols * sizeof(float));
    if (two) _tile_stored(1, at + kRows * kCols, kCols * sizeof(float));
  }
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

// softmax of each row of scores over the keys it sees, rounded to bfloat16 and widened to the
// (p, 0) and (0, p) pairs of even and odd (zeros up to padded), row g of run r at r x rows + g
inline void softmax_rows(const QueryRows& rows, int64_t padded, float* scores, uint32_t* even,
                         uint32_t* odd) {
  const int64_t group = rows.rows();
  for (int64_t g = 0; g < group; ++g) {
    const int64_t len = rows.visible(g);
    float* sr = scores + g * padded;
    __m512 tops = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < len; t += kCols)
      tops = _mm512_mask_max_ps(tops, first_lanes(len - t), tops, _mm512_loadu_ps(sr + t));
    const float top = _mm512_reduce_max_ps(tops);
    float total = 0;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < len; ++t) total += (sr[t] = std::exp(sr[t] - top));
    const __m512 inv = _mm512_set1_ps(1.0f / total);
    for (int64_t t = 0; t < padded; t += kCols) {
      const __m512 p = _mm512_mul_ps(_mm512_maskz_loadu_ps(first_lanes(len - t), sr + t), inv);
      const __m512i bits = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(p));  // to nearest even
      const int64_t row = (t / kRows * group + g) * kCols;
      _mm512_storeu_si512(even + row, bits);
      _mm512_storeu_si512(odd + row, _mm512_slli_epi32(bits, 16));
    }
  }
}

// out (token i's head g at out + i * out_stride + g * head_dim) = probs . values, 64 dimensions
// at a time in four C tiles (even and odd dimensions of two 32-dimension halves)
inline void weigh_values(const bf16* values, const int64_t* runs, int64_t num_runs,
                         const QueryRows& rows, int64_t padded, int64_t head_dim,
                         AttentionScratch& buf, bf16* out, int64_t out_stride) {
  const int64_t len = rows.len(), group = rows.rows();
  const __m512i low = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i high =
      _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  const int64_t stride = head_dim * sizeof(bf16), p_stride = kCols * sizeof(uint32_t);
  const int64_t whole = len / kRows;  // runs read in place; a partial last one from buf.tail
  if (whole < num_runs) {
    std::memset(buf.tail, 0, sizeof buf.tail);
    for (int64_t i = 0; i < len - whole * kRows; ++i)
      std::memcpy(buf.tail[i], values + runs[whole] + i * head_dim, stride);
  }
  for (int64_t k0 = 0; k0 < head_dim; k0 += 2 * kDepth) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t r = 0; r < num_runs; ++r) {
      const bool in_place = r < whole;
      const bf16* v = (in_place ? values + runs[r] : &buf.tail[0][0]) + k0;
      const int64_t v_stride = in_place ? stride : int64_t(sizeof buf.tail[0]);
      if (k0 == 0 && r + kAhead < num_runs) prefetch_run(values + runs[r + kAhead], head_dim);
      _tile_loadd(4, buf.even.data() + r * group * kCols, p_stride);
      _tile_loadd(5, buf.odd.data() + r * group * kCols, p_stride);
      _tile_loadd(6, v, v_stride);
      _tile_loadd(7, v + kDepth, v_stride);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 5, 6);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
    for (int t = 0; t < 4; ++t) {
      switch (t) {  // tile numbers are immediates
        case 0: _tile_stored(0, buf.sums[0], 64); break;
        case 1: _tile_stored(1, buf.sums[1], 64); break;
        case 2: _tile_stored(2, buf.sums[2], 64); break;
        default: _tile_stored(3, buf.sums[3], 64); break;
      }
    }
    for (int64_t g = 0; g < group; ++g)
      for (int h = 0; h < 2; ++h) {  // even and odd dimensions back in order
        const __m512 e = _mm512_load_ps(buf.sums[2 * h][g]);
        const __m512 o = _mm512_load_ps(buf.sums[2 * h + 1][g]);
        bf16* dst = out + g / rows.group * out_stride + g % rows.group * head_dim + k0 + h * kDepth;
        const __m256bh a = _mm512_cvtneps_pbh(_mm512_permutex2var_ps(e, low, o));
        const __m256bh b = _mm512_cvtneps_pbh(_mm512_permutex2var_ps(e, high, o));
        std::memcpy(dst, &a, sizeof a);
        std::memcpy(dst + kCols, &b, sizeof b);
      }
  }
}

// q: token i's `group` heads of head_dim at q + i * q_stride, attending causally to the cache
// (block table `table`, KV head kv_head); out likewise, at out + i * out_stride. The tiles must
// be configured (configure()) on this thread.
inline void attend(const bf16* q, int64_t q_stride, const QueryRows& rows, const int64_t* table,
                   int64_t kv_head, const bf16* k_cache, const bf16* v_cache, int64_t num_blocks,
                   int64_t block_size, int64_t head_dim, float scale, AttentionScratch& buf,
                   bf16* out, int64_t out_stride) {
  const int64_t d = head_dim, len = rows.len(), group = rows.rows();
  const int64_t padded = (len + kRows - 1) / kRows * kRows;
  list_runs(table, kv_head, num_blocks, block_size, d, len, buf.runs);
  const int64_t num_runs = static_cast<int64_t>(buf.runs.size());
  buf.scores_t.resize(std::min(padded, kWindow) * kCols);
  buf.scores.resize(group * padded);
  buf.even.resize((num_runs * group + kRows) * kCols);
  buf.odd.resize((num_runs * group + kRows) * kCols);
  std::memset(buf.queries, 0, sizeof buf.queries);
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < d; ++i)
      buf.queries[i / kDepth][i % kDepth / 2][2 * g + i % 2] =
          q[g / rows.group * q_stride + g % rows.group * d + i];
  _tile_loadd(3, buf.queries[0], 64);
  _tile_loadd(4, buf.queries[1], 64);
  if (d == 128) {
    _tile_loadd(5, buf.queries[2], 64);
    _tile_loadd(6, buf.queries[3], 64);
  }
  constexpr int64_t window_runs = kWindow / kRows;  // a window's C tiles are still in L1
  for (int64_t r = 0; r < num_runs; r += window_runs) {
    const int64_t last = std::min(num_runs, r + window_runs);
    if (d == 128) key_scores<4>(k_cache, buf.runs.data(), r, last, num_runs, d, buf.scores_t.data());
    else key_scores<2>(k_cache, buf.runs.data(), r, last, num_runs, d, buf.scores_t.data());
    transpose_scores(buf.scores_t.data(), r * kRows, std::min(len, last * kRows), padded, group,
                     scale, buf.scores.data());
  }
  softmax_rows(rows, padded, buf.scores.data(), buf.even.data(), buf.odd.data());
  weigh_values(v_cache, buf.runs.data(), num_runs, rows, padded, d, buf, out, out_stride);
}

// task(i, kv_head, scratch) for every i < count and KV head, shared among the threads of the
// enclosing OpenMP region, each thread's tiles configured around its share
template <typename Task>
void attention_tasks(int64_t count, int64_t kv_heads, Task&& task) {
  AttentionScratch buf;
  configure();
#pragma omp for collapse(2) schedule(dynamic)
  for (int64_t i = 0; i < count; ++i)
    for (int64_t h = 0; h < kv_heads; ++h) task(i, h, buf);
  _tile_release();
}

}  // namespace qw::amx

#endif
