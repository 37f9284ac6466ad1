// "int8x8": the K-quants Q4_K and Q6_K in the x8 layout (quant_x8.h) against activations
// quantized per 32-block to 8 bits (llama.cpp's scheme), multiplied by AVX512-VNNI's vpdpbusd:
// four unsigned bytes times four signed bytes summed into each 32-bit lane, twice the
// multiplies per instruction of bf16x8's vdpbf16ps at the same issue rate (AMD Zen 5: both two
// a cycle). For many activation rows. Per 16 J weight rows, a panel made once per call (in L2)
// holds each 32-value sub-block's values as 8 "quads" (lane j: four of row j's values as bytes,
// 16 rows a vector) and their scales as floats; a 4 x 16 J register tile sums a sub-block's
// quads in int32, then scales the sums into float accumulators:
// - Q4_K (w = d sc q - dmin m, q in 0..15): q unsigned against the signed activations, then
//   (isum d_x) (d sc) - s_x (dmin m), with s_x = d_x sum(q_x) the minimum's share;
// - Q6_K (w = d sc_h (q - 32), q in 0..63, sc_h an int8 scale per 16 values): q - 32 signed
//   against the activations + 128 (unsigned, stored so), each half's sums starting from -128
//   times the half's weight sum (the +128's share), then (isum_0 d sc_0 + isum_1 d sc_1) d_x.
// The Q4_K sums take 4 float operations per 8 vpdpbusd, Q6_K's 5 (its scale every 16 values).
// The other x8 formats run bf16x8. Included by quant_gemm.h after quant_x8.h.
#pragma once

namespace qw::quant {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(__AVX512BF16__)
constexpr bool kInt8Panels = true;

inline bool int8x8_serves(int type) { return type == Q4_K || type == Q6_K; }

template <int T> constexpr int kPanelPairs = T == Q4_K ? 3 : 2;  // J: 16-row blocks a panel

struct Int8Panel {  // J * 16 weight rows; for sub-block b:
  __m512i* quads;   // [8 b + u][J]
  __m512* scale;    // Q4_K: [b][J] (d sc); Q6_K: [2 b + h][J] (d sc_h)
  __m512* minimum;  // Q4_K: [b][J] (dmin m)
  __m512i* bias;    // Q6_K: [2 b + h][J] (-128 sum of half h's q - 32)
};

// A sub-block's chunk c of two consecutive groups (v: their 64 value bytes) as its 2 quads. In
// the x8 layout chunk c's 32-bit lane r holds row r's values 8c..8c+7 as nibbles in the order
// 0 2 4 6 1 3 5 7 (bits 0-3 first): its bytes' low nibbles are values 0 4 1 5, their high ones
// 2 6 3 7. The activations are stored in that order (`quantize_crossed`), so each is a quad as it
// stands. Q6_K: h is the chunk's high bits (x8k_high2: lane r = word 2r's byte | word 2r + 1's
// << 16, bits 2n..2n+1 those of nibble n), shifted into bits 4-5 of each byte.
template <int T>
inline void chunk_quads(__m512i v, __m512i h, __m512i* lo, __m512i* hi) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  *lo = _mm512_and_si512(v, low4);
  *hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
  if constexpr (T == Q6_K) {
    const __m512i even = _mm512_set1_epi32(0x00300030), odd = _mm512_set1_epi32(0x30003000);
    const __m512i m32 = _mm512_set1_epi8(32);
    constexpr int kOrAnd = 0xF8;  // a | (b & c)
    *lo = _mm512_ternarylogic_epi32(*lo, _mm512_slli_epi32(h, 4), even, kOrAnd);
    *lo = _mm512_ternarylogic_epi32(*lo, _mm512_slli_epi32(h, 8), odd, kOrAnd);
    *hi = _mm512_ternarylogic_epi32(*hi, _mm512_slli_epi32(h, 2), even, kOrAnd);
    *hi = _mm512_ternarylogic_epi32(*hi, _mm512_slli_epi32(h, 6), odd, kOrAnd);
    *lo = _mm512_sub_epi8(*lo, m32);
    *hi = _mm512_sub_epi8(*hi, m32);
  } else {
    (void)h;
  }
}

