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
// - Q8_0, 256 bytes: 16 chunks of 16 bytes, byte 2r + t of chunk p row r's value 2p + t;
// - Q4_K, 1,152 bytes a 256-value block: 8 d, 8 dmin (f16); for sub-block s (32 values), byte
//   32 + 8s + r row r's 6-bit scale | (the low 2 bits of its 6-bit minimum) << 6, byte
//   96 + 4s + r % 4 in nibble r / 4 the minimum's high 4 bits; then each sub-block's values as
//   Q4_0's 128 bytes (w = d scale q - dmin minimum);
// - Q6_K, 1,680 bytes a 256-value block: 8 d (f16); for sub-block s, 16 bytes at 16 + 16s: the
//   8 rows' int8 scales of its values 0-15, then of 16-31; then each sub-block's 192 bytes: the
//   values' low 4 bits as Q4_0's 128 bytes, then their high 2 bits, 16 bytes a chunk c, byte
//   2r + t holding at bits 2n, 2n + 1 those of nibble n of word 2r + t (w = d scale (q - 32)).
// So the 16-bit dot is one _mm256_madd_epi16 of 8 rows' pairs against one broadcast activation
// pair, its int32 lane r summing row r without a horizontal reduction, and the scale products
// and float accumulation are one 8-wide vector operation for the 8 rows (not one per row).
// Included by quant_gemm.h (it uses its ActBlock and quantize_row).
#pragma once

namespace qw::quant {

inline bool x8_serves(int type) {
  return type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q8_0 || type == Q4_K ||
         type == Q6_K;
}

inline bool x8_k_quant(int type) { return type == Q4_K || type == Q6_K; }

template <int T> struct X8K {  // one group block of a K-quant: 8 rows' 256-value block
  static constexpr int64_t kHead = T == Q4_K ? 128 : 144;  // bytes before the first sub-block's
  static constexpr int64_t kSub = T == Q4_K ? 128 : 192;  // a sub-block's value bytes
  static constexpr int64_t kBytes = kHead + 8 * kSub;
  static_assert(kBytes == 8 * (T == Q4_K ? 144 : 210), "as compact as the file");
};

template <int T> struct X8 {  // one group block: 8 rows' block b
  // 8 d (and 8 m) as f16; Q5_0: and the fifth bits
  static constexpr int64_t kScales = T == Q4_1 ? 32 : T == Q5_0 ? 48 : 16;
  static constexpr int64_t kBytes = kScales + (T == Q8_0 ? 256 : 128);
  static constexpr float kZero = T == Q4_0 ? 8.0f : T == Q5_0 ? 16.0f : 0.0f;  // w = d (q - zero)
  static_assert(kBytes == 8 * (T == Q4_0 ? 18 : T == Q4_1 ? 20 : T == Q5_0 ? 22 : 34),
                "as compact as the file");
};

// bytes of one group's blocks over k = 32 * blocks values
template <int T> constexpr int64_t x8_group_bytes(int64_t blocks) {
  if constexpr (T == Q4_K || T == Q6_K) return blocks / 8 * X8K<T>::kBytes;
  else return blocks * X8<T>::kBytes;
}

// f(std::integral_constant<int, T>{}) for the x8 format T of `type`
template <typename F>
inline void by_x8_type(int type, F&& f) {
  switch (type) {
    case Q4_0: return f(std::integral_constant<int, Q4_0>{});
    case Q4_1: return f(std::integral_constant<int, Q4_1>{});
    case Q5_0: return f(std::integral_constant<int, Q5_0>{});
    case Q4_K: return f(std::integral_constant<int, Q4_K>{});
    case Q6_K: return f(std::integral_constant<int, Q6_K>{});
    default: return f(std::integral_constant<int, Q8_0>{});
  }
}

// One row of activations makes these kernels a stream over the weights, and the hardware
// prefetchers alone leave it at about half of what DRAM gives (AMD Zen 5, 2 threads: 20-26 GB/s
// of weights against 35-40 for a plain read). So each step of a stream also asks for the bytes
// kPrefetchAhead past the ones it reads (the weights' whole span, block heads included). The
// 1.5B Qwen2 Q4_K_M file's matmuls at one row, medians of 5 runs: 30.5, 29.7, 31.4 and 31.5
// ms with 1152, 2304, 3456 and 4608 bytes ahead; 38-40 ms with none.
constexpr int64_t kPrefetchAhead = 2304;

inline void prefetch_weights(const uint8_t* from, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(from + kPrefetchAhead + line), _MM_HINT_T0);
}

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
        isum[r] = dot_add(isum[r], w, xb[r].of(p));
    }
  } else {
    for (int c = 0; c < 4; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * c));
      const __m256i high = x8_high<T>(g, c);
      for (int n = 0; n < 4; ++n) {
        const __m256i w = x8_nibbles<T>(v, high, c, n);
        for (int r = 0; r < R; ++r)
          isum[r] = dot_add(isum[r], w, xb[r].of(4 * c + n));
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
    prefetch_weights(g, X8<T>::kBytes);
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

// Q4_K: sub-block s's 8 rows' scales times d and minimums times dmin
inline void x8_q4k_scales(const uint8_t* g, int s, __m256 d, __m256 dmin, __m256* scale,
                          __m256* minimum) {
  int64_t low;
  uint32_t rest;
  std::memcpy(&low, g + 32 + 8 * s, 8);
  std::memcpy(&rest, g + 96 + 4 * s, 4);
  const __m256i a = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(low));
  const uint64_t both = static_cast<uint64_t>(rest) | (static_cast<uint64_t>(rest) << 32);
  __m256i b = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(both)));
  b = _mm256_and_si256(_mm256_srlv_epi32(b, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
                       _mm256_set1_epi32(0xF));  // lanes 4-7: the high nibbles
  const __m256i sc = _mm256_and_si256(a, _mm256_set1_epi32(63));
  const __m256i mn = _mm256_or_si256(_mm256_srli_epi32(a, 6), _mm256_slli_epi32(b, 2));
  *scale = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
  *minimum = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(mn));
}

