"""One decoder layer: norm, attention, residual, norm, MLP (or routed experts, where the config
makes layer `index` sparse); the residual add fused with the next norm (the layer hands its output
on unadded). Where the architecture says (`post_norms`, Gemma), the attention's and the MLP's
outputs are normed too before they are added."""

from __future__ import annotations

import torch
from torch import nn

from qworker.model.config import LayerAttention, ModelConfig
from qworker.model.layers.attention import Attention
from qworker.model.layers.experts import RoutedExperts
from qworker.model.layers.mlp import MLP
from qworker.model.layers.norm import RMSNorm
from qworker.model.layers.paged_attention import AttentionPlan


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int = 0,
                 attends: LayerAttention | None = None) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        float32_product = config.arch.norm_offset != 0.0
        self.input_layernorm = RMSNorm(size, eps, float32_product)
        self.self_attn = Attention(config, attends)
        # Llama: the MLP's input norm; with post_norms, the attention output's
        self.post_attention_layernorm = RMSNorm(size, eps, float32_product)
        sparse = config.experts is not None and config.experts.sparse(index)
        self.mlp: MLP | RoutedExperts = RoutedExperts(config) if sparse else MLP(config)
        self.post_norms = config.arch.post_norms
        if self.post_norms:
            self.pre_feedforward_layernorm = RMSNorm(size, eps, float32_product)
            self.post_feedforward_layernorm = RMSNorm(size, eps, float32_product)

    def forward(
        self, x: torch.Tensor, pending: torch.Tensor | None, plan: AttentionPlan,
        cache_k: torch.Tensor, cache_v: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream; pending: the previous layer's output, not yet added to it (so
        that the add fuses with this layer's norm). Returns both for the next layer."""
        x, h = self.input_layernorm.add_and_norm(x, pending, plan.fused)
        attended = self.self_attn(h, plan, cache_k, cache_v)
        if not self.post_norms:
            x, h = self.post_attention_layernorm.add_and_norm(x, attended, plan.fused)
            return x, self.mlp(h, plan.fused)
        _, attended = self.post_attention_layernorm.add_and_norm(attended, None, plan.fused)
        x, h = self.pre_feedforward_layernorm.add_and_norm(x, attended, plan.fused)
        _, out = self.post_feedforward_layernorm.add_and_norm(self.mlp(h, plan.fused), None,
                                                              plan.fused)
        return x, out