// 16 rows (groups g0, g1 at 256-value block kb's bytes) of sub-block s (= b % 8) into the panel
template <int T, int J>
inline void panel_sub_block(const uint8_t* g0, const uint8_t* g1, __m512 d, __m512 dmin, int s,
                            int64_t b, int j, const Int8Panel& p) {
  const uint8_t* q0 = g0 + X8K<T>::kHead + s * X8K<T>::kSub;
  const uint8_t* q1 = g1 + X8K<T>::kHead + s * X8K<T>::kSub;
  __m512i* quads = p.quads + 8 * b * J + j;
  if constexpr (T == Q4_K) {
    x8_q4k_scales2(g0, g1, s, d, dmin, p.scale + b * J + j, p.minimum + b * J + j);
  } else {
    for (int h = 0; h < 2; ++h) p.scale[(2 * b + h) * J + j] = x8_q6k_scale2(g0, g1, s, h, d);
  }
  __m512i sum = _mm512_setzero_si512();
  for (int c = 0; c < 4; ++c) {
    chunk_quads<T>(pair_of(q0 + 32 * c, q1 + 32 * c), x8k_high2<T>(q0, q1, c),
                   quads + 2 * c * J, quads + (2 * c + 1) * J);
    if constexpr (T == Q6_K) {  // each half's sum: chunks 0-1, 2-3
      const __m512i ones = _mm512_set1_epi8(1);
      sum = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(sum, ones, quads[2 * c * J]), ones,
                                quads[(2 * c + 1) * J]);
      if (c % 2) {
        p.bias[(2 * b + c / 2) * J + j] = _mm512_sub_epi32(_mm512_setzero_si512(),
                                                           _mm512_slli_epi32(sum, 7));
        sum = _mm512_setzero_si512();
      }
    }
  }
}

// J * 16 weight rows from row 16 * pair0 as a panel
template <int T, int J>
inline void int8_panel(const uint8_t* w, int64_t pair0, int64_t k, const Int8Panel& p) {
  const int64_t group_bytes = x8_group_bytes<T>(k / 32);
  for (int j = 0; j < J; ++j) {
    const uint8_t* g0 = w + 2 * (pair0 + j) * group_bytes;
    const uint8_t* g1 = g0 + group_bytes;
    for (int64_t kb = 0; kb < k / 256; ++kb, g0 += X8K<T>::kBytes, g1 += X8K<T>::kBytes) {
      const __m512 d = halves_of(g0, g1);
      const __m512 dmin = T == Q4_K ? halves_of(g0 + 16, g1 + 16) : _mm512_setzero_ps();
      for (int s = 0; s < 8; ++s) panel_sub_block<T, J>(g0, g1, d, dmin, s, 8 * kb + s, j, p);
    }
  }
}

// bytes a tile asks for while it computes (the next panel's share), a few lines per sub-block:
// issued all at once they fill the core's outstanding misses and stall it
struct Ahead {
  const uint8_t* from;
  int64_t bytes;
  void at(int64_t b, int64_t blocks) const {
    for (int64_t line = (b * bytes / blocks) & ~int64_t{63}; line < (b + 1) * bytes / blocks;
         line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(from + line), _MM_HINT_T1);
  }
};

inline __m512i four_of(const ActBlock& xb, int u) {  // activation values 4u..4u+3, broadcast
  int32_t four;
  std::memcpy(&four, xb.q8 + 4 * u, 4);
  return _mm512_set1_epi32(four);
}

