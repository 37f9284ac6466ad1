// A decode-only step's every decoder layer, final norm and LM head in one call and one OpenMP
// region: the kernels of the model's layer-by-layer path, in the same order on the same buffers
// (so the same results), minus that path's per-op Python, tensor allocations and thread wake-ups,
// which at one sequence cost about a quarter of a step. The CPU's stand-in for a captured CUDA
// graph, used by qworker/model/decode_graph.py.
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <type_traits>
#include <vector>

#include "attention.h"
#include "fused_ops.h"
#include "gemm.h"
#include "gemm_amx.h"
#include "quant_gemm.h"
#include "route.h"

namespace {

// The structs Python fills by field name (qworker/model/decode_abi.py mirrors them as ctypes
// Structures, and checks their layout against qw_decode_abi below).

// a run of a quantized weight's rows of one GGUF format (quant_gemm.h), and its kernel
struct QuantSegment {
  const void* blocks;  // rows x (k / elems) blocks
  int64_t type, method, rows;
};

// one projection's weight: gemm-packed (dense), or quantized segments (pack null; in float32)
struct Proj {
  const void* pack;
  const QuantSegment* segments;
  int64_t num_segments;
  int64_t kernel;  // of a pack: kVectorGemm (gemm.h) or kAmxGemm (gemm_amx.h)
};

constexpr int64_t kVectorGemm = 0, kAmxGemm = 1;

template <typename T>
bool amx_serves(int64_t m, int64_t n, int64_t k) {
#if defined(QW_GEMM_AMX)
  if constexpr (std::is_same_v<T, qw::bf16>) return qw::amx::serves(m, n, k);
#endif
  (void)m, (void)n, (void)k;
  return false;
}

constexpr int64_t kSilu = 0, kGeluTanh = 1;  // Layer.activation

// a routed-experts layer's MLP (in place of Layer.gate_up / down): the router, and each expert's
// gate/up and down as the kernel choice runs them at each token-count bucket up to the step's
// (an expert runs over just the rows that chose it, at the bucket of their count)
struct Experts {
  Proj router;           // [router_width, hidden]: its first `count` columns are the logits
  const Proj* gate_up;   // [num_buckets * count]: bucket b's expert e at b * count + e
  const Proj* down;
  int64_t count, top_k, normalize, inter, num_buckets;
  int64_t router_width;  // count, or more (a router padded to whole 16-column blocks)
  const double* edges;  // the buckets' edges: a row count's bucket is the edges below it
  int64_t num_edges;
};

int64_t bucket_of(const Experts& ex, int64_t rows) {
  int64_t b = 0;
  while (b < ex.num_edges && ex.edges[b] < static_cast<double>(rows)) ++b;
  return b;
}

// one layer's tensors
struct Layer {
  const void* input_norm;
  Proj qkv;
  const void* qkv_bias;  // or null
  const void* q_norm;    // each q head's RMSNorm weight [head_dim], or null (then k_norm too)
  const void* k_norm;
  Proj o;
  const void* post_norm;
  Proj gate_up;
  Proj down;
  void* k_cache;
  void* v_cache;
  // Gemma's: the attention's and the MLP's outputs normed before they are added (post_norm is
  // then the MLP input's norm), or null; the layer's own RoPE tables, or null (the step's)
  const void* attn_out_norm;
  const void* mlp_out_norm;
  const void* cos;
  const void* sin;
  const Experts* experts;  // or null: the layer's MLP is gate_up / down
  int64_t activation;  // kSilu or kGeluTanh
  int64_t window;      // the layer's sliding window, or 0
  int64_t kv_group;    // 0, or 1: its blocks are the windowed group's (window_slots/_tables)
};

struct Dims {
  int64_t hidden, heads, kv_heads, head_dim, inter, num_blocks, block_size, max_blocks, vocab;
  int64_t window_num_blocks;  // the windowed KV group's pool (kv_group 1), or 0
};

// the model's last steps: final norm and LM head, for the rows that sample
struct Head {
  const void* norm;
  const Proj* lm_head;
  const int64_t* rows;
  int64_t num_rows, vocab;
  void* logits;  // [num_rows, vocab]
};

template <typename T>
bool proj_serves(const Proj& p, int64_t m, int64_t n, int64_t k) {
  if (p.pack != nullptr)
    return p.kernel == kAmxGemm ? amx_serves<T>(m, n, k)
                                : p.kernel == kVectorGemm && qw::gemm_serves<T>(m, n, k);
  if (p.num_segments < 1) return false;
  int64_t rows = 0;
  for (int64_t s = 0; s < p.num_segments; ++s) {
    const QuantSegment& seg = p.segments[s];
    if (!qw::quant::serves(static_cast<int>(seg.type), static_cast<int>(seg.method), m, k,
                           seg.rows, n))
      return false;
    rows += seg.rows;
  }
  return rows == n;
}

// whether every projection an expert of the layer may run in a step of m rows is served (an
// expert's rows: 1 to m, at the buckets up to m's)
template <typename T>
bool experts_serve(const Experts& ex, int64_t m, int64_t hidden) {
  const int64_t buckets = bucket_of(ex, m) + 1;
  if (buckets > ex.num_buckets || ex.top_k < 1 || ex.top_k > ex.count ||
      ex.router_width < ex.count || !proj_serves<T>(ex.router, m, ex.router_width, hidden))
    return false;
  for (int64_t i = 0; i < buckets * ex.count; ++i)
    for (int64_t rows : {int64_t{1}, m})
      if (!proj_serves<T>(ex.gate_up[i], rows, 2 * ex.inter, hidden) ||
          !proj_serves<T>(ex.down[i], rows, hidden, ex.inter))
        return false;
  return true;
}

// a quantized projection in float32: segment by segment into its columns, then the bias
template <typename T>
void quant_project(const Proj& p, const float* x, const T* bias, float* out, int64_t m,
                   int64_t n, int64_t k, qw::quant::ActBlock* shared) {
  int64_t row = 0;
  for (int64_t s = 0; s < p.num_segments; ++s) {
    const QuantSegment& seg = p.segments[s];
    qw::quant::team_gemm(static_cast<int>(seg.type), static_cast<int>(seg.method), x, m, k,
                         static_cast<const uint8_t*>(seg.blocks), seg.rows, out + row, n,
                         shared);
    row += seg.rows;
  }
  if (bias != nullptr) {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) out[i * n + j] += qw::load(bias[j]);
  }
}

