// The elementwise ops of fused_ops.h for the model's layer-by-layer path
// (`qworker.model.kernels.native.add_rms_norm`, `rms_norm_heads`, `rope_store`, `silu_mul`,
// `gelu_tanh_mul`).
#include "fused_ops.h"

namespace {

constexpr int64_t kParallelElements = 1 << 15;  // below this, threads cost more than they save

}  // namespace

#define QW_EXPORT_ALL(suffix, T)                                                               \
  extern "C" void qw_add_rms_norm_##suffix(void* x, const void* delta, const void* weight,    \
                                           void* out, int64_t n, int64_t hidden, double eps) { \
    _Pragma("omp parallel if (n * hidden >= kParallelElements)")                               \
    qw::add_rms_norm(static_cast<T*>(x), static_cast<const T*>(delta),                        \
                     static_cast<const T*>(weight), static_cast<T*>(out), n, hidden, eps);    \
  }                                                                                            \
  extern "C" void qw_rms_norm_heads_##suffix(void* qkv, const void* q_weight,                \
                                             const void* k_weight, int64_t stride, int64_t n,  \
                                             int64_t heads, int64_t kv_heads, int64_t d,       \
                                             double eps) {                                     \
    _Pragma("omp parallel if (n * stride >= kParallelElements)")                               \
    qw::rms_norm_heads(static_cast<T*>(qkv), stride, static_cast<const T*>(q_weight),         \
                       static_cast<const T*>(k_weight), n, heads, kv_heads, d, eps);           \
  }                                                                                            \
  extern "C" void qw_rope_store_##suffix(                                                     \
      void* qkv, const void* cos, const void* sin, const int64_t* positions,                   \
      const int64_t* slots, void* k_cache, void* v_cache, int64_t stride, int64_t n,           \
      int64_t heads, int64_t kv_heads, int64_t d, int64_t cache_slots) {                       \
    _Pragma("omp parallel if (n * stride >= kParallelElements)")                               \
    qw::rope_store(static_cast<T*>(qkv), stride, static_cast<const T*>(cos),                  \
                   static_cast<const T*>(sin), positions, slots, static_cast<T*>(k_cache),    \
                   static_cast<T*>(v_cache), n, heads, kv_heads, d, cache_slots);             \
  }                                                                                            \
  extern "C" void qw_silu_mul_##suffix(const void* gate_up, void* out, int64_t n,             \
                                       int64_t inter) {                                        \
    _Pragma("omp parallel if (n * inter >= kParallelElements)")                                \
    qw::silu_mul(static_cast<const T*>(gate_up), static_cast<T*>(out), n, inter);             \
  }                                                                                            \
  extern "C" void qw_gelu_tanh_mul_##suffix(const void* gate_up, void* out, int64_t n,        \
                                            int64_t inter) {                                   \
    _Pragma("omp parallel if (n * inter >= kParallelElements)")                                \
    qw::gelu_tanh_mul(static_cast<const T*>(gate_up), static_cast<T*>(out), n, inter);        \
  }

QW_EXPORT_ALL(f32, float)
QW_EXPORT_ALL(f64, double)
QW_EXPORT_ALL(bf16, qw::bf16)
