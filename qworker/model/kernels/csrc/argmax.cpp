// Greedy sampling's argmax over float32 logits (`qworker.model.native.argmax`): the first maximum
// of each row, as torch's `max(dim).indices` gives it, in one vectorized pass. torch tracks the
// index element by element (0.1-0.3 ms for one 151,936-token row); here 16 lanes keep their best
// value and its first index, and the lanes are reduced at the end (ties: the lower index).
#include <cstdint>
#include <limits>

namespace {

constexpr int kLanes = 16;
constexpr int64_t kParallelElements = 1 << 18;  // below this, threads cost more than they save

int64_t row_argmax(const float* x, int64_t cols) {
  float best[kLanes];
  int32_t at[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    best[l] = -std::numeric_limits<float>::infinity();
    at[l] = -1;
  }
  const int64_t whole = cols / kLanes * kLanes;
  for (int64_t i = 0; i < whole; i += kLanes) {
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) {
      const float v = x[i + l];
      const bool better = v > best[l];  // strictly: a lane keeps its first maximum
      best[l] = better ? v : best[l];
      at[l] = better ? static_cast<int32_t>(i + l) : at[l];
    }
  }
  float top = -std::numeric_limits<float>::infinity();
  int64_t index = -1;
  for (int l = 0; l < kLanes; ++l) {
    if (at[l] >= 0 && (best[l] > top || (best[l] == top && at[l] < index))) {
      top = best[l];
      index = at[l];
    }
  }
  for (int64_t i = whole; i < cols; ++i) {
    if (x[i] > top) {  // after every lane's index: only a larger value wins
      top = x[i];
      index = i;
    }
  }
  return index < 0 ? 0 : index;  // every value -inf: the first, as torch
}

}  // namespace

// logits: `rows` rows of `cols` floats, `stride` floats apart; out[r]: row r's first maximum
extern "C" void qw_argmax_f32(const float* logits, int64_t stride, int64_t rows, int64_t cols,
                              int64_t* out) {
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelElements)
  for (int64_t r = 0; r < rows; ++r) out[r] = row_argmax(logits + r * stride, cols);
}
