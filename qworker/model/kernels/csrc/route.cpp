// Routing of a routed-experts layer (route.h), and its export for the layer-by-layer path.
#include "route.h"

#include <cmath>
#include <vector>

namespace qw {

namespace {

// one row: softmax, then k passes that each take the largest probability not yet taken
void route_row(const float* logits, int64_t experts, int64_t k, bool normalize, int64_t* chosen,
               float* weights) {
  float top = logits[0];
  for (int64_t e = 1; e < experts; ++e) top = logits[e] > top ? logits[e] : top;
  std::vector<float> probs(experts);
  float sum = 0.0f;
  for (int64_t e = 0; e < experts; ++e) {
    probs[e] = std::exp(logits[e] - top);
    sum += probs[e];
  }
  for (int64_t e = 0; e < experts; ++e) probs[e] /= sum;
  std::vector<bool> taken(experts, false);
  for (int64_t s = 0; s < k; ++s) {
    int64_t best = -1;
    for (int64_t e = 0; e < experts; ++e)  // strictly greater: a tie keeps the lower index
      if (!taken[e] && (best < 0 || probs[e] > probs[best])) best = e;
    taken[best] = true;
    chosen[s] = best;
    weights[s] = probs[best];
  }
  if (normalize) {
    float total = 0.0f;
    for (int64_t s = 0; s < k; ++s) total += weights[s];
    for (int64_t s = 0; s < k; ++s) weights[s] /= total;
  }
}

}  // namespace

void route(const float* logits, int64_t n, int64_t experts, int64_t k, bool normalize,
           int64_t* chosen, float* weights) {
  for (int64_t i = 0; i < n; ++i)
    route_row(logits + i * experts, experts, k, normalize, chosen + i * k, weights + i * k);
}

}  // namespace qw

// the layer-by-layer path's routing (`qworker.model.kernels.native.route`)
extern "C" void qw_route(const float* logits, int64_t n, int64_t experts, int64_t k,
                         int64_t normalize, int64_t* chosen, float* weights) {
  qw::route(logits, n, experts, k, normalize != 0, chosen, weights);
}
