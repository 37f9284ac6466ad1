// Element types shared by the native kernels: float, double and bfloat16 (stored as its bits).
#pragma once

#include <cstdint>
#include <cstring>

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

}  // namespace qw