// Q6_K: sub-block s's 8 rows' scales of its values 0-15 (half 0) or 16-31 (half 1), times d
inline __m256 x8_q6k_scale(const uint8_t* g, int s, int half, __m256 d) {
  int64_t sc;
  std::memcpy(&sc, g + 16 + 16 * s + 8 * half, 8);
  return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(sc))));
}

// a K-quant sub-block's chunk c, nibble n: 16 int16 values (Q6_K: q - 32, from its high bits)
template <int T>
inline __m256i x8k_values(const uint8_t* q, __m256i v, int c, int n) {
  __m256i w = x8_nibbles<Q4_0>(v, v, c, n);
  if constexpr (T == Q6_K) {
    const __m256i h = _mm256_cvtepu8_epi16(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(q + 128 + 16 * c)));
    const __m256i high = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * n)),
                                          _mm256_set1_epi16(3));
    w = _mm256_sub_epi16(_mm256_or_si256(w, _mm256_slli_epi16(high, 4)), _mm256_set1_epi16(32));
  }
  return w;
}

// x8_group_dot for a K-quant: each 32-value sub-block's integer dots (Q6_K: of its two halves,
// whose scales differ) scaled per row in float
template <int T, int R, bool Pre>
inline void x8k_group_dot(const uint8_t* g, const ActBlock* x, const int32_t* table,
                          int64_t blocks, int64_t stride, float* out, int64_t ldo) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t kb = 0; kb < blocks / 8; ++kb, g += X8K<T>::kBytes) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g)));
    const __m256 dmin = T == Q4_K ? _mm256_cvtph_ps(_mm_loadu_si128(
                                        reinterpret_cast<const __m128i*>(g + 16)))
                                  : _mm256_setzero_ps();
    for (int s = 0; s < 8; ++s) {
      const int64_t b = 8 * kb + s;
      const uint8_t* q = g + X8K<T>::kHead + s * X8K<T>::kSub;
      prefetch_weights(g + s * X8K<T>::kBytes / 8, X8K<T>::kBytes / 8);
      Pairs<Pre> xb[R];
      for (int r = 0; r < R; ++r)
        xb[r] = {x + r * stride + b, Pre ? table + (r * stride + b) * 128 : nullptr};
      __m256i isum[2][R];  // values 0-15, 16-31
      for (int h = 0; h < 2; ++h)
        for (int r = 0; r < R; ++r) isum[h][r] = _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * c));
        for (int n = 0; n < 4; ++n) {
          const __m256i w = x8k_values<T>(q, v, c, n);
          for (int r = 0; r < R; ++r)
            isum[c / 2][r] = dot_add(isum[c / 2][r], w, xb[r].of(4 * c + n));
        }
      }
      if constexpr (T == Q4_K) {
        __m256 scale, minimum;
        x8_q4k_scales(g, s, d, dmin, &scale, &minimum);
        for (int r = 0; r < R; ++r) {
          const __m256 dot = _mm256_cvtepi32_ps(_mm256_add_epi32(isum[0][r], isum[1][r]));
          acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(scale, _mm256_set1_ps(xb[r].xb->d)), dot, acc[r]);
          acc[r] = _mm256_fnmadd_ps(minimum, _mm256_set1_ps(xb[r].xb->s), acc[r]);
        }
      } else {
        const __m256 low = x8_q6k_scale(g, s, 0, d), high = x8_q6k_scale(g, s, 1, d);
        for (int r = 0; r < R; ++r) {
          const __m256 dot = _mm256_fmadd_ps(low, _mm256_cvtepi32_ps(isum[0][r]),
                                             _mm256_mul_ps(high, _mm256_cvtepi32_ps(isum[1][r])));
          acc[r] = _mm256_fmadd_ps(dot, _mm256_set1_ps(xb[r].xb->d), acc[r]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * ldo, acc[r]);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
// ---- the K-quants' int16 dot on two groups at once (16 weight rows) in 512-bit registers:
// group 0 in the low 256 bits of each, group 1 in the high; the activation pair broadcast to
// both. The same sums and products as x8k_group_dot, each in its own lane.

inline __m512i pair_of(const uint8_t* a, const uint8_t* b) {  // 32 bytes at a, then at b
  return _mm512_inserti64x4(_mm512_castsi256_si512(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
}

inline __m512 halves_of(const uint8_t* a, const uint8_t* b) {  // 8 f16 at a, 8 at b: 16 floats
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1));
}

inline __m512 joined(__m256 low, __m256 high) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(low), high, 1);
}

