// GGUF block formats, kept as the file stores them: each weight row is its blocks, back to back.
// Two ways to multiply: an integer dot for Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0, on the activations
// quantized per 32-block to 16 bits (_mm256_madd_epi16 against the weights widened to 16 bits;
// float32's results to ~1e-5) or to 8 bits (_mm256_maddubs_epi16 / _mm256_madd_epi16, as
// llama.cpp's AVX2 path does; coarser); and dequantize to float32 (every format, K-quants too):
// for a few activation rows a weight row at a time, dotted with each; for more, 16 weight rows at
// a time into a panel in the float32 GEMM's packed layout, which its register tiles multiply
// with every activation row (the dequantization paid once per 16 columns for all rows). Types
// are named by their ggml ids.
#pragma once

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "gemm.h"

namespace qw::quant {

enum Type : int { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13,
                  Q6_K = 14 };

struct Format { int64_t elems, bytes; };  // per block

inline Format format(int type) {
  switch (type) {
    case Q4_0: return {32, 18};
    case Q4_1: return {32, 20};
    case Q5_0: return {32, 22};
    case Q5_1: return {32, 24};
    case Q8_0: return {32, 34};
    case Q4_K: return {256, 144};
    case Q5_K: return {256, 176};
    case Q6_K: return {256, 210};
    default: return {0, 0};
  }
}

inline bool int8_dot_serves(int type) {
  return type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q5_1 || type == Q8_0;
}

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// ---- dequantizing one block into float32 (reference: ggml's dequantize_row_*)

inline void scale_min_k4(int j, const uint8_t* q, int* d, int* m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

inline void dequant_block(int type, const uint8_t* b, float* y) {
  switch (type) {
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: {
      const bool five = type == Q5_0 || type == Q5_1, offset = type == Q4_1 || type == Q5_1;
      const float d = half(b), m = offset ? half(b + 2) : 0.0f;
      const uint8_t* qs = b + (offset ? 4 : 2) + (five ? 4 : 0);
      uint32_t qh = 0;
      if (five) std::memcpy(&qh, b + (offset ? 4 : 2), 4);
      const int zero = offset ? 0 : (five ? 16 : 8);
      for (int j = 0; j < 16; ++j) {
        const int lo = (qs[j] & 0xF) | (five ? ((qh >> j) & 1) << 4 : 0);
        const int hi = (qs[j] >> 4) | (five ? ((qh >> (j + 16)) & 1) << 4 : 0);
        y[j] = d * static_cast<float>(lo - zero) + m;
        y[j + 16] = d * static_cast<float>(hi - zero) + m;
      }
      return;
    }
    case Q8_0: {
      const float d = half(b);
      for (int j = 0; j < 32; ++j) y[j] = d * static_cast<float>(static_cast<int8_t>(b[2 + j]));
      return;
    }
    case Q4_K: case Q5_K: {
      const float d = half(b), dmin = half(b + 2);
      const uint8_t* scales = b + 4;
      const bool five = type == Q5_K;
      const uint8_t* qh = b + 16;
      const uint8_t* q = b + (five ? 48 : 16);
      uint8_t u1 = 1, u2 = 2;
      for (int j = 0, is = 0; j < 256; j += 64, is += 2, q += 32) {
        int sc, mn;
        scale_min_k4(is, scales, &sc, &mn);
        const float d1 = d * sc, m1 = dmin * mn;
        scale_min_k4(is + 1, scales, &sc, &mn);
        const float d2 = d * sc, m2 = dmin * mn;
        for (int l = 0; l < 32; ++l) {
          const int lo = (q[l] & 0xF) + (five && (qh[l] & u1) ? 16 : 0);
          const int hi = (q[l] >> 4) + (five && (qh[l] & u2) ? 16 : 0);
          y[j + l] = d1 * static_cast<float>(lo) - m1;
          y[j + 32 + l] = d2 * static_cast<float>(hi) - m2;
        }
        u1 = static_cast<uint8_t>(u1 << 2);
        u2 = static_cast<uint8_t>(u2 << 2);
      }
      return;
    }
    case Q6_K: {
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float d = half(b + 208);
      for (int n = 0; n < 256; n += 128, ql += 64, qh += 32, sc += 8) {
        for (int l = 0; l < 32; ++l) {
          const int is = l / 16;
          const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
          const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
          const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
          const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
          y[n + l] = d * sc[is] * q1;
          y[n + l + 32] = d * sc[is + 2] * q2;
          y[n + l + 64] = d * sc[is + 4] * q3;
          y[n + l + 96] = d * sc[is + 6] * q4;
        }
      }
      return;
    }
    default: return;
  }
}

inline void dequant_row(int type, const uint8_t* row, int64_t k, float* y) {
  const Format f = format(type);
  for (int64_t b = 0; b < k / f.elems; ++b) dequant_block(type, row + b * f.bytes, y + b * f.elems);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float dot_f32(const float* a, const float* b, int64_t k) {  // k % 32 == 0
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
  for (int64_t i = 0; i < k; i += 32)
    for (int u = 0; u < 4; ++u)
      acc[u] = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8 * u), _mm256_loadu_ps(b + i + 8 * u),
                               acc[u]);
  return hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
}

// ---- activations quantized per 32-block: q = round(x / d), d = max|x| / 127 in 8 bits (the
// int8 dot) or max|x| / 32767 in 16 bits (the int16 dot); s = d * sum(q)

// isum + w x: the products of 16-bit pairs summed into each 32-bit lane (`_mm256_madd_epi16`),
// one fused instruction where the build has AVX512-VNNI (the same sums, bit for bit)
inline __m256i dot_add(__m256i isum, __m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(isum, w, x);
#else
  return _mm256_add_epi32(isum, _mm256_madd_epi16(w, x));
#endif
}

struct ActBlock {
  float d, s;
  union { int8_t q8[32]; int16_t q16[32]; };
};

inline int32_t hsum_epi32(__m256i v) {
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s4 = _mm_hadd_epi32(s4, s4);
  s4 = _mm_hadd_epi32(s4, s4);
  return _mm_cvtsi128_si32(s4);
}

template <bool Wide>  // 16-bit values, else 8-bit
inline void quantize_row(const float* x, int64_t k, ActBlock* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < k / 32; ++b, x += 32) {
    __m256 v[4], mx = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int u = 0; u < 4; ++u) {
      v[u] = _mm256_loadu_ps(x + 8 * u);
      mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[u]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4), d = amax / (Wide ? 32767.0f : 127.0f);
    const __m256 inv = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
    __m256i i32[4];
    for (int u = 0; u < 4; ++u)
      i32[u] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[u], inv),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    // pack 32 int32 -> 32 int16 / int8 in order (packs interleave 128-bit lanes: permute back)
    __m256i i16a = _mm256_packs_epi32(i32[0], i32[1]), i16b = _mm256_packs_epi32(i32[2], i32[3]);
    __m256i pairs;
    if constexpr (Wide) {
      i16a = _mm256_permute4x64_epi64(i16a, 0xD8);
      i16b = _mm256_permute4x64_epi64(i16b, 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[b].q16), i16a);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[b].q16 + 16), i16b);
      pairs = _mm256_add_epi32(_mm256_madd_epi16(i16a, ones), _mm256_madd_epi16(i16b, ones));
    } else {
      __m256i i8 = _mm256_packs_epi16(i16a, i16b);
      i8 = _mm256_permutevar8x32_epi32(i8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[b].q8), i8);
      pairs = _mm256_madd_epi16(_mm256_add_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(i8)),
                                _mm256_cvtepi8_epi16(_mm256_extracti128_si256(i8, 1))), ones);
    }
    out[b].d = d;
    out[b].s = d * static_cast<float>(hsum_epi32(pairs));
  }
}