// Staging: a bf16 step's activations as float32 for its quantized projections, and their
// float32 results (each [m, widest])
struct Staging { float* x; float* out; };

// out [m, n] = x [m, k] W^T (+ bias) by every thread of the team, as the layer-by-layer path
// computes it (a quantized one in float32, a bf16 step's rounded back to bf16 after the bias);
// ends on a barrier. shared: the integer dot's scratch, m * k/32 blocks.
template <typename T>
void project(const Proj& p, const T* x, const T* bias, T* out, int64_t m, int64_t n, int64_t k,
             qw::quant::ActBlock* shared, const Staging& stage) {
  if (p.pack != nullptr) {
#if defined(QW_GEMM_AMX)
    if constexpr (std::is_same_v<T, qw::bf16>) {
      if (p.kernel == kAmxGemm) {
        qw::amx::gemm(x, static_cast<const T*>(p.pack), bias, out, m, n, k);
        return;
      }
    }
#endif
    qw::gemm(x, static_cast<const T*>(p.pack), bias, out, m, n, k);
    return;
  }
  if constexpr (std::is_same_v<T, float>) {
    (void)stage;
    quant_project(p, x, bias, out, m, n, k, shared);
  } else {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < m * k; ++i) stage.x[i] = qw::load(x[i]);
    quant_project(p, stage.x, bias, stage.out, m, n, k, shared);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < m * n; ++i) qw::store(out + i, stage.out[i]);
  }
}

// A routed-experts layer's working buffers, sized for the widest such layer of the model
template <typename T>
struct ExpertScratch {
  std::vector<T> logits;            // the router's [m, router_width], in T as its Linear gives
  std::vector<float> logits_f32;    // ...as float32, for the routing
  std::vector<int64_t> chosen;      // [m, k]
  std::vector<float> weights;       // [m, k]
  std::vector<int64_t> counts;      // rows per expert
  std::vector<int64_t> rows;        // the rows grouped by expert, ascending within each
  std::vector<T> row_weight;        // each grouped row's weight, in T
  std::vector<T> x, gate_up, act, y;  // one expert's rows: input, [2 * inter], [inter], output