// out[r * ldo + 16 j + col] for R activation rows (`blocks` ActBlocks apart) and the panel
template <int R, int J>
inline void q4k_tile(const ActBlock* x, int64_t blocks, const Int8Panel& p, float* out,
                     int64_t ldo, const Ahead& ahead) {
  __m512 acc[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    ahead.at(b, blocks);
    __m512i isum[R][J];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < J; ++j) isum[r][j] = _mm512_setzero_si512();
    for (int u = 0; u < 8; ++u) {
      __m512i wq[J];
      for (int j = 0; j < J; ++j) wq[j] = _mm512_load_si512(p.quads + (8 * b + u) * J + j);
      for (int r = 0; r < R; ++r) {
        const __m512i xq = four_of(x[r * blocks + b], u);
        for (int j = 0; j < J; ++j) isum[r][j] = _mm512_dpbusd_epi32(isum[r][j], wq[j], xq);
      }
    }
    for (int r = 0; r < R; ++r) {
      const ActBlock& xb = x[r * blocks + b];
      const __m512 d = _mm512_set1_ps(xb.d), s = _mm512_set1_ps(xb.s);
      for (int j = 0; j < J; ++j) {
        acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][j]),
                                    _mm512_mul_ps(p.scale[b * J + j], d), acc[r][j]);
        acc[r][j] = _mm512_fnmadd_ps(p.minimum[b * J + j], s, acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) _mm512_storeu_ps(out + r * ldo + 16 * j, acc[r][j]);
}