// ---- integer dot of one weight row with one quantized activation row

inline __m256i nibbles(const uint8_t* qs) {  // 16 bytes -> 32 values: low nibbles, then high
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i both = _mm256_insertf128_si256(_mm256_castsi128_si256(raw),
                                               _mm_srli_epi16(raw, 4), 1);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

inline __m256i bits_as_bytes(const uint8_t* p) {  // 32 bits -> 32 bytes, 0xFF where set
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  const __m256i shuffle = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                            0x0101010101010101, 0x0000000000000000);
  __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), shuffle);
  bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}

// One 32-value weight block of type T as 32 bytes: signed int8 (Q4_0, Q5_0, Q8_0), or unsigned
// values below 32 with a block minimum m (Q4_1, Q5_1: w = d q + m).
template <int T> struct Block {
  static constexpr int64_t kBytes =
      T == Q4_0 ? 18 : T == Q4_1 ? 20 : T == Q5_0 ? 22 : T == Q5_1 ? 24 : T == Q4_K ? 144
      : T == Q6_K ? 210 : 34;
  static constexpr bool kUnsigned = T == Q4_1 || T == Q5_1 || T == Q4_K;
  static constexpr int64_t kPer = T == Q4_K || T == Q6_K ? 8 : 1;  // 32-value sub-blocks
  // [d, m] of sub-block j as floats, its values being w = d q + m
  static __m128 scales(const uint8_t* w, int64_t j) {
    uint32_t halves = 0;  // the block's d (and, for Q4_1 / Q5_1 its minimum; Q4_K's dmin)
    std::memcpy(&halves, T == Q6_K ? w + 208 : w, T == Q6_K ? 2 : 4);  // Q6_K: d (16-value
    // scales are in its values)
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(halves)));
    if constexpr (T != Q4_K) {
      (void)j;
      return dm;
    } else {
      int sc, mn;
      scale_min_k4(static_cast<int>(j), w + 4, &sc, &mn);
      return _mm_mul_ps(dm, _mm_setr_ps(static_cast<float>(sc), -static_cast<float>(mn), 0, 0));
    }
  }
  static __m256i values(const uint8_t* w) {
    if constexpr (T == Q8_0) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 2));
    if constexpr (T == Q4_0) return _mm256_sub_epi8(nibbles(w + 2), _mm256_set1_epi8(8));
    if constexpr (T == Q4_1) return nibbles(w + 4);
    if constexpr (T == Q5_0)  // nibble | 0xF0 where the fifth bit is clear: -16..15
      return _mm256_or_si256(nibbles(w + 6),
                             _mm256_andnot_si256(bits_as_bytes(w + 2), _mm256_set1_epi8(-16)));
    return _mm256_or_si256(nibbles(w + 8),  // Q5_1: 0..31
                           _mm256_and_si256(bits_as_bytes(w + 4), _mm256_set1_epi8(0x10)));
  }
};

