// out = x W^T (+ bias) for bfloat16 on AMX tiles (amx_bf16), from the same pack as gemm.h: a
// block of 16 columns, k-major pairs ([n/16][k/2][16][2]), is what a B tile holds (16 rows of
// k-pairs x 16 columns), so 32 values of k of a block are one contiguous 1 KiB tile load.
// A register tile of up to 32 rows x 32 columns: tiles 0-3 accumulate (float), 4-5 hold two 16-row
// slices of x, 6-7 two blocks of W; each k step of 32 is 4 loads and 4 tile multiplies. Rows past
// the last full 16 come from a zero-padded copy. Threads split the columns evenly, and go through
// them in chunks of W that stay in L2 while every row group passes over them.
#pragma once

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#define QW_GEMM_AMX 1

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_tiles.h"
#include "common.h"
#include "gemm.h"

namespace qw::amx {

constexpr int64_t kChunkBytes = 256 << 10;  // of W per column chunk

inline bool serves(int64_t m, int64_t n, int64_t k) {
  return m >= 1 && n % kCols == 0 && k % kDepth == 0;
}

// the 1 KiB of W that tile load p of a block reads, fetched ahead of its use
inline void prefetch_tile(const bf16* block, int64_t p) {
  const char* at = reinterpret_cast<const char*>(block + p * kCols);
  for (int line = 0; line < 16; ++line) _mm_prefetch(at + 64 * line, _MM_HINT_T0);
}

// W's tiles are fetched kFetchAhead steps of k ahead (into the next blocks, `next`, near the end;
// null: none). On the Intel Xeon with AMX, the model's 32-row decode matmuls took 12.1 ms with it
// against 13.8-14.1 without, 64 rows 20.8 against 23.8-24.2 (2 threads; a step's weights stream
// from memory at ~30 GB/s there, 9 ms for SmolLM2-135M)
constexpr int64_t kFetchAhead = 4;
template <int NT>
void prefetch_ahead(const bf16* const* b, const bf16* const* next, int64_t p, int64_t k) {
  const int64_t q = p + kFetchAhead * kDepth;
  for (int j = 0; j < NT; ++j) {
    if (q < k) prefetch_tile(b[j], q);
    else if (next[j] != nullptr) prefetch_tile(next[j], q - k);
  }
}

// MT x NT tiles of 16 x 16: rows a[0..MT) (16 each, a_stride bytes apart), blocks b[0..NT) of W;
// the sums land in c, [MT * 16][NT * 16] floats. next: the blocks the following call reads
// (null: none)
template <int MT, int NT>
void tile_product(const bf16* const* a, int64_t a_stride, const bf16* const* b, int64_t k,
                  const bf16* const* next, float* c) {
  _tile_zero(0);
  if constexpr (NT > 1) _tile_zero(1);
  if constexpr (MT > 1) _tile_zero(2);
  if constexpr (MT > 1 && NT > 1) _tile_zero(3);
  for (int64_t p = 0; p < k; p += kDepth) {
    prefetch_ahead<NT>(b, next, p, k);
    _tile_loadd(4, a[0] + p, a_stride);
    if constexpr (MT > 1) _tile_loadd(5, a[1] + p, a_stride);
    _tile_loadd(6, b[0] + p * kCols, 64);
    if constexpr (NT > 1) _tile_loadd(7, b[1] + p * kCols, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NT > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (MT > 1) _tile_dpbf16ps(2, 5, 6);
    if constexpr (MT > 1 && NT > 1) _tile_dpbf16ps(3, 5, 7);
  }
  constexpr int64_t stride = NT * kCols * sizeof(float);
  _tile_stored(0, c, stride);
  if constexpr (NT > 1) _tile_stored(1, c + kCols, stride);
  if constexpr (MT > 1) _tile_stored(2, c + kRows * NT * kCols, stride);
  if constexpr (MT > 1 && NT > 1) _tile_stored(3, c + kRows * NT * kCols + kCols, stride);
}

// c's first `rows` rows (+ bias) to out's columns of blocks nb..nb+NT
template <int NT>
void write_out(const float* c, int64_t rows, const bf16* bias, bf16* out, int64_t n, int64_t nb) {
  using Op = GemmOp<bf16>;
  for (int j = 0; j < NT; ++j) {
    const int64_t col = (nb + j) * kCols;
    const __m512 b = bias != nullptr ? Op::widen(bias + col) : _mm512_setzero_ps();
    for (int64_t i = 0; i < rows; ++i)
      Op::narrow(out + i * n + col, _mm512_add_ps(_mm512_loadu_ps(c + i * NT * kCols + j * kCols), b));
  }
}

// rows [m0, m0 + rows) (rows <= 32) of the column blocks [nb0, nb1); the blocks up to fetch_end
// (this thread's) are fetched ahead
inline void row_group(const bf16* x, const bf16* padded, int64_t m0, int64_t rows, const bf16* wp,
                      const bf16* bias, bf16* out, int64_t n, int64_t k, int64_t nb0, int64_t nb1,
                      int64_t fetch_end) {
  const int64_t full = rows / kRows;  // 16-row slices read in place; a partial one from `padded`
  const bf16* a[2];
  for (int64_t s = 0; s < 2; ++s) a[s] = s < full ? x + (m0 + s * kRows) * k : padded;
  const int64_t a_stride = k * sizeof(bf16);
  alignas(64) float c[2 * kRows * 2 * kCols];
  const bool two_slices = rows > kRows;
  auto block = [&](int64_t nb) { return nb < fetch_end ? wp + nb * k * kCols : nullptr; };
  for (int64_t nb = nb0; nb < nb1; nb += 2) {
    const bf16* b[2] = {block(nb), block(nb + 1)};
    const bf16* next[2] = {block(nb + 2), block(nb + 3)};
    bf16* dst = out + m0 * n;
    if (nb + 1 < nb1) {
      if (two_slices) tile_product<2, 2>(a, a_stride, b, k, next, c);
      else tile_product<1, 2>(a, a_stride, b, k, next, c);
      write_out<2>(c, rows, bias, dst, n, nb);
    } else {
      if (two_slices) tile_product<2, 1>(a, a_stride, b, k, next, c);
      else tile_product<1, 1>(a, a_stride, b, k, next, c);
      write_out<1>(c, rows, bias, dst, n, nb);
    }
  }
}

// Shares the work among the threads of the enclosing OpenMP region (outside one: all on the
// calling thread). Only where serves().
inline void gemm(const bf16* x, const bf16* wp, const bf16* bias, bf16* out, int64_t m, int64_t n,
                 int64_t k) {
  const int64_t blocks = n / kCols, parts = omp_get_num_threads();
  const int64_t chunk = std::max<int64_t>(2, kChunkBytes / (k * kCols * sizeof(bf16)) / 2 * 2);
  const int64_t tail = m % kRows;  // rows past the last full 16, zero-padded to a whole slice
  thread_local std::vector<bf16> padded;
#pragma omp for schedule(static)
  for (int64_t part = 0; part < parts; ++part) {  // even shares of whole blocks
    const int64_t first = blocks * part / parts, end = blocks * (part + 1) / parts;
    if (first == end) continue;
    if (tail) {
      padded.assign(kRows * k, bf16{0});
      std::memcpy(padded.data(), x + (m - tail) * k, tail * k * sizeof(bf16));
    }
    configure();
    for (int64_t c0 = first; c0 < end; c0 += chunk)
      for (int64_t m0 = 0; m0 < m; m0 += 2 * kRows)
        row_group(x, padded.data(), m0, std::min(2 * kRows, m - m0), wp, bias, out, n, k, c0,
                  std::min(end, c0 + chunk), end);
    _tile_release();
  }
}

}  // namespace qw::amx

#endif