inline __m512i bytes_as_16_int32(int64_t a, int64_t b) {  // 8 bytes, then 8 more, widened
  return _mm512_cvtepu8_epi32(_mm_set_epi64x(b, a));
}

// x8_q4k_scales for the 16 rows of two groups at once (d, dmin: both groups' 8 each)
inline void x8_q4k_scales2(const uint8_t* g0, const uint8_t* g1, int s, __m512 d, __m512 dmin,
                           __m512* scale, __m512* minimum) {
  int64_t low0, low1;
  uint32_t rest0, rest1;
  std::memcpy(&low0, g0 + 32 + 8 * s, 8);
  std::memcpy(&low1, g1 + 32 + 8 * s, 8);
  std::memcpy(&rest0, g0 + 96 + 4 * s, 4);
  std::memcpy(&rest1, g1 + 96 + 4 * s, 4);
  const __m512i a = bytes_as_16_int32(low0, low1);
  auto twice = [](uint32_t r) { return static_cast<int64_t>(r | (static_cast<uint64_t>(r) << 32)); };
  __m512i b = bytes_as_16_int32(twice(rest0), twice(rest1));
  b = _mm512_and_si512(_mm512_srlv_epi32(b, _mm512_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4, 0, 0, 0,
                                                              0, 4, 4, 4, 4)),
                       _mm512_set1_epi32(0xF));  // lanes 4-7 of each group: the high nibbles
  const __m512i sc = _mm512_and_si512(a, _mm512_set1_epi32(63));
  const __m512i mn = _mm512_or_si512(_mm512_srli_epi32(a, 6), _mm512_slli_epi32(b, 2));
  *scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
  *minimum = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mn));
}

// x8_q6k_scale for the 16 rows of two groups at once (d: both groups' 8)
inline __m512 x8_q6k_scale2(const uint8_t* g0, const uint8_t* g1, int s, int half, __m512 d) {
  int64_t sc0, sc1;
  std::memcpy(&sc0, g0 + 16 + 16 * s + 8 * half, 8);
  std::memcpy(&sc1, g1 + 16 + 16 * s + 8 * half, 8);
  return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_set_epi64x(sc1, sc0))));
}