struct Halves { __m256i lo, hi; };  // a block's 32 values as 2 x 16 int16

// a 4-bit block's 16 bytes as int16: the low nibbles (values 0-15), the high ones (16-31)
inline Halves nibbles16(const uint8_t* qs, int zero) {
  const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  const __m256i z = _mm256_set1_epi16(static_cast<int16_t>(zero));
  return {_mm256_sub_epi16(_mm256_and_si256(bytes, _mm256_set1_epi16(0x0F)), z),
          _mm256_sub_epi16(_mm256_srli_epi16(bytes, 4), z)};
}

// one weight block unpacked for the dot: 32 bytes (8-bit activations), or 2 x 16 int16
template <int T, bool Wide> struct Unpacked {
  static auto of(const uint8_t* w, int64_t j) {  // sub-block j of the block at w
    if constexpr (!Wide) {
      return Block<T>::values(w);
    } else if constexpr (T == Q4_K) {  // 32 bytes per 2 sub-blocks: low nibbles, then high
      const __m128i* q = reinterpret_cast<const __m128i*>(w + 16 + (j / 2) * 32);
      const __m256i b0 = _mm256_cvtepu8_epi16(_mm_loadu_si128(q));
      const __m256i b1 = _mm256_cvtepu8_epi16(_mm_loadu_si128(q + 1));
      if (j % 2 == 0) {
        const __m256i low = _mm256_set1_epi16(0x0F);
        return Halves{_mm256_and_si256(b0, low), _mm256_and_si256(b1, low)};
      }
      return Halves{_mm256_srli_epi16(b0, 4), _mm256_srli_epi16(b1, 4)};
    } else if constexpr (T == Q6_K) {  // halves of 128 values: 64 bytes of ql, 32 of qh, 8 scales
      const int64_t h = j / 4, t = j % 4;
      const uint8_t* ql = w + h * 64 + (t % 2) * 32;
      const uint8_t* qh = w + 128 + h * 32;
      const int8_t* sc = reinterpret_cast<const int8_t*>(w + 192 + h * 8 + 2 * t);
      const __m128i shift = _mm_cvtsi32_si128(static_cast<int>(2 * t));
      const __m256i low = _mm256_set1_epi16(0x0F), two = _mm256_set1_epi16(3);
      Halves out;
      for (int half = 0; half < 2; ++half) {  // values 16 * half .. + 15, scale sc[half]
        __m256i q = _mm256_cvtepu8_epi16(_mm_loadu_si128(
            reinterpret_cast<const __m128i*>(ql + 16 * half)));
        q = t < 2 ? _mm256_and_si256(q, low) : _mm256_srli_epi16(q, 4);
        __m256i hi = _mm256_cvtepu8_epi16(_mm_loadu_si128(
            reinterpret_cast<const __m128i*>(qh + 16 * half)));
        hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(hi, shift), two), 4);
        q = _mm256_sub_epi16(_mm256_or_si256(q, hi), _mm256_set1_epi16(32));  // -32..31
        q = _mm256_mullo_epi16(q, _mm256_set1_epi16(sc[half]));  // |q sc| <= 4064
        (half == 0 ? out.lo : out.hi) = q;
      }
      return out;
    } else if constexpr (T == Q4_0 || T == Q4_1) {
      return nibbles16(w + (T == Q4_0 ? 2 : 4), T == Q4_0 ? 8 : 0);
    } else if constexpr (T == Q8_0) {
      const __m128i* q = reinterpret_cast<const __m128i*>(w + 2);
      return Halves{_mm256_cvtepi8_epi16(_mm_loadu_si128(q)),
                    _mm256_cvtepi8_epi16(_mm_loadu_si128(q + 1))};
    } else {  // Q5_0 (signed), Q5_1 (unsigned)
      const __m256i v = Block<T>::values(w);
      const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
      if constexpr (Block<T>::kUnsigned)
        return Halves{_mm256_cvtepu8_epi16(lo), _mm256_cvtepu8_epi16(hi)};
      return Halves{_mm256_cvtepi8_epi16(lo), _mm256_cvtepi8_epi16(hi)};
    }
  }
};