  ExpertScratch(const Layer* layers, int64_t num_layers, int64_t m, int64_t hidden) {
    int64_t count = 0, width = 0, k = 0, inter = 0;
    for (int64_t l = 0; l < num_layers; ++l) {
      const Experts* ex = layers[l].experts;
      if (ex == nullptr) continue;
      count = std::max(count, ex->count), k = std::max(k, ex->top_k);
      width = std::max(width, ex->router_width);
      inter = std::max(inter, ex->inter);
    }
    if (count == 0) return;
    logits.resize(m * width), logits_f32.resize(m * count), chosen.resize(m * k);
    weights.resize(m * k), counts.resize(count), rows.resize(m * k), row_weight.resize(m * k);
    x.resize(m * hidden), gate_up.resize(m * 2 * inter), act.resize(m * inter);
    y.resize(m * hidden);
  }
};

// delta [m, hidden] = the routed experts' sum for each row of h, as layers/experts.py computes
// it: route, group the rows by expert, each chosen expert's gated MLP over just its rows (at the
// kernels of its row count's bucket), each output times its weight in T, added into zeros
// experts in ascending order (index_add_). By every thread of the team; ends on a barrier.
template <typename T>
void routed_mlp(const Experts& ex, int64_t activation, const T* h, T* delta, int64_t m,
                int64_t hidden, ExpertScratch<T>& s, qw::quant::ActBlock* shared,
                const Staging& stage) {
  const T* none = nullptr;
  const int64_t k = ex.top_k, inter = ex.inter;
  project(ex.router, h, none, s.logits.data(), m, ex.router_width, hidden, shared, stage);
#pragma omp single
  {
    for (int64_t i = 0; i < m; ++i)
      for (int64_t e = 0; e < ex.count; ++e)
        s.logits_f32[i * ex.count + e] = qw::load(s.logits[i * ex.router_width + e]);
    qw::route(s.logits_f32.data(), m, ex.count, k, ex.normalize != 0, s.chosen.data(),
              s.weights.data());
    std::fill(s.counts.begin(), s.counts.begin() + ex.count, 0);
    for (int64_t i = 0; i < m * k; ++i) ++s.counts[s.chosen[i]];
    std::vector<int64_t> next(ex.count, 0);  // each expert's first place in rows
    for (int64_t e = 1; e < ex.count; ++e) next[e] = next[e - 1] + s.counts[e - 1];
    for (int64_t i = 0; i < m * k; ++i) {  // (row, slot) in order: rows ascending per expert
      const int64_t at = next[s.chosen[i]]++;
      s.rows[at] = i / k;
      qw::store(&s.row_weight[at], s.weights[i]);
    }
  }
#pragma omp for schedule(static)
  for (int64_t i = 0; i < m * hidden; ++i) qw::store(delta + i, 0.0f);
  int64_t start = 0;
  for (int64_t e = 0; e < ex.count; ++e) {
    const int64_t count = s.counts[e];
    if (count == 0) continue;
    const int64_t* rows = &s.rows[start];
    const T* weight = &s.row_weight[start];
    start += count;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < count; ++i)
      std::memcpy(&s.x[i * hidden], h + rows[i] * hidden, hidden * sizeof(T));
    const int64_t b = bucket_of(ex, count);
    project(ex.gate_up[b * ex.count + e], s.x.data(), none, s.gate_up.data(), count, 2 * inter,
            hidden, shared, stage);
    if (activation == kGeluTanh)
      qw::gelu_tanh_mul(s.gate_up.data(), s.act.data(), count, inter);
    else
      qw::silu_mul(s.gate_up.data(), s.act.data(), count, inter);
    project(ex.down[b * ex.count + e], s.act.data(), none, s.y.data(), count, hidden, inter,
            shared, stage);
    // the product rounded to T, then the sum (separate loops: never one fused multiply-add)
#pragma omp for schedule(static)
    for (int64_t i = 0; i < count; ++i)
      for (int64_t j = 0; j < hidden; ++j)
        qw::store(&s.y[i * hidden + j], qw::load(s.y[i * hidden + j]) * qw::load(weight[i]));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < count; ++i)  // a row appears once per expert: no two threads meet
      for (int64_t j = 0; j < hidden; ++j)
        qw::store(&delta[rows[i] * hidden + j],
                  qw::load(delta[rows[i] * hidden + j]) + qw::load(s.y[i * hidden + j]));
  }
}

