"""A decoder layer's gated MLP: the fused gate/up projection, act(gate) * up, then down. The
native path fuses SiLU or tanh GELU with the product (`native.silu_mul`, `gelu_tanh_mul`, which
the decode graph runs too); the torch path runs torch's."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from qworker.model.config import ModelConfig
from qworker.model.kernels import native
from qworker.model.kernels.linear import Linear

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": lambda gate: F.gelu(gate, approximate="tanh"),
}


FUSED: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": native.silu_mul, "gelu_tanh": native.gelu_tanh_mul,
}


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, intermediate_size: int | None = None) -> None:
        """intermediate_size: the config's where not given (an expert's is its own)."""
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * inter, bias=False)
        self.down_proj = Linear(inter, config.hidden_size, bias=False)
        self.activation = config.activation

    def forward(self, x: torch.Tensor, fused: bool) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if fused and self.activation in FUSED:
            return self.down_proj(FUSED[self.activation](gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(ACTIVATIONS[self.activation](gate) * up)