// the dot of one unpacked weight block with one activation block, as 8 int32 sums
template <int T, bool Wide, typename W>  // W: Halves where Wide, else __m256i
inline __m256i block_dot(const W& wv, const ActBlock& xb) {
  if constexpr (Wide) {  // weights widened to 16 bits (2 halves), _mm256_madd_epi16 with each
    const __m256i* x = reinterpret_cast<const __m256i*>(xb.q16);
    return dot_add(_mm256_madd_epi16(wv.lo, _mm256_loadu_si256(x)), wv.hi,
                   _mm256_loadu_si256(x + 1));
  } else {  // unsigned weights x signed activations (the signs moved onto the activations)
    const __m256i aw = Block<T>::kUnsigned ? wv : _mm256_sign_epi8(wv, wv);
    __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.q8));
    if constexpr (!Block<T>::kUnsigned) xq = _mm256_sign_epi8(xq, wv);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xq), _mm256_set1_epi16(1));
  }
}

// out[r] = dot(weight row w, activation row r) for R activation rows, `stride` blocks apart:
// each weight block is unpacked once for all R.
template <int T, bool Wide, int R>
inline void rows_dot(const uint8_t* w, const ActBlock* x, int64_t blocks, int64_t stride,
                     float* out, int64_t out_stride) {
  using B = Block<T>;
  __m256 acc[R];
  __m128 offsets[R];  // lane 1: the sum of a Q4_1 / Q5_1 / Q4_K block's minimum times s
  for (int r = 0; r < R; ++r) { acc[r] = _mm256_setzero_ps(); offsets[r] = _mm_setzero_ps(); }
  for (int64_t b = 0; b < blocks; ++b) {  // 32-value (sub-)blocks
    const uint8_t* wb = w + (b / B::kPer) * B::kBytes;
    const auto wv = Unpacked<T, Wide>::of(wb, b % B::kPer);
    const __m128 dm = B::scales(wb, b % B::kPer);
    for (int r = 0; r < R; ++r) {
      const ActBlock& xb = x[r * stride + b];
      const __m128 scales = _mm_mul_ps(dm, _mm_castpd_ps(_mm_load_sd(
          reinterpret_cast<const double*>(&xb.d))));  // d * xb.d, m * xb.s
      const __m256 dot = _mm256_cvtepi32_ps(block_dot<T, Wide>(wv, xb));
      acc[r] = _mm256_fmadd_ps(_mm256_broadcastss_ps(scales), dot, acc[r]);
      if constexpr (B::kUnsigned) offsets[r] = _mm_add_ps(offsets[r], scales);
    }
  }
  for (int r = 0; r < R; ++r) {
    float tail[4];
    _mm_storeu_ps(tail, offsets[r]);
    out[r * out_stride] = hsum(acc[r]) + (B::kUnsigned ? tail[1] : 0.0f);
  }
}