// The LM head's logits [num_rows, vocab] of h: a quantized head's in float32 whatever T (its
// kernels compute them so; rounded to bf16 they tie tokens ~0.1 apart at ~25), a dense head's in T
template <typename T>
void head_logits(const Head& head, const T* h, int64_t hidden, qw::quant::ActBlock* shared,
                 const Staging& stage) {
  const Proj& p = *head.lm_head;
  const T* none = nullptr;
  if constexpr (!std::is_same_v<T, float>) {
    if (p.pack == nullptr) {
#pragma omp for schedule(static)
      for (int64_t i = 0; i < head.num_rows * hidden; ++i) stage.x[i] = qw::load(h[i]);
      quant_project(p, stage.x, none, static_cast<float*>(head.logits), head.num_rows,
                    head.vocab, hidden, shared);
      return;
    }
  }
  project(p, h, none, static_cast<T*>(head.logits), head.num_rows, head.vocab, hidden, shared,
          stage);
}

// x [m, hidden]: the residual stream in, updated in place; then the logits of head.rows
template <typename T>
void decode_step(T* x, const Layer* layers, int64_t num_layers, const Head& head, const T* cos,
                 const T* sin, const int64_t* positions, const int64_t* slots,
                 const int64_t* tables, const int64_t* lens, const int64_t* window_slots,
                 const int64_t* window_tables, int64_t m, const Dims& d, double eps,
                 double scale) {
  const int64_t q_width = d.heads * d.head_dim, qkv_width = q_width + 2 * d.kv_heads * d.head_dim;
  std::vector<T> h(m * d.hidden), qkv(m * qkv_width), attn(m * q_width);
  std::vector<T> gate_up(m * 2 * d.inter), act(m * d.inter), delta(m * d.hidden);
  std::vector<T> unnormed(m * d.hidden);  // an output before its post norm
  std::vector<T> picked(head.num_rows * d.hidden), picked_delta(head.num_rows * d.hidden);
  // each KV group's: block tables (both of max_blocks columns), slots and pool
  const qw::Shape shapes[2] = {
      {m, d.max_blocks, d.heads, d.kv_heads, d.head_dim, d.num_blocks, d.block_size, qkv_width},
      {m, d.max_blocks, d.heads, d.kv_heads, d.head_dim, d.window_num_blocks, d.block_size,
       qkv_width}};
  const int64_t* group_slots[2] = {slots, window_slots};
  const int64_t* group_tables[2] = {tables, window_tables};
  int64_t expert_widest = 0, expert_out = 0;  // a routed-experts layer's widest in and out
  for (int64_t l = 0; l < num_layers; ++l)
    if (const Experts* ex = layers[l].experts) {
      expert_widest = std::max({expert_widest, ex->inter});
      expert_out = std::max({expert_out, 2 * ex->inter, ex->router_width});
    }
  ExpertScratch<T> experts(layers, num_layers, m, d.hidden);
  const int64_t widest = std::max({d.hidden, q_width, d.inter, expert_widest});
  std::vector<qw::quant::ActBlock> q8(m > qw::quant::kPrivateRows ? m * (widest / 32) : 0);
  auto cast = [](const void* p) { return static_cast<const T*>(p); };
  const T* none = nullptr;
  qw::quant::ActBlock* shared = q8.data();
  // a bf16 step's quantized projections run in float32 (the LM head's too: vocab columns)
  bool quantized = head.lm_head->pack == nullptr;
  for (int64_t l = 0; l < num_layers; ++l) {
    const Layer& w = layers[l];
    quantized = quantized || !w.qkv.pack || !w.o.pack || w.experts != nullptr ||
                !w.gate_up.pack || !w.down.pack;  // (experts: staged whatever their form)
  }
  const bool staged = !std::is_same_v<T, float> && quantized;
  const int64_t out_widest = std::max({qkv_width, 2 * d.inter, d.hidden, head.vocab,
                                       expert_out});
  std::vector<float> stage_x(staged ? m * widest : 0), stage_out(staged ? m * out_widest : 0);
  const Staging stage{stage_x.data(), stage_out.data()};
#pragma omp parallel
  {
    for (int64_t l = 0; l < num_layers; ++l) {  // every `omp for` inside ends on a barrier
      const Layer& w = layers[l];
      const int64_t g = w.kv_group;
      T* k_cache = static_cast<T*>(w.k_cache);
      T* v_cache = static_cast<T*>(w.v_cache);
      qw::add_rms_norm(x, l == 0 ? nullptr : delta.data(), cast(w.input_norm), h.data(), m,
                       d.hidden, eps);
      project(w.qkv, h.data(), cast(w.qkv_bias), qkv.data(), m, qkv_width, d.hidden, shared,
              stage);
      if (w.q_norm != nullptr)
        qw::rms_norm_heads(qkv.data(), qkv_width, cast(w.q_norm), cast(w.k_norm), m, d.heads,
                           d.kv_heads, d.head_dim, eps);
      qw::rope_store(qkv.data(), qkv_width, w.cos != nullptr ? cast(w.cos) : cos,
                     w.sin != nullptr ? cast(w.sin) : sin, positions, group_slots[g], k_cache,
                     v_cache, m, d.heads, d.kv_heads, d.head_dim,
                     shapes[g].num_blocks * d.block_size);
      qw::decode_attention(qkv.data(), cast(k_cache), cast(v_cache), group_tables[g], lens,
                           attn.data(), shapes[g], scale, w.window);
      if (w.attn_out_norm != nullptr) {
        project(w.o, attn.data(), none, unnormed.data(), m, d.hidden, q_width, shared, stage);
        qw::add_rms_norm(unnormed.data(), none, cast(w.attn_out_norm), delta.data(), m, d.hidden,
                         eps);
      } else {
        project(w.o, attn.data(), none, delta.data(), m, d.hidden, q_width, shared, stage);
      }
      qw::add_rms_norm(x, delta.data(), cast(w.post_norm), h.data(), m, d.hidden, eps);
      if (w.experts != nullptr) {  // (no architecture with experts has Gemma's output norms)
        routed_mlp(*w.experts, w.activation, h.data(), delta.data(), m, d.hidden, experts,
                   shared, stage);
        continue;
      }
      project(w.gate_up, h.data(), none, gate_up.data(), m, 2 * d.inter, d.hidden, shared,
              stage);
      if (w.activation == kGeluTanh)
        qw::gelu_tanh_mul(gate_up.data(), act.data(), m, d.inter);
      else
        qw::silu_mul(gate_up.data(), act.data(), m, d.inter);
      if (w.mlp_out_norm != nullptr) {
        project(w.down, act.data(), none, unnormed.data(), m, d.hidden, d.inter, shared, stage);
        qw::add_rms_norm(unnormed.data(), none, cast(w.mlp_out_norm), delta.data(), m, d.hidden,
                         eps);
      } else {
        project(w.down, act.data(), none, delta.data(), m, d.hidden, d.inter, shared, stage);
      }
    }
    // as the model's tail: x[rows] + delta[rows], normed, through the LM head
#pragma omp for
    for (int64_t i = 0; i < head.num_rows; ++i) {
      std::memcpy(&picked[i * d.hidden], x + head.rows[i] * d.hidden, d.hidden * sizeof(T));
      std::memcpy(&picked_delta[i * d.hidden], &delta[head.rows[i] * d.hidden],
                  d.hidden * sizeof(T));
    }
    qw::add_rms_norm(picked.data(), picked_delta.data(), cast(head.norm), h.data(), head.num_rows,
                     d.hidden, eps);
    if (head.num_rows > 0) head_logits(head, h.data(), d.hidden, shared, stage);
  }
}

