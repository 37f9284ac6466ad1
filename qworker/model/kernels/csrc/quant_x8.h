// Q4_0, Q4_1, Q5_0 and Q8_0 repacked once at load into groups of 8 rows ("x8"), as compact as the
// file's blocks: for each 32-value block index, the 8 rows' f16 scales side by side (then, for
// Q4_1, their 8 minimums), then their values interleaved so that one 256-bit register holds two
// values of each of the 8 rows in its 32-bit lane r (qworker/model/quant_interleave.py writes and
// reads this layout; the tests check it against gguf's dequantize):
// - Q4_0 / Q4_1, 128 bytes: 4 chunks of 32 bytes, 16-bit word j = 2r + t of chunk c holding in
//   its nibble n (bits 4n..4n+3) row r's value 8c + 2n + t (unsigned 0..15);
// - Q5_0: after the 8 scales, the values' fifth bits (32 bytes: in half h of 16 bytes, byte j
//   bit 4 (c % 2) + n is that of word j, nibble n of chunk c = 2h + c % 2), then the low 4 bits
//   as Q4_0's 128 bytes;
// - Q8_0, 256 bytes: 16 chunks of 16 bytes, byte 2r + t of chunk p row r's value 2p + t.
// So the 16-bit dot is one _mm256_madd_epi16 of 8 rows' pairs against one broadcast activation
// pair, its int32 lane r summing row r without a horizontal reduction, and the scale products
// and float accumulation are one 8-wide vector operation for the 8 rows (not one per row).
// Included by quant_gemm.h (it uses its ActBlock and quantize_row).
#pragma once

namespace qw::quant {

inline bool x8_serves(int type) {
  return type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q8_0;
}

template <int T> struct X8 {  // one group block: 8 rows' block b
  // 8 d (and 8 m) as f16; Q5_0: and the fifth bits
  static constexpr int64_t kScales = T == Q4_1 ? 32 : T == Q5_0 ? 48 : 16;
  static constexpr int64_t kBytes = kScales + (T == Q8_0 ? 256 : 128);
  static constexpr float kZero = T == Q4_0 ? 8.0f : T == Q5_0 ? 16.0f : 0.0f;  // w = d (q - zero)
  static_assert(kBytes == 8 * (T == Q4_0 ? 18 : T == Q4_1 ? 20 : T == Q5_0 ? 22 : 34),
                "as compact as the file");
};

// nibble n of chunk c's 16 words (Q5_0: with its fifth bit from `high`, the bytes of c's half
// widened to 16 bits), as 16 int16 values
template <int T>
inline __m256i x8_nibbles(__m256i v, __m256i high, int c, int n) {
  const __m256i low = _mm256_set1_epi16(0x0F);
  __m256i w = n == 3 ? _mm256_srli_epi16(v, 12)
                     : _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(4 * n)), low);
  if constexpr (T == Q5_0) {  // bit 4 (c % 2) + n of high, moved to bit 4
    const int bit = 4 * (c % 2) + n;
    const __m256i moved = bit >= 4 ? _mm256_srl_epi16(high, _mm_cvtsi32_si128(bit - 4))
                                   : _mm256_sll_epi16(high, _mm_cvtsi32_si128(4 - bit));
    w = _mm256_or_si256(w, _mm256_and_si256(moved, _mm256_set1_epi16(0x10)));
  } else {
    (void)high;
    (void)c;
  }
  return w;
}

template <int T>
inline __m256i x8_high(const uint8_t* g, int c) {  // Q5_0: chunk c's fifth bits, widened
  if constexpr (T != Q5_0) {
    (void)g;
    (void)c;
    return _mm256_setzero_si256();
  } else {
    return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
        g + 16 + 16 * (c / 2))));
  }
}

// An activation row's pairs (values 2p, 2p + 1) broadcast to every lane: from its blocks, or
// (Pre) from a table of them made once per call, 16 x 8 int32 per block, that the madd reads
// as a memory operand (10-17% faster at one row than broadcasting per group)
template <bool Pre> struct Pairs {
  const ActBlock* xb;  // the block
  const int32_t* table;  // Pre: its 16 broadcast pairs
  __m256i of(int p) const {
    if constexpr (Pre) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(table + 8 * p));
    int32_t v;
    std::memcpy(&v, xb->q16 + 2 * p, 4);
    return _mm256_set1_epi32(v);
  }
};

inline void broadcast_pairs(const ActBlock* x, int64_t blocks, int32_t* table) {
  for (int64_t b = 0; b < blocks; ++b)
    for (int p = 0; p < 16; ++p) {
      int32_t v;
      std::memcpy(&v, x[b].q16 + 2 * p, 4);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(table + (b * 16 + p) * 8),
                          _mm256_set1_epi32(v));
    }
}

