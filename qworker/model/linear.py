"""A linear layer whose weight is prepacked once into oneDNN's blocked layout on the CPU.

(With a few rows of bfloat16, a native kernel that streams the weight once goes first: see
`native.small_matmul`.)

torch's `F.linear` reorders a bfloat16 / float32 weight for oneDNN on every call; packing it once
makes decode-sized matmuls up to twice as fast (same products, same sums in bfloat16). The pack
is a copy, redone whenever the weight changes in place; other devices and dtypes use `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qworker.model import native

PACKABLE = (torch.float32, torch.bfloat16)
BATCH_HINT = 64  # rows oneDNN tunes the layout for; any row count works


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class Linear(nn.Linear):
    _packed: torch.Tensor | None = None
    _packed_version: int = -1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= native.SMALL_MATMUL_ROWS:  # a few rows: bound by reading the weight
            out = native.small_matmul(x, self.weight, self.bias)
            if out is not None:
                return out
        packed = self._pack()
        if packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")

    def _pack(self) -> torch.Tensor | None:
        weight = self.weight
        if weight.device.type != "cpu" or weight.dtype not in PACKABLE or not packing_available():
            return None
        if self._packed is None or self._packed_version != weight._version:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)
            self._packed_version = weight._version
        return self._packed