inline __m512i dot_add512(__m512i isum, __m512i w, __m512i x) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(isum, w, x);
#else
  return _mm512_add_epi32(isum, _mm512_madd_epi16(w, x));
#endif
}

// Q6_K: chunk c's high bits of both groups' sub-block (q0, q1: its value bytes), widened to 16
// bits (read once for the chunk's four nibbles); nothing for Q4_K
template <int T>
inline __m512i x8k_high2(const uint8_t* q0, const uint8_t* q1, int c) {
  if constexpr (T != Q6_K) {
    (void)q0, (void)q1, (void)c;
    return _mm512_setzero_si512();
  } else {
    return _mm512_cvtepu8_epi16(_mm256_inserti128_si256(_mm256_castsi128_si256(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(q0 + 128 + 16 * c))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(q1 + 128 + 16 * c)), 1));
  }
}

// chunk c's nibble n of both groups' sub-block (v: its 64 value bytes; h: x8k_high2), as 32
// int16 (Q6_K: q - 32, with the high bits)
template <int T>
inline __m512i x8k_nibble2(__m512i v, __m512i h, int n) {
  __m512i w = n == 3 ? _mm512_srli_epi16(v, 12)
                     : _mm512_and_si512(_mm512_srl_epi16(v, _mm_cvtsi32_si128(4 * n)),
                                        _mm512_set1_epi16(0x0F));
  if constexpr (T == Q6_K) {
    const __m512i high = _mm512_and_si512(_mm512_srl_epi16(h, _mm_cvtsi32_si128(2 * n)),
                                          _mm512_set1_epi16(3));
    w = _mm512_sub_epi16(_mm512_or_si512(w, _mm512_slli_epi16(high, 4)), _mm512_set1_epi16(32));
  } else {
    (void)h;
  }
  return w;
}

template <int T>
inline __m512i x8k_values2(const uint8_t* q0, const uint8_t* q1, __m512i v, int c, int n) {
  return x8k_nibble2<T>(v, x8k_high2<T>(q0, q1, c), n);
}