template <int R, int J>
inline void q6k_tile(const ActBlock* x, int64_t blocks, const Int8Panel& p, float* out,
                     int64_t ldo, const Ahead& ahead) {
  __m512 acc[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    ahead.at(b, blocks);
    __m512 both[R][J];  // isum_0 sc_0 + isum_1 sc_1
    for (int h = 0; h < 2; ++h) {
      __m512i isum[R][J];
      for (int j = 0; j < J; ++j) {
        const __m512i bias = _mm512_load_si512(p.bias + (2 * b + h) * J + j);
        for (int r = 0; r < R; ++r) isum[r][j] = bias;
      }
      for (int u = 4 * h; u < 4 * h + 4; ++u) {
        __m512i wq[J];
        for (int j = 0; j < J; ++j) wq[j] = _mm512_load_si512(p.quads + (8 * b + u) * J + j);
        for (int r = 0; r < R; ++r) {
          const __m512i xq = four_of(x[r * blocks + b], u);  // unsigned: + 128
          for (int j = 0; j < J; ++j) isum[r][j] = _mm512_dpbusd_epi32(isum[r][j], xq, wq[j]);
        }
      }
      for (int j = 0; j < J; ++j) {
        const __m512 scale = p.scale[(2 * b + h) * J + j];
        for (int r = 0; r < R; ++r) {
          const __m512 v = _mm512_cvtepi32_ps(isum[r][j]);
          both[r][j] = h == 0 ? _mm512_mul_ps(v, scale) : _mm512_fmadd_ps(v, scale, both[r][j]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 d = _mm512_set1_ps(x[r * blocks + b].d);
      for (int j = 0; j < J; ++j) acc[r][j] = _mm512_fmadd_ps(both[r][j], d, acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) _mm512_storeu_ps(out + r * ldo + 16 * j, acc[r][j]);
}

template <int T, int R, int J>
inline void int8_tile(const ActBlock* x, int64_t blocks, const Int8Panel& p, float* out,
                      int64_t ldo, const Ahead& ahead) {
  if constexpr (T == Q4_K) q4k_tile<R, J>(x, blocks, p, out, ldo, ahead);
  else q6k_tile<R, J>(x, blocks, p, out, ldo, ahead);
}

// the panel times every activation row, 4 at a time; meanwhile the next panel's bytes (`next`,
// `bytes`) are asked for, a slice a tile, so that DRAM works while the tiles compute
template <int T, int J>
inline void int8_panel_rows(const ActBlock* x, int64_t m, int64_t blocks, const Int8Panel& p,
                            float* out, int64_t ldo, const uint8_t* next, int64_t bytes) {
  constexpr int kRows = 4;
  const int64_t tiles = (m + kRows - 1) / kRows, slice = (bytes / tiles + 63) / 64 * 64;
  for (int64_t i = 0, t = 0; i < m; i += kRows, ++t) {
    const Ahead ahead{next + t * slice, std::max<int64_t>(0, std::min(slice, bytes - t * slice))};
    const ActBlock* xi = x + i * blocks;
    float* to = out + i * ldo;
    switch (std::min<int64_t>(kRows, m - i)) {
      case 4: int8_tile<T, 4, J>(xi, blocks, p, to, ldo, ahead); break;
      case 3: int8_tile<T, 3, J>(xi, blocks, p, to, ldo, ahead); break;
      case 2: int8_tile<T, 2, J>(xi, blocks, p, to, ldo, ahead); break;
      default: int8_tile<T, 1, J>(xi, blocks, p, to, ldo, ahead); break;
    }
  }
}

// a row quantized to 8 bits (quantize_row<false>), each 8 values reordered 0 4 1 5 2 6 3 7 as
// chunk_quads reads them; for Q6_K + 128, as unsigned bytes (d and s stay the signed values')
template <int T>
inline void quantize_crossed(const float* x, int64_t k, ActBlock* out) {
  quantize_row<false>(x, k, out);
  const __m256i order = _mm256_broadcastsi128_si256(
      _mm_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15));
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(T == Q6_K ? 0x80 : 0));
  for (int64_t b = 0; b < k / 32; ++b) {
    __m256i* q = reinterpret_cast<__m256i*>(out[b].q8);
    _mm256_storeu_si256(q, _mm256_xor_si256(_mm256_shuffle_epi8(_mm256_loadu_si256(q), order),
                                            flip));
  }
}

// out[m, ldo] (its first n columns) = x W^T for a Q4_K or Q6_K weight in the x8 layout
// (n % 16 == 0). shared: m * k/32 blocks of scratch, as team_x8_gemm uses it
template <int T>
inline void team_int8x8(const float* x, int64_t m, int64_t k, const uint8_t* w, int64_t n,
                        float* out, int64_t ldo, ActBlock* shared) {
  constexpr int J = kPanelPairs<T>;
  const int64_t blocks = k / 32, group_bytes = x8_group_bytes<T>(blocks);
  const ActBlock* xq = team_quantized(x, m, k, shared, [k](const float* row, ActBlock* to) {
    quantize_crossed<T>(row, k, to);
  });
  thread_local std::vector<__m512i> quads, bias;
  thread_local std::vector<__m512> scale, minimum;
  grow(quads, static_cast<size_t>(blocks * 8 * J));
  grow(scale, static_cast<size_t>(blocks * 2 * J));
  grow(minimum, static_cast<size_t>(blocks * J));
  grow(bias, static_cast<size_t>(blocks * 2 * J));
  const Int8Panel panel{quads.data(), scale.data(), minimum.data(), bias.data()};
#pragma omp for schedule(static)
  for (int64_t p = 0; p < (n / 16 + J - 1) / J; ++p) {
    const int64_t pairs = std::min<int64_t>(J, n / 16 - J * p);
    const int64_t from = std::min(2 * J * (p + 1), n / 8) * group_bytes;  // this thread's next
    const int64_t ahead = std::min(2 * J * (p + 2), n / 8) * group_bytes - from;  // panel, mostly
    float* to = out + 16 * J * p;
    if (pairs == J) {
      int8_panel<T, J>(w, J * p, k, panel);
      int8_panel_rows<T, J>(xq, m, blocks, panel, to, ldo, w + from, ahead);
    } else if (pairs == 2) {
      int8_panel<T, 2>(w, J * p, k, panel);
      int8_panel_rows<T, 2>(xq, m, blocks, panel, to, ldo, w + from, ahead);
    } else {
      int8_panel<T, 1>(w, J * p, k, panel);
      int8_panel_rows<T, 1>(xq, m, blocks, panel, to, ldo, w + from, ahead);
    }
  }
}

inline void team_x8_int8(int type, const float* x, int64_t m, int64_t k, const uint8_t* w,
                         int64_t n, float* out, int64_t ldo, ActBlock* shared) {
  if (type == Q4_K) return team_int8x8<Q4_K>(x, m, k, w, n, out, ldo, shared);
  if (type == Q6_K) return team_int8x8<Q6_K>(x, m, k, w, n, out, ldo, shared);
  team_x8_bf16(type, x, m, k, w, n, out, ldo);
}
#else
constexpr bool kInt8Panels = false;
#endif

}  // namespace qw::quant
