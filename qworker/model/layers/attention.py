"""A decoder layer's self-attention: the fused q/k/v projection, each q and k head normed where
the architecture says (Qwen3, Gemma 3), rotary embedding (by the layer's own base where it has
one), the step's K/V written to the paged cache, attention over it (`paged_attention`, within the
layer's sliding window where it has one), the output projection."""

from __future__ import annotations

import torch
from torch import nn

from qworker.model.config import LayerAttention, ModelConfig
from qworker.model.kernels import native
from qworker.model.kernels.linear import Linear
from qworker.model.layers.norm import RMSNorm
from qworker.model.layers.paged_attention import AttentionPlan, paged_attention, write_kv
from qworker.model.layers.rope import rotate


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, attends: LayerAttention | None = None) -> None:
        super().__init__()
        self.attends = attends or LayerAttention()
        self.heads, self.kv_heads, self.head_dim = (
            config.num_heads, config.num_kv_heads, config.head_dim,
        )
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.split = (q_size + kv_size, kv_size)  # q and k are rotated together
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size,
                                  bias=config.attention_bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=False)
        qk_norm, eps = config.arch.qk_norm, config.rms_norm_eps
        float32_product = config.arch.norm_offset != 0.0
        self.q_norm = RMSNorm(self.head_dim, eps, float32_product) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps, float32_product) if qk_norm else None
        self.scale = config.attention_scale

    def forward(
        self, x: torch.Tensor, plan: AttentionPlan, cache_k: torch.Tensor, cache_v: torch.Tensor,
    ) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.q_norm is not None and self.k_norm is not None:
            self._norm_heads(qkv, self.q_norm, self.k_norm, plan.fused)
        theta = self.attends.rope_theta
        if plan.fused:
            rope = plan.rope_of(theta)
            native.rope_store(qkv, rope.cos, rope.sin, plan.batch.positions,
                              plan.batch.slot_mapping, cache_k, cache_v, self.heads)
            qk, v = qkv.split(self.split, dim=-1)
            qk = qk.view(n, self.heads + self.kv_heads, self.head_dim)
        else:
            qk, v = qkv.split(self.split, dim=-1)
            qk = rotate(qk.view(n, self.heads + self.kv_heads, self.head_dim),
                        *plan.rotation_of(theta))
        q, k = qk[:, : self.heads], qk[:, self.heads :]
        v = v.view(n, self.kv_heads, self.head_dim)
        if not plan.fused:
            write_kv(cache_k, cache_v, k, v, plan.batch.slot_mapping)
        out = paged_attention(q, k, v, cache_k, cache_v, plan, self.scale, self.attends.window)
        return self.o_proj(out.reshape(n, -1))

    def _norm_heads(self, qkv: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm,
                    fused: bool) -> None:
        """Each q head of qkv normed by q_norm, each k head by k_norm, in place. float64 (a
        reference-test dtype) keeps torch's norm, as the other norms do."""
        if fused and qkv.dtype != torch.float64:
            native.rms_norm_heads(qkv, q_norm.weight, k_norm.weight, self.heads, self.kv_heads,
                                  q_norm.eps)
            return
        width = (self.heads + self.kv_heads) * self.head_dim
        heads = qkv[:, :width].view(qkv.shape[0], -1, self.head_dim)
        heads[:, : self.heads] = q_norm(heads[:, : self.heads])
        heads[:, self.heads :] = k_norm(heads[:, self.heads :])
