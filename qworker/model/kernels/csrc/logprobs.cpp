// Log-probabilities straight from raw float32 logits (`qworker.model.native.logprobs`), without
// materializing log_softmax: per asked row, its log-sum-exp, the chosen token's logprob and the
// k most likely tokens, best first (the lower id first among equal logits). Two passes over a
// row that stays in L2: each chunk's max, then the sum of exp (libmvec's vector expf). The top k
// then scans only the chunks whose max reaches the k-th largest chunk max: every element of the
// others is below k elements of the row.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <vector>

namespace {

constexpr int64_t kChunk = 256;  // float partial sums and maxes per chunk
constexpr int64_t kParallelElements = 1 << 15;  // below this, threads cost more than they save

// maxes[c]: the max of chunk c; returns the row's max
float chunk_maxes(const float* x, int64_t vocab, std::vector<float>& maxes) {
  for (size_t c = 0; c < maxes.size(); ++c) {
    const int64_t start = static_cast<int64_t>(c) * kChunk;
    const int64_t end = std::min(start + kChunk, vocab);
    float m = x[start];
#pragma omp simd reduction(max : m)
    for (int64_t i = start + 1; i < end; ++i) m = std::max(m, x[i]);
    maxes[c] = m;
  }
  return *std::max_element(maxes.begin(), maxes.end());
}

double log_sum_exp(const float* x, int64_t vocab, float m) {
  double total = 0;  // chunks' float sums added in double: no long float accumulation
  for (int64_t start = 0; start < vocab; start += kChunk) {
    const int64_t end = std::min(start + kChunk, vocab);
    float partial = 0;
#pragma omp simd reduction(+ : partial)
    for (int64_t i = start; i < end; ++i) partial += std::exp(x[i] - m);
    total += partial;
  }
  return static_cast<double>(m) + std::log(total);
}

// values/ids: the k best of the row, best first; needs vocab >= k
void top_k(const float* x, int64_t vocab, int64_t k, std::vector<float>& maxes, float* values,
           int64_t* ids) {
  const auto chunks = static_cast<int64_t>(maxes.size());
  bool every_chunk = k > chunks;
  float bound = 0;  // the k-th largest chunk max: at most the row's k-th best value
  if (!every_chunk) {
    std::vector<float> sorted(maxes);
    std::nth_element(sorted.begin(), sorted.begin() + (k - 1), sorted.end(), std::greater<>());
    bound = sorted[k - 1];
  }
  int64_t filled = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    if (!every_chunk && maxes[c] < bound) continue;
    for (int64_t i = c * kChunk; i < std::min((c + 1) * kChunk, vocab); ++i) {
      const float v = x[i];
      if (filled == k && v <= values[k - 1]) continue;
      int64_t at = std::min(filled, k - 1);  // after every value >= v: ties keep the lower id
      while (at > 0 && values[at - 1] < v) {
        values[at] = values[at - 1];
        ids[at] = ids[at - 1];
        --at;
      }
      values[at] = v;
      ids[at] = i;
      filled = std::min(filled + 1, k);
    }
  }
}

}  // namespace

// logits: rows `stride` floats apart; rows[r] (of n) is the row asked, chosen[r] its token.
// Writes chosen_out[r] and, for k > 0, top_values / top_ids [n, k] (logprobs, token ids).
extern "C" void qw_logprobs_f32(const float* logits, int64_t stride, const int64_t* rows,
                                int64_t n, int64_t vocab, const int64_t* chosen, int64_t k,
                                float* chosen_out, float* top_values, int64_t* top_ids) {
#pragma omp parallel for schedule(static) if (n * vocab >= kParallelElements)
  for (int64_t r = 0; r < n; ++r) {
    const float* x = logits + rows[r] * stride;
    std::vector<float> maxes((vocab + kChunk - 1) / kChunk);
    const double lse = log_sum_exp(x, vocab, chunk_maxes(x, vocab, maxes));
    chosen_out[r] = static_cast<float>(x[chosen[r]] - lse);
    if (k == 0) continue;
    float* values = top_values + r * k;
    top_k(x, vocab, k, maxes, values, top_ids + r * k);
    for (int64_t j = 0; j < k; ++j) values[j] = static_cast<float>(values[j] - lse);
  }
}
