"""A linear layer whose weight is repacked once, on the CPU, into the layout of the fastest matmul
there. A pack is a copy, redone whenever the weight changes in place.

- bfloat16 and float32 on AVX-512: the native GEMM (`native.gemm`), 1.1-3x oneDNN's speed at
  decode batch sizes on the development machine and level with it at 2,048 rows;
- elsewhere on the CPU: oneDNN's blocked layout, packed once (`F.linear` reorders the weight on
  every call: up to 2x slower at decode batch sizes);
- anything else (CUDA, float64): `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qworker.model import native

ONEDNN_DTYPES = (torch.float32, torch.bfloat16)
BATCH_HINT = 64  # rows oneDNN tunes its layout for; any row count works


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class Linear(nn.Linear):
    _pack_state: tuple[int, str, torch.Tensor | None] | None = None  # weight version, kind, pack

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kind, packed = self.pack()
        if kind == "native" and x.shape[0] > 0:
            return native.gemm(x, packed, self.bias)
        if kind == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def pack(self) -> tuple[str, torch.Tensor | None]:
        """("native" | "onednn" | "plain", the packed weight), packed on first use."""
        version = self.weight._version
        if self._pack_state is None or self._pack_state[0] != version:
            self._pack_state = (version, *self._make_pack())
        return self._pack_state[1], self._pack_state[2]

    def _make_pack(self) -> tuple[str, torch.Tensor | None]:
        weight = self.weight
        if (packed := native.gemm_pack(weight)) is not None:
            return "native", packed
        if weight.device.type == "cpu" and weight.dtype in ONEDNN_DTYPES and packing_available():
            return "onednn", torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)
        return "plain", None