// ---- whole layers, called by every thread of an OpenMP team (inside a parallel region): the
// threads split the weight rows; each call ends on the barrier of its `omp for`

template <int T, bool Wide>
inline void team_int_rows(const ActBlock* xq, const uint8_t* w, int64_t m, int64_t n, int64_t k,
                          float* out, int64_t ldo) {
  constexpr int64_t kRows = 4;  // activation rows per pass over a weight row
  const int64_t blocks = k / 32, row_bytes = blocks / Block<T>::kPer * Block<T>::kBytes;
#pragma omp for schedule(static)
  for (int64_t r = 0; r < n; ++r) {
    const uint8_t* row = w + r * row_bytes;
    int64_t i = 0;
    for (; i + kRows <= m; i += kRows)
      rows_dot<T, Wide, kRows>(row, xq + i * blocks, blocks, blocks, out + i * ldo + r, ldo);
    for (; i < m; ++i)
      rows_dot<T, Wide, 1>(row, xq + i * blocks, blocks, blocks, out + i * ldo + r, ldo);
  }
}

constexpr int64_t kPrivateRows = 8;  // up to this many rows each thread quantizes them all

// out[m, ldo] (its first n columns) = x[m, k] W^T by the integer dot on 8-bit or (Wide) 16-bit
// activations. shared: scratch of m * k/32 blocks, used (by all threads) only above
// kPrivateRows rows; below, each thread quantizes every row for itself, which spares the team
// a barrier (on a busy machine a barrier waits for every thread to be scheduled: the larger
// cost).
// x's m rows of k values as blocks, each row by quantize(row, its blocks): up to kPrivateRows
// each thread quantizes them all for itself (no barrier), above the team splits them into
// `shared` (m * k/32 blocks). The blocks stay valid until the thread's next call.
template <typename Quantize>
inline const ActBlock* team_quantized(const float* x, int64_t m, int64_t k, ActBlock* shared,
                                      Quantize quantize) {
  const int64_t blocks = k / 32;
  if (m <= kPrivateRows) {
    thread_local std::vector<ActBlock> mine;
    grow(mine, static_cast<size_t>(m * blocks));
    for (int64_t i = 0; i < m; ++i) quantize(x + i * k, mine.data() + i * blocks);
    return mine.data();
  }
#pragma omp for schedule(static)
  for (int64_t i = 0; i < m; ++i) quantize(x + i * k, shared + i * blocks);
  return shared;
}

template <bool Wide>
inline void team_int_gemm(int type, const float* x, int64_t m, int64_t k, const uint8_t* w,
                          int64_t n, float* out, int64_t ldo, ActBlock* shared) {
  const ActBlock* xq = team_quantized(x, m, k, shared, [k](const float* row, ActBlock* to) {
    quantize_row<Wide>(row, k, to);
  });
  switch (type) {
    case Q4_0: team_int_rows<Q4_0, Wide>(xq, w, m, n, k, out, ldo); break;
    case Q4_1: team_int_rows<Q4_1, Wide>(xq, w, m, n, k, out, ldo); break;
    case Q5_0: team_int_rows<Q5_0, Wide>(xq, w, m, n, k, out, ldo); break;
    case Q5_1: team_int_rows<Q5_1, Wide>(xq, w, m, n, k, out, ldo); break;
    case Q4_K:  // 16-bit activations only (`serves`)
      if constexpr (Wide) team_int_rows<Q4_K, true>(xq, w, m, n, k, out, ldo);
      break;
    case Q6_K:
      if constexpr (Wide) team_int_rows<Q6_K, true>(xq, w, m, n, k, out, ldo);
      break;
    default: team_int_rows<Q8_0, Wide>(xq, w, m, n, k, out, ldo); break;
  }
}

