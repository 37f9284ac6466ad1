"""A decoder layer's gated MLP: the fused gate/up projection, SiLU(gate) * up, then down."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qworker.model.config import ModelConfig
from qworker.model.kernels import native
from qworker.model.kernels.linear import Linear


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, fused: bool) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if fused:
            return self.down_proj(native.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
