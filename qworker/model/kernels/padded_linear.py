"""A linear layer of few output columns (a routed-experts router: Mixtral's 8) whose native GEMM
pack is its weight padded with zero rows to whole 16-row blocks, so that the native GEMM (and the
decode graph, which runs only native kernels) takes it; the padding's columns are computed and
dropped. Each column of the native GEMM is computed on its own, so the kept columns are the ones
an unpadded pack would give."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qworker.model.kernels.linear import Linear

BLOCK = 16  # the native GEMM's column block


class PaddedLinear(Linear):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)  # (a bias would need padding)

    @property
    def padded_width(self) -> int:
        """Columns of the native pack (and of the decode graph's router output)."""
        return -(-self.out_features // BLOCK) * BLOCK

    def run(self, kind: str, x: torch.Tensor) -> torch.Tensor:
        out = super().run(kind, x)
        return out[:, : self.out_features] if out.shape[1] > self.out_features else out

    def _gemm_weight(self, weight: torch.Tensor) -> torch.Tensor:
        return F.pad(weight, (0, 0, 0, self.padded_width - self.out_features))
