"""The token embedding: `nn.Embedding`, whose rows may instead come from a pack that already
holds them (the tied LM head's native pack, a quantized weight), so the weight is not kept twice."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from qworker.model.kernels import native
from qworker.model.kernels.quant_weight import QuantWeight, Segment

RowLookup = Callable[[torch.Tensor], torch.Tensor]  # token ids [t] -> rows [t, hidden]


class Embedding(nn.Embedding):
    lookup: RowLookup | None = None  # set once the weight is released
    quant: object = None  # the QuantWeight the lookup reads, if it is one (counted, reported)

    def reset_parameters(self) -> None:
        if self.weight.device.type != "meta":  # on meta, normal_ imports torch._refs: 1.5-4 s
            super().reset_parameters()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.lookup is not None:
            return self.lookup(ids)
        return super().forward(ids)

    def release_to(self, lookup: RowLookup, device: torch.device | None = None) -> None:
        """Rows from `lookup` from now on; the weight becomes a stand-in of its shape and dtype
        (one element, broadcast; on `device`, else the weight's)."""
        weight = self.weight
        where = weight.device if device is None else device
        stand_in = torch.zeros((), dtype=weight.dtype, device=where).expand(weight.shape)
        self.weight = nn.Parameter(stand_in, requires_grad=False)
        self.lookup = lookup


def quant_lookup(weight: QuantWeight, dtype: torch.dtype) -> RowLookup:
    """Token ids -> rows of a quantized embedding, dequantized, in `dtype`."""
    assert len(weight.segments) == 1
    seg = weight.segments[0]
    k = weight.in_features

    def lookup(ids: torch.Tensor) -> torch.Tensor:
        if native.library() is not None:
            rows = native.quant_rows(seg.type_id, seg.raw, ids.reshape(-1), k, x8=seg.x8)
        else:
            assert not seg.x8, "the x8 layout is only made where the native kernels run"
            picked = Segment(seg.type_id, seg.raw[ids.reshape(-1)].contiguous())
            rows = QuantWeight((picked,), k).dequantize()
        return rows.to(dtype).reshape(*ids.shape, k)

    return lookup
