// A routed-experts layer's routing (Qwen3-MoE, Mixtral): each row's softmax over the router's
// logits (in float32), its top k experts, their weights rescaled to sum to 1 where normalized.
// One compiled function serves both the layer-by-layer path (`native.route`) and the decode
// graph, so both pick the same experts with the same weights bit for bit (ties: the lower
// expert index first).
#pragma once

#include <cstdint>

namespace qw {

// logits [n, experts] -> chosen [n, k] (best first) and their weights [n, k]
void route(const float* logits, int64_t n, int64_t experts, int64_t k, bool normalize,
           int64_t* chosen, float* weights);

}  // namespace qw