// out[r * ldo + j] for the 16 rows of groups g0, g1 (consecutive) and R activation rows
template <int T, int R>
inline void x8k_pair_dot(const uint8_t* g0, const uint8_t* g1, const ActBlock* x,
                         int64_t blocks, int64_t stride, float* out, int64_t ldo) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < blocks / 8; ++kb, g0 += X8K<T>::kBytes, g1 += X8K<T>::kBytes) {
    const __m512 d = halves_of(g0, g1);
    const __m512 dmin = T == Q4_K ? halves_of(g0 + 16, g1 + 16) : _mm512_setzero_ps();
    for (int s = 0; s < 8; ++s) {
      const int64_t b = 8 * kb + s;
      const uint8_t* q0 = g0 + X8K<T>::kHead + s * X8K<T>::kSub;
      const uint8_t* q1 = g1 + X8K<T>::kHead + s * X8K<T>::kSub;
      prefetch_weights(g0 + s * X8K<T>::kBytes / 8, X8K<T>::kBytes / 8);
      prefetch_weights(g1 + s * X8K<T>::kBytes / 8, X8K<T>::kBytes / 8);
      __m512i isum[2][R];
      for (int h = 0; h < 2; ++h)
        for (int r = 0; r < R; ++r) isum[h][r] = _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) {
        const __m512i v = pair_of(q0 + 32 * c, q1 + 32 * c);
        for (int n = 0; n < 4; ++n) {
          const __m512i w = x8k_values2<T>(q0, q1, v, c, n);
          for (int r = 0; r < R; ++r) {
            int32_t pair;
            std::memcpy(&pair, x[r * stride + b].q16 + 2 * (4 * c + n), 4);
            isum[c / 2][r] = dot_add512(isum[c / 2][r], w, _mm512_set1_epi32(pair));
          }
        }
      }
      if constexpr (T == Q4_K) {
        __m512 scale, minimum;
        x8_q4k_scales2(g0, g1, s, d, dmin, &scale, &minimum);
        for (int r = 0; r < R; ++r) {
          const ActBlock& xb = x[r * stride + b];
          const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(isum[0][r], isum[1][r]));
          acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(scale, _mm512_set1_ps(xb.d)), dot, acc[r]);
          acc[r] = _mm512_fnmadd_ps(minimum, _mm512_set1_ps(xb.s), acc[r]);
        }
      } else {
        const __m512 low = x8_q6k_scale2(g0, g1, s, 0, d);
        const __m512 high = x8_q6k_scale2(g0, g1, s, 1, d);
        for (int r = 0; r < R; ++r) {
          const __m512 dot = _mm512_fmadd_ps(low, _mm512_cvtepi32_ps(isum[0][r]),
                                             _mm512_mul_ps(high, _mm512_cvtepi32_ps(isum[1][r])));
          acc[r] = _mm512_fmadd_ps(dot, _mm512_set1_ps(x[r * stride + b].d), acc[r]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * ldo, acc[r]);
}

// team_x8_rows for a K-quant, two groups at a time
template <int T>
inline void team_x8k_pairs(const ActBlock* xq, const uint8_t* w, int64_t m, int64_t n,
                           int64_t k, float* out, int64_t ldo) {
  constexpr int64_t kRows = 4;
  const int64_t blocks = k / 32, group_bytes = x8_group_bytes<T>(blocks);
#pragma omp for schedule(static)
  for (int64_t g = 0; g < n / 16; ++g) {
    const uint8_t* g0 = w + 2 * g * group_bytes;
    int64_t i = 0;
    for (; i + kRows <= m; i += kRows)
      x8k_pair_dot<T, kRows>(g0, g0 + group_bytes, xq + i * blocks, blocks, blocks,
                             out + i * ldo + 16 * g, ldo);
    for (; i < m; ++i)
      x8k_pair_dot<T, 1>(g0, g0 + group_bytes, xq + i * blocks, blocks, blocks,
                         out + i * ldo + 16 * g, ldo);
  }
}
#endif

template <int T, int R, bool Pre>
inline void x8_any_group_dot(const uint8_t* g, const ActBlock* x, const int32_t* table,
                             int64_t blocks, int64_t stride, float* out, int64_t ldo) {
  if constexpr (T == Q4_K || T == Q6_K)
    x8k_group_dot<T, R, Pre>(g, x, table, blocks, stride, out, ldo);
  else
    x8_group_dot<T, R, Pre>(g, x, table, blocks, stride, out, ldo);
}

template <int T, bool Pre>
inline void team_x8_rows(const ActBlock* xq, const int32_t* table, const uint8_t* w, int64_t m,
                         int64_t n, int64_t k, float* out, int64_t ldo) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
  if constexpr (T == Q4_K || T == Q6_K) {  // x8 weights come in whole 16-row pairs of groups
    (void)table;
    return team_x8k_pairs<T>(xq, w, m, n, k, out, ldo);
  }
#endif
  constexpr int64_t kRows = 4;  // activation rows per pass over a group
  const int64_t blocks = k / 32, group_bytes = x8_group_bytes<T>(blocks);
#pragma omp for schedule(static)
  for (int64_t g = 0; g < n / 8; ++g) {
    const uint8_t* group = w + g * group_bytes;
    int64_t i = 0;
    for (; i + kRows <= m; i += kRows)
      x8_any_group_dot<T, kRows, Pre>(group, xq + i * blocks, table + i * blocks * 128, blocks,
                                      blocks, out + i * ldo + 8 * g, ldo);
    for (; i < m; ++i)
      x8_any_group_dot<T, 1, Pre>(group, xq + i * blocks, table + i * blocks * 128, blocks,
                                  blocks, out + i * ldo + 8 * g, ldo);
  }
}

