"""One decoder layer: norm, attention, residual, norm, MLP (or routed experts, where the config
makes layer `index` sparse); the residual add fused with the next norm (the layer hands its output
on unadded)."""

from __future__ import annotations

import torch
from torch import nn

from qworker.model.config import ModelConfig
from qworker.model.layers.attention import Attention
from qworker.model.layers.experts import RoutedExperts
from qworker.model.layers.mlp import MLP
from qworker.model.layers.norm import RMSNorm
from qworker.model.layers.paged_attention import AttentionPlan


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        sparse = config.experts is not None and config.experts.sparse(index)
        self.mlp: MLP | RoutedExperts = RoutedExperts(config) if sparse else MLP(config)

    def forward(
        self, x: torch.Tensor, pending: torch.Tensor | None, plan: AttentionPlan,
        cache_k: torch.Tensor, cache_v: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream; pending: the previous layer's output, not yet added to it (so
        that the add fuses with this layer's norm). Returns both for the next layer."""
        x, h = self.input_layernorm.add_and_norm(x, pending, plan.fused)
        x, h = self.post_attention_layernorm.add_and_norm(
            x, self.self_attn(h, plan, cache_k, cache_v), plan.fused)
        return x, self.mlp(h, plan.fused)
