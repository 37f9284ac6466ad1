// Linear layers over GGUF block-quantized weights (quant_gemm.h), for `qworker.model.quant_linear`.
// out[m, ldo] (its first n columns) = x[m, k] W^T, W [n rows of k/elems blocks], float32 in/out.
#include <omp.h>

#include <vector>

#include "quant_gemm.h"

// method 0: integer dot on 8-bit activations; 1: rows dequantized to float32; 2: integer dot on
// 16-bit activations; 3 and 4: 2 and 1 on weights in the x8 layout (quant_x8.h); 5: bfloat16
// panels of the x8 layout against bfloat16 activations (AVX512-BF16 builds). Returns 0,
// computing nothing, where the method does not serve this type or shape.
extern "C" int qw_quant_gemm(int type, int method, const void* x, int64_t m, int64_t k,
                             const void* w, int64_t n, void* out, int64_t ldo) {
  using namespace qw::quant;
  if (!serves(type, method, m, k, n, ldo)) return 0;
  std::vector<ActBlock> shared(static_cast<size_t>(m > kPrivateRows ? m * (k / 32) : 0));
#pragma omp parallel
  team_gemm(type, method, static_cast<const float*>(x), m, k, static_cast<const uint8_t*>(w), n,
            static_cast<float*>(out), ldo, shared.data());
  return 1;
}

// rows ids[count] of W, dequantized: out [count, k] (a quantized embedding's lookup)
extern "C" int qw_quant_rows(int type, const void* w, const int64_t* ids, int64_t count,
                             int64_t k, void* out) {
  using namespace qw::quant;
  const Format f = format(type);
  if (f.elems == 0 || k % f.elems) return 0;
  const int64_t row_bytes = k / f.elems * f.bytes;
  for (int64_t i = 0; i < count; ++i)
    dequant_row(type, static_cast<const uint8_t*>(w) + ids[i] * row_bytes, k,
                static_cast<float*>(out) + i * k);
  return 1;
}

// the same for a weight in the x8 layout (quant_x8.h)
extern "C" int qw_quant_rows_x8(int type, const void* w, const int64_t* ids, int64_t count,
                                int64_t k, void* out) {
  using namespace qw::quant;
  if (!x8_serves(type) || k % format(type).elems) return 0;
  for (int64_t i = 0; i < count; ++i)
    x8_dequant_row(type, static_cast<const uint8_t*>(w), ids[i], k,
                   static_cast<float*>(out) + i * k);
  return 1;
}
