"""RMSNorm, normalised in float32 whatever the model dtype, as the reference implementation does;
on the native path fused with the residual add that precedes it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qworker.model.kernels import native


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, float32_product: bool = False) -> None:
        """float32_product: scaled by the weight in float32, then cast (Gemma's order; Llama's
        casts first)."""
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.float32_product = float32_product

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalised in float32 whatever the model dtype, as the reference implementation does
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        if self.float32_product:
            return (normed * self.weight.float()).to(x.dtype)
        return self.weight * normed.to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor | None,
                     fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, its norm); `fused` updates x in place in one native pass. float64 (a
        reference-test dtype) keeps torch's float32 norm, bit for bit the reference's."""
        if fused and x.dtype != torch.float64:
            return x, native.add_rms_norm(x, delta, self.weight, self.eps)
        x = x if delta is None else x + delta
        return x, self(x)