// isum[r] lane j: the integer dot of group row j's block with activation row r's block
template <int T, int R, bool Pre>
inline void x8_block_isums(const uint8_t* g, const Pairs<Pre> xb[R], __m256i isum[R]) {
  const uint8_t* q = g + X8<T>::kScales;
  for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
  if constexpr (T == Q8_0) {
    for (int p = 0; p < 16; ++p) {
      const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(q + 16 * p)));
      for (int r = 0; r < R; ++r)
        isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(w, xb[r].of(p)));
    }
  } else {
    for (int c = 0; c < 4; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * c));
      const __m256i high = x8_high<T>(g, c);
      for (int n = 0; n < 4; ++n) {
        const __m256i w = x8_nibbles<T>(v, high, c, n);
        for (int r = 0; r < R; ++r)
          isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(w, xb[r].of(4 * c + n)));
      }
    }
  }
}

// out[r * ldo + j] = dot(group row j, activation row r) for the 8 rows of a group and R
// activation rows (`stride` blocks apart; Pre: with their pair tables, as many 16 x 8 int32
// apart); each group block is unpacked once for all R
template <int T, int R, bool Pre>
inline void x8_group_dot(const uint8_t* g, const ActBlock* x, const int32_t* table,
                         int64_t blocks, int64_t stride, float* out, int64_t ldo) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, g += X8<T>::kBytes) {
    Pairs<Pre> xb[R];
    for (int r = 0; r < R; ++r)
      xb[r] = {x + r * stride + b, Pre ? table + (r * stride + b) * 128 : nullptr};
    __m256i isum[R];
    x8_block_isums<T, R, Pre>(g, xb, isum);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g)));
    for (int r = 0; r < R; ++r) {
      const __m256 dot = _mm256_cvtepi32_ps(isum[r]);
      if constexpr (X8<T>::kZero != 0.0f) {  // values q - zero: x.d q.x - zero x.s
        acc[r] = _mm256_fmadd_ps(d, _mm256_fmadd_ps(dot, _mm256_set1_ps(xb[r].xb->d),
                                                    _mm256_set1_ps(-X8<T>::kZero * xb[r].xb->s)),
                                 acc[r]);
      } else {
        acc[r] = _mm256_fmadd_ps(d, _mm256_mul_ps(dot, _mm256_set1_ps(xb[r].xb->d)), acc[r]);
      }
      if constexpr (T == Q4_1) {  // + the minimums times the activation block's sum
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(
            reinterpret_cast<const __m128i*>(g + 16)));
        acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(xb[r].xb->s), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * ldo, acc[r]);
}

template <int T, bool Pre>
inline void team_x8_rows(const ActBlock* xq, const int32_t* table, const uint8_t* w, int64_t m,
                         int64_t n, int64_t k, float* out, int64_t ldo) {
  constexpr int64_t kRows = 4;  // activation rows per pass over a group
  const int64_t blocks = k / 32, group_bytes = blocks * X8<T>::kBytes;
#pragma omp for schedule(static)
  for (int64_t g = 0; g < n / 8; ++g) {
    const uint8_t* group = w + g * group_bytes;
    int64_t i = 0;
    for (; i + kRows <= m; i += kRows)
      x8_group_dot<T, kRows, Pre>(group, xq + i * blocks, table + i * blocks * 128, blocks,
                                  blocks, out + i * ldo + 8 * g, ldo);
    for (; i < m; ++i)
      x8_group_dot<T, 1, Pre>(group, xq + i * blocks, table + i * blocks * 128, blocks, blocks,
                              out + i * ldo + 8 * g, ldo);
  }
}

template <bool Pre>
inline void team_x8_type(int type, const ActBlock* xq, const int32_t* table, const uint8_t* w,
                         int64_t m, int64_t n, int64_t k, float* out, int64_t ldo) {
  switch (type) {
    case Q4_0: return team_x8_rows<Q4_0, Pre>(xq, table, w, m, n, k, out, ldo);
    case Q4_1: return team_x8_rows<Q4_1, Pre>(xq, table, w, m, n, k, out, ldo);
    case Q5_0: return team_x8_rows<Q5_0, Pre>(xq, table, w, m, n, k, out, ldo);
    default: return team_x8_rows<Q8_0, Pre>(xq, table, w, m, n, k, out, ldo);
  }
}

// 16-bit activations (as team_int_gemm<true>) against x8 weights
inline void team_x8_gemm(int type, const float* x, int64_t m, int64_t k, const uint8_t* w,
                         int64_t n, float* out, int64_t ldo, ActBlock* shared) {
  const int64_t blocks = k / 32;
  if (m <= kPrivateRows) {  // each thread its own rows (no barrier); below 4 rows, whose passes
    // go a row at a time, their pair tables too (from 4 rows the tables cost more than they save)
    thread_local std::vector<ActBlock> mine;
    thread_local std::vector<int32_t> table;
    const bool pre = m < 4;
    mine.resize(static_cast<size_t>(m * blocks));
    table.resize(static_cast<size_t>(pre ? m * blocks * 128 : 0));
    for (int64_t i = 0; i < m; ++i) {
      quantize_row<true>(x + i * k, k, mine.data() + i * blocks);
      if (pre) broadcast_pairs(mine.data() + i * blocks, blocks, table.data() + i * blocks * 128);
    }
    if (pre) return team_x8_type<true>(type, mine.data(), table.data(), w, m, n, k, out, ldo);
    return team_x8_type<false>(type, mine.data(), nullptr, w, m, n, k, out, ldo);
  }
#pragma omp for schedule(static)
  for (int64_t i = 0; i < m; ++i) quantize_row<true>(x + i * k, k, shared + i * blocks);
  team_x8_type<false>(type, shared, nullptr, w, m, n, k, out, ldo);
}