template <bool Pre>
inline void team_x8_type(int type, const ActBlock* xq, const int32_t* table, const uint8_t* w,
                         int64_t m, int64_t n, int64_t k, float* out, int64_t ldo) {
  by_x8_type(type, [&](auto t) {
    team_x8_rows<decltype(t)::value, Pre>(xq, table, w, m, n, k, out, ldo);
  });
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
    grow(mine, static_cast<size_t>(m * blocks));
    grow(table, static_cast<size_t>(pre ? m * blocks * 128 : 0));
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

// a K-quant group block's sub-block s, its 8 rows as floats into a panel as x8_block_floats
template <int T>
inline void x8k_block_floats(const uint8_t* g, int s, float* to) {
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g)));
  __m256 scale[2], offset[2];
  if constexpr (T == Q4_K) {
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(g + 16)));
    x8_q4k_scales(g, s, d, dmin, &scale[0], &offset[0]);
    scale[1] = scale[0];
    offset[0] = offset[1] = _mm256_sub_ps(_mm256_setzero_ps(), offset[0]);
  } else {
    scale[0] = x8_q6k_scale(g, s, 0, d);
    scale[1] = x8_q6k_scale(g, s, 1, d);
    offset[0] = offset[1] = _mm256_setzero_ps();
  }
  const uint8_t* q = g + X8K<T>::kHead + s * X8K<T>::kSub;
  for (int c = 0; c < 4; ++c) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * c));
    for (int n = 0; n < 4; ++n) {  // lane r: row r's values 8c + 2n (low 16 bits), + 1
      const __m256i pairs = x8k_values<T>(q, v, c, n);
      const __m256i even = _mm256_srai_epi32(_mm256_slli_epi32(pairs, 16), 16);
      const __m256i odd = _mm256_srai_epi32(pairs, 16);
      const int at = 8 * c + 2 * n;
      _mm256_storeu_ps(to + at * 16, _mm256_fmadd_ps(scale[c / 2], _mm256_cvtepi32_ps(even),
                                                     offset[c / 2]));
      _mm256_storeu_ps(to + (at + 1) * 16, _mm256_fmadd_ps(scale[c / 2], _mm256_cvtepi32_ps(odd),
                                                           offset[c / 2]));
    }
  }
}

// 16 weight rows from row 16 p (two groups) dequantized to float32 into a panel of the float32
// GEMM's layout ([k][16])
template <int T>
inline void x8_float_panel(const uint8_t* w, int64_t p, int64_t k, float* panel) {
  const int64_t blocks = k / 32, group_bytes = x8_group_bytes<T>(blocks);
  for (int h = 0; h < 2; ++h) {
    const uint8_t* g = w + (2 * p + h) * group_bytes;
    for (int64_t b = 0; b < blocks; ++b) {
      float* to = panel + b * 32 * 16 + 8 * h;
      if constexpr (T == Q4_K || T == Q6_K)
        x8k_block_floats<T>(g + (b / 8) * X8K<T>::kBytes, static_cast<int>(b % 8), to);
      else
        x8_block_floats<T>(g + b * X8<T>::kBytes, to);
    }
  }
}

// the weights dequantized 16 rows at a time into a panel (in L2) that the float32 GEMM's
// register tiles multiply with every activation row (n % 16 == 0)
template <int T>
inline void team_x8_dequant_rows(const float* x, int64_t m, int64_t k, const uint8_t* w,
                                 int64_t n, float* out, int64_t ldo) {
  thread_local std::vector<float> panel;
  grow(panel, static_cast<size_t>(k * 16));
#pragma omp for schedule(static)
  for (int64_t p = 0; p < n / 16; ++p) {
    x8_float_panel<T>(w, p, k, panel.data());
    panel_gemm(x, panel.data(), out + 16 * p, m, k, ldo);
  }
}