template <typename T>
int run(void* x, const Layer* layers, int64_t num_layers, const Head& head, const void* cos,
        const void* sin, const int64_t* positions, const int64_t* slots, const int64_t* tables,
        const int64_t* lens, const int64_t* window_slots, const int64_t* window_tables,
        int64_t m, const Dims& d, double eps, double scale) {
  const int64_t q_width = d.heads * d.head_dim, qkv_width = q_width + 2 * d.kv_heads * d.head_dim;
  bool served = head.num_rows <= m && (head.num_rows == 0 ||
                proj_serves<T>(*head.lm_head, head.num_rows, head.vocab, d.hidden));
  for (int64_t l = 0; l < num_layers && served; ++l) {
    const Layer& w = layers[l];
    served = (w.kv_group == 0 || (w.kv_group == 1 && window_slots && window_tables &&
                                  d.window_num_blocks > 0)) &&
             proj_serves<T>(w.qkv, m, qkv_width, d.hidden) &&
             proj_serves<T>(w.o, m, d.hidden, q_width) &&
             (w.experts != nullptr
                  ? experts_serve<T>(*w.experts, m, d.hidden) && w.mlp_out_norm == nullptr
                  : proj_serves<T>(w.gate_up, m, 2 * d.inter, d.hidden) &&
                        proj_serves<T>(w.down, m, d.hidden, d.inter));
  }
  if (!served) return 0;
  decode_step(static_cast<T*>(x), layers, num_layers, head,
              static_cast<const T*>(cos), static_cast<const T*>(sin), positions, slots, tables,
              lens, window_slots, window_tables, m, d, eps, scale);
  return 1;
}

