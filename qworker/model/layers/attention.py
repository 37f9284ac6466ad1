"""A decoder layer's self-attention: the fused q/k/v projection, rotary embedding, the step's K/V
written to the paged cache, attention over it (`paged_attention`), the output projection."""

from __future__ import annotations

import torch
from torch import nn

from qworker.model.config import ModelConfig
from qworker.model.kernels import native
from qworker.model.kernels.linear import Linear
from qworker.model.layers.paged_attention import AttentionPlan, paged_attention, write_kv
from qworker.model.layers.rope import rotate


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (
            config.num_heads, config.num_kv_heads, config.head_dim,
        )
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.split = (q_size + kv_size, kv_size)  # q and k are rotated together
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size,
                                  bias=config.attention_bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=False)
        self.scale = self.head_dim**-0.5

    def forward(
        self, x: torch.Tensor, plan: AttentionPlan, cache_k: torch.Tensor, cache_v: torch.Tensor,
    ) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        if plan.fused:
            native.rope_store(qkv, plan.rope.cos, plan.rope.sin, plan.batch.positions,
                              plan.batch.slot_mapping, cache_k, cache_v, self.heads)
            qk, v = qkv.split(self.split, dim=-1)
            qk = qk.view(n, self.heads + self.kv_heads, self.head_dim)
        else:
            qk, v = qkv.split(self.split, dim=-1)
            qk = rotate(qk.view(n, self.heads + self.kv_heads, self.head_dim), *plan.rotation)
        q, k = qk[:, : self.heads], qk[:, self.heads :]
        v = v.view(n, self.kv_heads, self.head_dim)
        if not plan.fused:
            write_kv(cache_k, cache_v, k, v, plan.batch.slot_mapping)
        out = paged_attention(q, k, v, cache_k, cache_v, plan, self.scale)
        return self.o_proj(out.reshape(n, -1))
