// The elementwise steps of a decoder layer, one pass each: residual add + RMSNorm, the q/k heads'
// RMSNorm, rotary embedding + KV-cache store, SiLU-and-multiply. Each rounds to the model dtype where the torch path does,
// so both paths agree to the last bit or one rounding. Each shares its rows among the
// threads of the enclosing OpenMP region (called outside one: all on the calling thread).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common.h"

namespace qw {



// out = weight * T(row / rms(row)) over `size` values, the norm taken in float32 as the reference
// implementation does; out may be row itself.
template <typename T>
void rms_norm_row(const T* row, const T* weight, T* out, int64_t size, double eps) {
  float squares = 0;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < size; ++i) {
    const float v = static_cast<float>(load(row[i]));
    squares += v * v;
  }
  const float inv = 1.0f / std::sqrt(squares / static_cast<float>(size) + static_cast<float>(eps));
  for (int64_t i = 0; i < size; ++i) {
    const T normed = round_to<T>(static_cast<float>(load(row[i])) * inv);
    store(out + i, load(weight[i]) * load(normed));
  }
}

// x: [n, hidden], the residual stream. With a delta, x += delta first (in place). Then
// out = the RMSNorm of x (rms_norm_row).
template <typename T>
void add_rms_norm(T* x, const T* delta, const T* weight, T* out, int64_t n, int64_t hidden,
                  double eps) {
#pragma omp for
  for (int64_t r = 0; r < n; ++r) {
    T* row = x + r * hidden;
    if (delta != nullptr)
      for (int64_t i = 0; i < hidden; ++i) row[i] = round_to<T>(load(row[i]) + load(delta[r * hidden + i]));
    rms_norm_row(row, weight, out + r * hidden, hidden, eps);
  }
}

// qkv: [n, (heads + 2 kv_heads) * d] rows `stride` apart. Each q head normed in place by an
// RMSNorm of weight q_weight [d], each k head by one of k_weight [d] (Qwen3's q/k norms).
template <typename T>
void rms_norm_heads(T* qkv, int64_t stride, const T* q_weight, const T* k_weight, int64_t n,
                    int64_t heads, int64_t kv_heads, int64_t d, double eps) {
  const int64_t per_token = heads + kv_heads;
#pragma omp for
  for (int64_t r = 0; r < n * per_token; ++r) {
    const int64_t h = r % per_token;
    T* head = qkv + (r / per_token) * stride + h * d;
    rms_norm_row(head, h < heads ? q_weight : k_weight, head, d, eps);
  }
}

// qkv: [n, (heads + 2 kv_heads) * d] rows `stride` apart. Rotates the q and k heads in place
// (rotate-half convention, cos/sin tables [positions, d]), then stores each token's k and v heads
// at its cache slot; caches are [kv_heads, slots, d].
template <typename T>
void rope_store(T* qkv, int64_t stride, const T* cos, const T* sin, const int64_t* positions,
                const int64_t* slots, T* k_cache, T* v_cache, int64_t n, int64_t heads,
                int64_t kv_heads, int64_t d, int64_t cache_slots) {
  using A = typename Acc<T>::type;
  const int64_t half = d / 2;
#pragma omp for
  for (int64_t t = 0; t < n; ++t) {
    T* row = qkv + t * stride;
    const T* c = cos + positions[t] * d;
    const T* s = sin + positions[t] * d;
    for (int64_t h = 0; h < heads + kv_heads; ++h) {
      T* x = row + h * d;
      for (int64_t i = 0; i < half; ++i) {
        const A a = load(x[i]), b = load(x[i + half]);
        store(x + i, a * load(c[i]) - b * load(s[i]));
        store(x + i + half, b * load(c[i + half]) + a * load(s[i + half]));
      }
    }
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t at = (h * cache_slots + slots[t]) * d;
      std::memcpy(k_cache + at, row + (heads + h) * d, d * sizeof(T));
      std::memcpy(v_cache + at, row + (heads + kv_heads + h) * d, d * sizeof(T));
    }
  }
}

// exp(x) for x in [-80, 80] (callers clamp), within 2 ulp: 2^n * e^r, r = x - n ln 2 in
// [-ln 2 / 2, ln 2 / 2], e^r = 1 + r + r^2 P(r) (Cephes' expf polynomial). Inline, so that
// a simd loop keeps it in registers: libmvec's expf, called per vector, took its lanes out of
// range to a scalar path and made SiLU 6% of a 1.5B model's batched steps.
inline float exp_in_range(float x) {
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return (p * r * r + r + 1.0f) * scale;
}
inline double exp_in_range(double x) { return std::exp(x); }

// gate_up: [n, 2 * inter] -> out: [n, inter] = T(silu(gate)) * up
template <typename T>
void silu_mul(const T* gate_up, T* out, int64_t n, int64_t inter) {
  using A = typename Acc<T>::type;
#pragma omp for
  for (int64_t r = 0; r < n; ++r) {
    const T* gate = gate_up + r * 2 * inter;
    const T* up = gate + inter;
#pragma omp simd
    for (int64_t i = 0; i < inter; ++i) {
      const A g = load(gate[i]);
      // clamped: beyond 80, exp(-|g|) is below float's precision beside 1 (and fast-math
      // may not carry an overflow to infinity safely)
      const A e = exp_in_range(std::max(std::min(-g, A(80)), A(-80)));
      const T activated = round_to<T>(g / (A(1) + e));
      store(out + r * inter + i, load(activated) * load(up[i]));
    }
  }
}

// gate_up: [n, 2 * inter] (gate then up per row). out [n, inter] = gelu_tanh(gate) * up (GeGLU,
// Gemma's), the activation rounded to T before the product as torch's gelu then multiply does.
template <typename T>
void gelu_tanh_mul(const T* gate_up, T* out, int64_t n, int64_t inter) {
  using A = typename Acc<T>::type;
  const A beta = A(0.7978845608028654), kappa = A(0.044715);  // sqrt(2 / pi)
#pragma omp for
  for (int64_t r = 0; r < n; ++r) {
    const T* gate = gate_up + r * 2 * inter;
    const T* up = gate + inter;
    for (int64_t i = 0; i < inter; ++i) {
      const A g = load(gate[i]);
      const T activated = round_to<T>(A(0.5) * g * (A(1) + std::tanh(beta * (g + kappa * g * g * g))));
      store(out + r * inter + i, load(activated) * load(up[i]));
    }
  }
}

}  // namespace qw
