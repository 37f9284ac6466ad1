// Element types shared by the native kernels: float, double and bfloat16 (stored as its bits);
// and, with AVX-512, the mask of a vector's first lanes.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace qw {

struct bf16 { uint16_t bits; };

inline float load(float x) { return x; }
inline double load(double x) { return x; }
inline float load(bf16 x) {
  uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline void store(float* p, float x) { *p = x; }
inline void store(double* p, double x) { *p = x; }
inline void store(bf16* p, float x) {  // round to nearest even, as torch does
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) { p->bits = 0x7fc0; return; }  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  p->bits = static_cast<uint16_t>(u >> 16);
}

template <typename T> struct Acc { using type = float; };   // what a T computes in
template <> struct Acc<double> { using type = double; };

template <typename T> T round_to(typename Acc<T>::type x) {  // x as a T would hold it
  T out;
  store(&out, x);
  return out;
}

// A thread's scratch buffer made at least n long, never shrunk: resize() writes zeros over the
// part that a call after a smaller one grows back into (a 512-row bf16x8 call after a narrower
// layer's: 7.6 MB, 1.3% of a 1.5B model's batched steps).
template <typename V> void grow(V& buffer, size_t n) {
  if (buffer.size() < n) buffer.resize(n);
}

#if defined(__AVX512F__)
// the first m of 16 lanes (none for m <= 0, all for m >= 16)
inline __mmask16 first_lanes(int64_t m) {
  return m >= 16 ? __mmask16(0xFFFF) : m <= 0 ? __mmask16(0) : __mmask16((1u << m) - 1);
}
#endif

}  // namespace qw