inline void team_x8_dequant(int type, const float* x, int64_t m, int64_t k, const uint8_t* w,
                            int64_t n, float* out, int64_t ldo) {
  by_x8_type(type, [&](auto t) {
    team_x8_dequant_rows<decltype(t)::value>(x, m, k, w, n, out, ldo);
  });
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
// ---- "bf16x8": many activation rows in bfloat16 against the weights dequantized 16 rows at a
// time into a bfloat16 panel of the dense GEMM's layout ([k/2][16][2], gemm.h), which its
// AVX512-BF16 register tiles multiply with every row, accumulating in float: the arithmetic of
// the same file expanded to bfloat16 (each weight rounded to bfloat16 once), at the dense GEMM's
// speed where many rows share each panel, from the blocks' bytes.

// floats 16 rows' values v (even) and v + 1 (odd) as their [16][2] bfloat16 pairs at `to`
inline void store_bf16_pairs(__m512 even, __m512 odd, bf16* to) {
  alignas(64) static constexpr int16_t kOrder[32] = {  // word 2j: value v of row j, 2j + 1: v + 1
      0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512bh both = _mm512_cvtne2ps_pbh(odd, even);  // even's 16 low, odd's 16 high
  _mm512_storeu_si512(to, _mm512_permutexvar_epi16(_mm512_load_si512(kOrder),
                                                   reinterpret_cast<const __m512i&>(both)));
}

// the float panel ([k][16], as team_x8_dequant_rows fills it) as bfloat16 pairs [k/2][16][2]
inline void bf16_pairs(const float* panel, int64_t k, bf16* to) {
  for (int64_t v = 0; v < k; v += 2)
    store_bf16_pairs(_mm512_loadu_ps(panel + v * 16), _mm512_loadu_ps(panel + (v + 1) * 16),
                     to + v * 16);
}

// a K-quant's two consecutive groups (16 rows) straight into a bfloat16 panel: their values
// come as 16 rows' pairs (x8k_values2), scaled in float and rounded, with no float panel
template <int T>
inline void x8k_bf16_panel(const uint8_t* g0, const uint8_t* g1, int64_t k, bf16* to) {
  for (int64_t kb = 0; kb < k / 256; ++kb, g0 += X8K<T>::kBytes, g1 += X8K<T>::kBytes) {
    const __m512 d = halves_of(g0, g1);
    const __m512 dmin = T == Q4_K ? halves_of(g0 + 16, g1 + 16) : _mm512_setzero_ps();
    for (int s = 0; s < 8; ++s) {
      const uint8_t* q0 = g0 + X8K<T>::kHead + s * X8K<T>::kSub;
      const uint8_t* q1 = g1 + X8K<T>::kHead + s * X8K<T>::kSub;
      __m512 scale[2], offset;
      if constexpr (T == Q4_K) {
        __m512 minimum;
        x8_q4k_scales2(g0, g1, s, d, dmin, &scale[0], &minimum);
        scale[1] = scale[0];
        offset = _mm512_sub_ps(_mm512_setzero_ps(), minimum);
      } else {
        scale[0] = x8_q6k_scale2(g0, g1, s, 0, d);
        scale[1] = x8_q6k_scale2(g0, g1, s, 1, d);
        offset = _mm512_setzero_ps();
      }
      bf16* at = to + (kb * 256 + s * 32) * 16;
      for (int c = 0; c < 4; ++c) {
        const __m512i v = pair_of(q0 + 32 * c, q1 + 32 * c), h = x8k_high2<T>(q0, q1, c);
        for (int n = 0; n < 4; ++n) {  // lane j: row j's values 8c + 2n (low 16 bits), + 1
          const __m512i pairs = x8k_nibble2<T>(v, h, n);
          const __m512 even =
              _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(pairs, 16), 16));
          const __m512 odd = _mm512_cvtepi32_ps(_mm512_srai_epi32(pairs, 16));
          store_bf16_pairs(_mm512_fmadd_ps(scale[c / 2], even, offset),
                           _mm512_fmadd_ps(scale[c / 2], odd, offset), at + (8 * c + 2 * n) * 16);
        }
      }
    }
  }
}

// 16 weight rows from row 16 p (two groups) as a bfloat16 panel (the 32-value formats through
// the float panel)
template <int T>
inline void x8_bf16_panel(const uint8_t* w, int64_t p, int64_t k, float* panel, bf16* to) {
  if constexpr (T == Q4_K || T == Q6_K) {
    const int64_t group_bytes = x8_group_bytes<T>(k / 32);
    (void)panel;
    x8k_bf16_panel<T>(w + 2 * p * group_bytes, w + (2 * p + 1) * group_bytes, k, to);
  } else {
    x8_float_panel<T>(w, p, k, panel);
    bf16_pairs(panel, k, to);
  }
}