// a group block's 8 rows as floats into a panel of the float32 GEMM's layout ([32][16] from
// `to`: value v of row j at v * 16 + j)
template <int T>
inline void x8_block_floats(const uint8_t* g, float* to) {
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g)));
  const __m256 m = T == Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128(
                                   reinterpret_cast<const __m128i*>(g + 16)))
                             : _mm256_mul_ps(d, _mm256_set1_ps(-X8<T>::kZero));
  const uint8_t* q = g + X8<T>::kScales;
  auto store = [&](__m256i pairs, int v) {  // lane r: row r's values v (low 16 bits), v + 1
    const __m256i even = T == Q8_0 ? _mm256_srai_epi32(_mm256_slli_epi32(pairs, 16), 16)
                                   : _mm256_and_si256(pairs, _mm256_set1_epi32(0xFFFF));
    const __m256i odd = T == Q8_0 ? _mm256_srai_epi32(pairs, 16) : _mm256_srli_epi32(pairs, 16);
    _mm256_storeu_ps(to + v * 16, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(even), m));
    _mm256_storeu_ps(to + (v + 1) * 16, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(odd), m));
  };
  if constexpr (T == Q8_0) {
    for (int p = 0; p < 16; ++p)
      store(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * p))),
            2 * p);
  } else {
    for (int c = 0; c < 4; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * c));
      const __m256i high = x8_high<T>(g, c);
      for (int n = 0; n < 4; ++n) store(x8_nibbles<T>(v, high, c, n), 8 * c + 2 * n);
    }
  }
}

// the weights dequantized to float32 16 rows (two groups) at a time into a panel that the
// float32 GEMM's register tiles multiply with every activation row (n % 16 == 0)
template <int T>
inline void team_x8_dequant_rows(const float* x, int64_t m, int64_t k, const uint8_t* w,
                                 int64_t n, float* out, int64_t ldo) {
  const int64_t blocks = k / 32, group_bytes = blocks * X8<T>::kBytes;
  thread_local std::vector<float> panel;
  panel.resize(static_cast<size_t>(k * 16));
#pragma omp for schedule(static)
  for (int64_t p = 0; p < n / 16; ++p) {
    for (int h = 0; h < 2; ++h) {
      const uint8_t* g = w + (2 * p + h) * group_bytes;
      for (int64_t b = 0; b < blocks; ++b)
        x8_block_floats<T>(g + b * X8<T>::kBytes, panel.data() + b * 32 * 16 + 8 * h);
    }
    panel_gemm(x, panel.data(), out + 16 * p, m, k, ldo);
  }
}

inline void team_x8_dequant(int type, const float* x, int64_t m, int64_t k, const uint8_t* w,
                            int64_t n, float* out, int64_t ldo) {
  switch (type) {
    case Q4_0: return team_x8_dequant_rows<Q4_0>(x, m, k, w, n, out, ldo);
    case Q4_1: return team_x8_dequant_rows<Q4_1>(x, m, k, w, n, out, ldo);
    case Q5_0: return team_x8_dequant_rows<Q5_0>(x, m, k, w, n, out, ldo);
    default: return team_x8_dequant_rows<Q8_0>(x, m, k, w, n, out, ldo);
  }
}

// row `row` of an x8 weight, dequantized (a tied embedding's lookup): out [k]
inline void x8_dequant_row(int type, const uint8_t* w, int64_t row, int64_t k, float* out) {
  const int64_t elems_bytes = format(type).bytes * 8;  // one group block
  const uint8_t* g = w + (row / 8) * (k / 32) * elems_bytes;
  const int r = static_cast<int>(row % 8);
  const int64_t scales = type == Q4_1 ? 32 : type == Q5_0 ? 48 : 16;
  for (int64_t b = 0; b < k / 32; ++b, g += elems_bytes) {
    const float d = half(g + 2 * r), m = type == Q4_1 ? half(g + 16 + 2 * r) : 0.0f;
    const uint8_t* q = g + scales;
    for (int v = 0; v < 32; ++v) {
      int value;
      if (type == Q8_0) {
        value = static_cast<int8_t>(q[16 * (v / 2) + 2 * r + v % 2]);
      } else {  // chunk v / 8, word 2r + t (t = v % 2), nibble (v % 8) / 2
        const int c = v / 8, t = v % 2, nibble = (v % 8) / 2, j = 2 * r + t;
        const uint8_t byte = q[32 * c + 2 * j + nibble / 2];
        value = (nibble % 2) ? byte >> 4 : byte & 0xF;
        if (type == Q5_0) value |= ((g[16 + 16 * (c / 2) + j] >> (4 * (c % 2) + nibble)) & 1) << 4;
        value -= type == Q4_0 ? 8 : type == Q5_0 ? 16 : 0;
      }
      out[b * 32 + v] = d * static_cast<float>(value) + m;
    }
  }
}

}  // namespace qw::quant