struct AbiEntry {
  const char* name;  // "Struct" (its size) or "Struct.field" (its offset)
  int64_t value;
};

#define QW_SIZE(S) AbiEntry{#S, static_cast<int64_t>(sizeof(S))}
#define QW_FIELD(S, f) AbiEntry{#S "." #f, static_cast<int64_t>(offsetof(S, f))}
const AbiEntry kAbi[] = {
    QW_SIZE(QuantSegment), QW_FIELD(QuantSegment, blocks), QW_FIELD(QuantSegment, type),
    QW_FIELD(QuantSegment, method), QW_FIELD(QuantSegment, rows),
    QW_SIZE(Proj), QW_FIELD(Proj, pack), QW_FIELD(Proj, segments),
    QW_FIELD(Proj, num_segments), QW_FIELD(Proj, kernel),
    QW_SIZE(Layer), QW_FIELD(Layer, input_norm), QW_FIELD(Layer, qkv),
    QW_FIELD(Layer, qkv_bias), QW_FIELD(Layer, q_norm), QW_FIELD(Layer, k_norm),
    QW_FIELD(Layer, o), QW_FIELD(Layer, post_norm),
    QW_FIELD(Layer, gate_up), QW_FIELD(Layer, down), QW_FIELD(Layer, k_cache),
    QW_FIELD(Layer, v_cache), QW_FIELD(Layer, attn_out_norm), QW_FIELD(Layer, mlp_out_norm),
    QW_FIELD(Layer, cos), QW_FIELD(Layer, sin), QW_FIELD(Layer, experts),
    QW_FIELD(Layer, activation),
    QW_FIELD(Layer, window), QW_FIELD(Layer, kv_group),
    QW_SIZE(Experts), QW_FIELD(Experts, router), QW_FIELD(Experts, gate_up),
    QW_FIELD(Experts, down), QW_FIELD(Experts, count), QW_FIELD(Experts, top_k),
    QW_FIELD(Experts, normalize), QW_FIELD(Experts, inter), QW_FIELD(Experts, num_buckets),
    QW_FIELD(Experts, router_width),
    QW_FIELD(Experts, edges), QW_FIELD(Experts, num_edges),
    QW_SIZE(Dims), QW_FIELD(Dims, hidden), QW_FIELD(Dims, heads), QW_FIELD(Dims, kv_heads),
    QW_FIELD(Dims, head_dim), QW_FIELD(Dims, inter), QW_FIELD(Dims, num_blocks),
    QW_FIELD(Dims, block_size), QW_FIELD(Dims, max_blocks), QW_FIELD(Dims, vocab),
    QW_FIELD(Dims, window_num_blocks),
};

}  // namespace

// The size of a struct ("Layer") or the offset of a field ("Layer.qkv") as this build lays them
// out; -1 for a name it does not know.
extern "C" int64_t qw_decode_abi(const char* name) {
  for (const AbiEntry& e : kAbi)
    if (std::strcmp(e.name, name) == 0) return e.value;
  return -1;
}

// Each returns 0 when it did not compute (shape or CPU not served): the caller takes the
// layer-by-layer path.
#define QW_EXPORT_DECODE(suffix, T)                                                            \
  extern "C" int qw_decode_step_##suffix(                                                     \
      void* x, const Layer* layers, int64_t num_layers, const void* norm, const Proj* lm_head, \
      const int64_t* rows, int64_t num_rows, void* logits, const void* cos, const void* sin,   \
      const int64_t* positions, const int64_t* slots, const int64_t* tables,                   \
      const int64_t* lens, const int64_t* window_slots, const int64_t* window_tables,          \
      int64_t m, const Dims* dims, double eps, double scale) {                                 \
    const Head head{norm, lm_head, rows, num_rows, dims->vocab, logits};                       \
    return run<T>(x, layers, num_layers, head, cos, sin, positions, slots, tables, lens,       \
                  window_slots, window_tables, m, *dims, eps, scale);                          \
  }

QW_EXPORT_DECODE(f32, float)
QW_EXPORT_DECODE(bf16, qw::bf16)