// 48 weight rows a panel (the dense GEMM's 3-block register tile: a broadcast activation pair
// feeds three multiplies), the last one 16 or 32 where n % 48 leaves them
template <int T>
inline void team_x8_bf16_rows(const float* x, int64_t m, int64_t k, const uint8_t* w, int64_t n,
                              float* out, int64_t ldo) {
  thread_local std::vector<float> panel;  // the 32-value formats' float panel
  thread_local std::vector<bf16> pairs, xb;
  if constexpr (T != Q4_K && T != Q6_K) grow(panel, static_cast<size_t>(k * 16));
  grow(pairs, static_cast<size_t>(k * 48));
  grow(xb, static_cast<size_t>(m * k));  // each thread its own copy: m k roundings, no barrier
  for (int64_t i = 0; i < m * k; i += 16) {
    const __mmask16 lanes = first_lanes(m * k - i);
    const __m256bh v = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(lanes, x + i));
    _mm256_mask_storeu_epi16(xb.data() + i, lanes, reinterpret_cast<const __m256i&>(v));
  }
#pragma omp for schedule(static)
  for (int64_t p = 0; p < (n + 47) / 48; ++p) {
    const int blocks = static_cast<int>(std::min<int64_t>(3, n / 16 - 3 * p));
    for (int j = 0; j < blocks; ++j)
      x8_bf16_panel<T>(w, 3 * p + j, k, panel.data(), pairs.data() + j * k * 16);
    const bf16 *a = xb.data(), *b = pairs.data();
    float* to = out + 48 * p;
    if (blocks == 3) qw::gemm_columns<bf16, 3, float>(a, b, nullptr, to, m, k, ldo, 0);
    else if (blocks == 2) qw::gemm_columns<bf16, 2, float>(a, b, nullptr, to, m, k, ldo, 0);
    else qw::gemm_columns<bf16, 1, float>(a, b, nullptr, to, m, k, ldo, 0);
  }
}

inline void team_x8_bf16(int type, const float* x, int64_t m, int64_t k, const uint8_t* w,
                         int64_t n, float* out, int64_t ldo) {
  by_x8_type(type, [&](auto t) {
    team_x8_bf16_rows<decltype(t)::value>(x, m, k, w, n, out, ldo);
  });
}
#endif

// row `row` of a K-quant x8 weight, dequantized: out [k]
inline void x8k_dequant_row(int type, const uint8_t* w, int64_t row, int64_t k, float* out) {
  const int64_t bytes = format(type).bytes * 8;  // one group block
  const uint8_t* g = w + (row / 8) * (k / 256) * bytes;
  const int r = static_cast<int>(row % 8);
  const int64_t head = type == Q4_K ? 128 : 144, sub = type == Q4_K ? 128 : 192;
  for (int64_t kb = 0; kb < k / 256; ++kb, g += bytes) {
    const float d = half(g + 2 * r), dmin = type == Q4_K ? half(g + 16 + 2 * r) : 0.0f;
    for (int s = 0; s < 8; ++s) {
      const uint8_t* q = g + head + s * sub;
      float scale[2], offset = 0.0f;
      if (type == Q4_K) {
        const int a = g[32 + 8 * s + r], rest = (g[96 + 4 * s + r % 4] >> (4 * (r / 4))) & 0xF;
        scale[0] = scale[1] = d * static_cast<float>(a & 63);
        offset = -dmin * static_cast<float>((a >> 6) | (rest << 2));
      } else {
        for (int h = 0; h < 2; ++h)
          scale[h] = d * static_cast<float>(static_cast<int8_t>(g[16 + 16 * s + 8 * h + r]));
      }
      for (int v = 0; v < 32; ++v) {  // chunk v / 8, word 2r + t (t = v % 2), nibble (v % 8) / 2
        const int c = v / 8, nibble = (v % 8) / 2, j = 2 * r + v % 2;
        const uint8_t byte = q[32 * c + 2 * j + nibble / 2];
        int value = (nibble % 2) ? byte >> 4 : byte & 0xF;
        if (type == Q6_K) value = (value | (((q[128 + 16 * c + j] >> (2 * nibble)) & 3) << 4)) - 32;
        out[kb * 256 + s * 32 + v] = scale[v / 16] * static_cast<float>(value) + offset;
      }
    }
  }
}

// row `row` of an x8 weight, dequantized (a tied embedding's lookup): out [k]
inline void x8_dequant_row(int type, const uint8_t* w, int64_t row, int64_t k, float* out) {
  if (x8_k_quant(type)) return x8k_dequant_row(type, w, row, k, out);
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
