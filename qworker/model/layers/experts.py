"""Routed experts (Qwen3-MoE): a router scores each token against every expert, the token goes to
its top k by softmax (their weights rescaled to sum to 1 where the config normalizes), and its
output is the sum of those experts' gated MLPs, each times its weight.

The step's tokens are grouped by expert: each expert that any token chose runs once, one matmul
per projection over just its tokens (`index_select`), and adds its weighted rows back
(`index_add_`), experts in ascending order, as transformers sums them. Each expert is a gated MLP
of its own linear layers (`mlp.MLP`), so its kernels are chosen by measurement (all experts of a
layer share a shape, hence one measurement) and a GGUF's quantized experts stay in their blocks
(`QuantLinear`), one 2-D matrix of the file's 3-D tensor each. An expert sees any row count from
1 to the step's tokens; none runs for no rows.
"""

from __future__ import annotations

import torch
from torch import nn

from qworker.model.config import ModelConfig
from qworker.model.kernels import native
from qworker.model.kernels.padded_linear import PaddedLinear
from qworker.model.layers.mlp import MLP


class RoutedExperts(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        experts = config.experts
        assert experts is not None
        self.top_k = experts.per_token
        self.normalize = experts.normalize
        # the router (padded to the native GEMM's 16-column blocks, e.g. Mixtral's 8 columns)
        self.gate = PaddedLinear(config.hidden_size, experts.count)
        self.experts = nn.ModuleList(MLP(config, experts.intermediate_size)
                                     for _ in range(experts.count))

    def route(self, x: torch.Tensor, fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top k experts [n, k] and their weights [n, k] in x's dtype; where
        `fused` and the native kernels take x's dtype, by the native routing the decode graph
        runs (`native.route`: the same experts and weights as the graph's, bit for bit)."""
        logits = self.gate(x)
        if fused and x.dtype in native.GEMM_DTYPES and native.serves(x):
            chosen, weights = native.route(logits, self.top_k, self.normalize)
            return chosen, weights.to(x.dtype)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        return chosen, weights.to(x.dtype)

    def forward(self, x: torch.Tensor, fused: bool) -> torch.Tensor:
        chosen, weights = self.route(x, fused)
        flat = chosen.flatten()
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert
        tokens = order // self.top_k
        weight_of = weights.flatten()[order]
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(torch.bincount(flat, minlength=len(self.experts)).tolist()):
            if count:
                rows = tokens[start : start + count]
                y = self.experts[expert](x.index_select(0, rows), fused)
                out.index_add_(0, rows, y * weight_of[start : start + count, None])
                start += count
        return out
