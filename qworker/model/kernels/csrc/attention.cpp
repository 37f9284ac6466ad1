// The paged attention of attention.h for the model's layer-by-layer path
// (`qworker.model.native.decode_attention`, `prefill_attention`).
#include "attention.h"

// shape, passed by value: num_seqs, max_blocks, heads, kv_heads, head_dim, num_blocks,
// block_size, q_stride
#define QW_SHAPE_ARGS                                                                          \
  int64_t num_seqs, int64_t max_blocks, int64_t heads, int64_t kv_heads, int64_t head_dim,     \
      int64_t num_blocks, int64_t block_size, int64_t q_stride
#define QW_SHAPE \
  qw::Shape { num_seqs, max_blocks, heads, kv_heads, head_dim, num_blocks, block_size, q_stride }

#define QW_EXPORT(name, T)                                                                     \
  extern "C" void name(const void* q, const void* k, const void* v, const int64_t* tables,     \
                       const int64_t* lens, void* out, QW_SHAPE_ARGS, double scale,            \
                       int64_t window) {                                                       \
    const qw::Shape s = QW_SHAPE;                                                              \
    _Pragma("omp parallel")                                                                    \
    qw::decode_attention(static_cast<const T*>(q), static_cast<const T*>(k),                  \
                         static_cast<const T*>(v), tables, lens, static_cast<T*>(out), s,      \
                         scale, window);                                                       \
  }

#define QW_EXPORT_PREFILL(name, T)                                                             \
  extern "C" void name(const void* q, const void* k, const void* v, const int64_t* table,      \
                       void* out, QW_SHAPE_ARGS, int64_t cached, int64_t count, double scale,   \
                       int64_t window) {                                                       \
    const qw::Shape s = QW_SHAPE;                                                              \
    _Pragma("omp parallel")                                                                    \
    qw::prefill_attention(static_cast<const T*>(q), static_cast<const T*>(k),                 \
                          static_cast<const T*>(v), table, static_cast<T*>(out), s, cached,    \
                          count, scale, window);                                               \
  }

QW_EXPORT(qw_decode_attention_f32, float)
QW_EXPORT(qw_decode_attention_f64, double)
QW_EXPORT(qw_decode_attention_bf16, qw::bf16)
QW_EXPORT_PREFILL(qw_prefill_attention_f32, float)
QW_EXPORT_PREFILL(qw_prefill_attention_f64, double)
QW_EXPORT_PREFILL(qw_prefill_attention_bf16, qw::bf16)

// whether a bfloat16 decode of this shape runs on AMX tiles here (attention_amx.h)
extern "C" int qw_amx_attention_serves(int64_t group, int64_t head_dim, int64_t block_size) {
#if defined(QW_ATTENTION_AMX)
  return qw::amx::attention_serves(group, head_dim, block_size) && qw::amx::tiles_ready();
#else
  (void)group, (void)head_dim, (void)block_size;
  return 0;
#endif
}