// 16 weight rows (row_bytes apart) dequantized into the float32 GEMM's packed layout: panel
// [k][16], element (row j, column t) at t * 16 + j
inline void dequant_panel(int type, const uint8_t* w, int64_t row_bytes, int64_t k,
                          float* panel) {
  const Format f = format(type);
  float block[256];
  for (int64_t b = 0; b < k / f.elems; ++b)
    for (int j = 0; j < 16; ++j) {
      dequant_block(type, w + j * row_bytes + b * f.bytes, block);
      float* to = panel + b * f.elems * 16 + j;
      for (int64_t t = 0; t < f.elems; ++t) to[t * 16] = block[t];
    }
}

inline void transpose8(__m256 r[8]) {  // an 8x8 float tile, rows <-> columns
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i)
    for (int h = 0; h < 2; ++h) {
      u[4 * i + 2 * h] = _mm256_shuffle_ps(t[4 * i + h], t[4 * i + h + 2], 0x44);
      u[4 * i + 2 * h + 1] = _mm256_shuffle_ps(t[4 * i + h], t[4 * i + h + 2], 0xEE);
    }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// one 32-value block of an integer-dot type as floats, in order: d q + m
template <int T>
inline void block_floats(const uint8_t* b, __m256 out[4]) {
  const __m256i v = Block<T>::values(b);
  const __m256 d = _mm256_set1_ps(half(b));
  const __m256 m = _mm256_set1_ps(Block<T>::kUnsigned ? half(b + 2) : 0.0f);
  const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
  const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  for (int u = 0; u < 4; ++u)
    out[u] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[u])), m);
}

// dequant_panel for an integer-dot type: 8 rows' blocks at a time, transposed in registers
template <int T>
inline void dequant_panel_simd(const uint8_t* w, int64_t row_bytes, int64_t k, float* panel) {
  for (int64_t b = 0; b < k / 32; ++b)
    for (int j0 = 0; j0 < 16; j0 += 8) {
      __m256 v[8][4];
      for (int r = 0; r < 8; ++r)
        block_floats<T>(w + (j0 + r) * row_bytes + b * Block<T>::kBytes, v[r]);
      for (int u = 0; u < 4; ++u) {
        __m256 tile[8];
        for (int r = 0; r < 8; ++r) tile[r] = v[r][u];
        transpose8(tile);
        for (int c = 0; c < 8; ++c)
          _mm256_storeu_ps(panel + (b * 32 + u * 8 + c) * 16 + j0, tile[c]);
      }
    }
}

inline void dequant_panel_any(int type, const uint8_t* w, int64_t row_bytes, int64_t k,
                              float* panel) {
  switch (type) {
    case Q4_0: return dequant_panel_simd<Q4_0>(w, row_bytes, k, panel);
    case Q4_1: return dequant_panel_simd<Q4_1>(w, row_bytes, k, panel);
    case Q5_0: return dequant_panel_simd<Q5_0>(w, row_bytes, k, panel);
    case Q5_1: return dequant_panel_simd<Q5_1>(w, row_bytes, k, panel);
    case Q8_0: return dequant_panel_simd<Q8_0>(w, row_bytes, k, panel);
    default: return dequant_panel(type, w, row_bytes, k, panel);
  }
}

// out[m, 16 columns, ldo apart] = x [m, k] times a panel, by the float32 GEMM's register tiles
inline void panel_gemm(const float* x, const float* panel, float* out, int64_t m, int64_t k,
                       int64_t ldo) {
#if defined(__AVX512F__)
  qw::gemm_columns<float, 1>(x, panel, nullptr, out, m, k, ldo, 0);
#elif defined(QW_GEMM_AVX2)
  qw::gemm_rows<float>(x, panel, nullptr, out, 0, m, k, ldo, 0);
#endif
}

