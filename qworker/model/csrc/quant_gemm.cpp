// Linear layers over GGUF block-quantized weights (quant_gemm.h), for `qworker.model.quant_linear`.
// out[m, ldo] (its first n columns) = x[m, k] W^T, W [n rows of k/elems blocks], float32 in/out.
#include <omp.h>

#include <vector>

#include "quant_gemm.h"

namespace {

using namespace qw::quant;

template <int T>
void int8_rows(const std::vector<Q8Block>& xq, const uint8_t* w, int64_t m, int64_t n, int64_t k,
               float* out, int64_t ldo) {
  constexpr int64_t kRows = 4;  // activation rows per pass over a weight row
  const int64_t blocks = k / 32, row_bytes = blocks * format(T).bytes;
#pragma omp for schedule(static)
  for (int64_t r = 0; r < n; ++r) {
    const uint8_t* row = w + r * row_bytes;
    int64_t i = 0;
    for (; i + kRows <= m; i += kRows)
      rows_dot<T, kRows>(row, xq.data() + i * blocks, blocks, blocks, out + i * ldo + r, ldo);
    for (; i < m; ++i) rows_dot<T, 1>(row, xq.data() + i * blocks, blocks, blocks,
                                      out + i * ldo + r, ldo);
  }
}

int int8_gemm(int type, const float* x, int64_t m, int64_t k, const uint8_t* w, int64_t n,
              float* out, int64_t ldo) {
  std::vector<Q8Block> xq(static_cast<size_t>(m * (k / 32)));
  // few rows: quantized by the calling thread, which spares the thread team one barrier (a
  // barrier waits for every thread to be scheduled: on a busy machine, the larger cost)
#pragma omp parallel for schedule(static) if (m >= 64)
  for (int64_t i = 0; i < m; ++i) quantize_row_q8(x + i * k, k, xq.data() + i * (k / 32));
#pragma omp parallel
  {
    switch (type) {
      case Q4_0: int8_rows<Q4_0>(xq, w, m, n, k, out, ldo); break;
      case Q4_1: int8_rows<Q4_1>(xq, w, m, n, k, out, ldo); break;
      case Q5_0: int8_rows<Q5_0>(xq, w, m, n, k, out, ldo); break;
      case Q5_1: int8_rows<Q5_1>(xq, w, m, n, k, out, ldo); break;
      default: int8_rows<Q8_0>(xq, w, m, n, k, out, ldo); break;
    }
  }
  return 1;
}

int dequant_gemm(int type, const float* x, int64_t m, int64_t k, const uint8_t* w, int64_t n,
                 float* out, int64_t ldo) {
  const int64_t row_bytes = k / format(type).elems * format(type).bytes;
#pragma omp parallel
  {
    std::vector<float> row(static_cast<size_t>(k));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n; ++r) {
      dequant_row(type, w + r * row_bytes, k, row.data());
      for (int64_t i = 0; i < m; ++i) out[i * ldo + r] = dot_f32(x + i * k, row.data(), k);
    }
  }
  return 1;
}

}  // namespace

// method 0: integer dot on quantized activations; 1: rows dequantized to float32. Returns 0,
// computing nothing, where the method does not serve this type or shape.
extern "C" int qw_quant_gemm(int type, int method, const void* x, int64_t m, int64_t k,
                             const void* w, int64_t n, void* out, int64_t ldo) {
  const Format f = format(type);
  if (f.elems == 0 || k % f.elems || k % 32 || m <= 0 || ldo < n) return 0;
  const auto* xf = static_cast<const float*>(x);
  const auto* wb = static_cast<const uint8_t*>(w);
  auto* of = static_cast<float*>(out);
  if (method == 0) return int8_dot_serves(type) ? int8_gemm(type, xf, m, k, wb, n, of, ldo) : 0;
  if (method == 1) return dequant_gemm(type, xf, m, k, wb, n, of, ldo);
  return 0;
}

// rows ids[count] of W, dequantized: out [count, k] (a quantized embedding's lookup)
extern "C" int qw_quant_rows(int type, const void* w, const int64_t* ids, int64_t count,
                             int64_t k, void* out) {
  const Format f = format(type);
  if (f.elems == 0 || k % f.elems) return 0;
  const int64_t row_bytes = k / f.elems * f.bytes;
  for (int64_t i = 0; i < count; ++i)
    dequant_row(type, static_cast<const uint8_t*>(w) + ids[i] * row_bytes, k,
                static_cast<float*>(out) + i * k);
  return 1;
}