constexpr int64_t kPanelRows = 4;  // from this many activation rows, weights go by panels

// the same with the weights dequantized to float32: below kPanelRows activation rows a weight
// row at a time (in L1), each dotted with every activation row; from there 16 rows at a time
// into a panel (in L2) that the float32 GEMM's register tiles multiply with all of them
inline void team_dequant_gemm(int type, const float* x, int64_t m, int64_t k, const uint8_t* w,
                              int64_t n, float* out, int64_t ldo) {
  const int64_t row_bytes = k / format(type).elems * format(type).bytes;
  const int64_t panels = m >= kPanelRows ? n / 16 : 0;
  thread_local std::vector<float> buffer;
  grow(buffer, static_cast<size_t>(k * (panels > 0 ? 16 : 1)));
#pragma omp for schedule(static)
  for (int64_t p = 0; p < panels + (n - panels * 16 + 15) / 16; ++p) {
    const int64_t r0 = p * 16, r1 = std::min(n, r0 + 16);
    if (p < panels) {
      dequant_panel_any(type, w + r0 * row_bytes, row_bytes, k, buffer.data());
      panel_gemm(x, buffer.data(), out + r0, m, k, ldo);
      continue;
    }
    for (int64_t r = r0; r < r1; ++r) {
      dequant_row(type, w + r * row_bytes, k, buffer.data());
      for (int64_t i = 0; i < m; ++i) out[i * ldo + r] = dot_f32(x + i * k, buffer.data(), k);
    }
  }
}

}  // namespace qw::quant

#include "quant_x8.h"  // the 8-row interleaved layout's kernels (they use the above)
#include "quant_int8x8.h"  // the K-quants on 8-bit activations through AVX512-VNNI

namespace qw::quant {

// kInt16X8 / kDequantX8: the int16 dot / the dequantized panels on weights in the x8 layout;
// kBf16X8: bfloat16 panels and activations (AVX512-BF16 builds only); kInt8X8: 8-bit
// activations through AVX512-VNNI for Q4_K and Q6_K, the other x8 formats as kBf16X8
// (quant_int8x8.h)
enum Method : int {
  kInt8 = 0, kDequant = 1, kInt16 = 2, kInt16X8 = 3, kDequantX8 = 4, kBf16X8 = 5, kInt8X8 = 6
};

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
constexpr bool kBf16Panels = true;
#else
constexpr bool kBf16Panels = false;
#endif

inline bool serves(int type, int method, int64_t m, int64_t k, int64_t n, int64_t ldo) {
  const Format f = format(type);
  if (f.elems == 0 || k % f.elems || k % 32 || m <= 0 || ldo < n) return false;
  if (method == kInt16X8 || method == kDequantX8 || (method == kBf16X8 && kBf16Panels) ||
      (method == kInt8X8 && kInt8Panels))
    return x8_serves(type) && n % 16 == 0;
  return method == kDequant || (method == kInt8 && int8_dot_serves(type)) ||
         (method == kInt16 && (int8_dot_serves(type) || type == Q4_K || type == Q6_K));
}

// one of the above by method (only where `serves`); shared: m * k/32 blocks of scratch
inline void team_gemm(int type, int method, const float* x, int64_t m, int64_t k,
                      const uint8_t* w, int64_t n, float* out, int64_t ldo, ActBlock* shared) {
  if (method == kInt8)
    team_int_gemm<false>(type, x, m, k, w, n, out, ldo, shared);
  else if (method == kInt16)
    team_int_gemm<true>(type, x, m, k, w, n, out, ldo, shared);
  else if (method == kInt16X8)
    team_x8_gemm(type, x, m, k, w, n, out, ldo, shared);
  else if (method == kDequantX8)
    team_x8_dequant(type, x, m, k, w, n, out, ldo);
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
  else if (method == kBf16X8)
    team_x8_bf16(type, x, m, k, w, n, out, ldo);
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(__AVX512BF16__)
  else if (method == kInt8X8)
    team_x8_int8(type, x, m, k, w, n, out, ldo, shared);
#endif
  else
    team_dequant_gemm(type, x, m, k, w, n, out, ldo);
}

}  // namespace qw::quant
