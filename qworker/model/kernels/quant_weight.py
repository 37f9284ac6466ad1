"""A weight kept in its GGUF block format: each output row is its blocks, as the file stores
them, or (Q4_0, Q4_1, Q5_0, Q8_0, where the kernel choice takes it) the same bytes repacked
once into groups of 8 rows (`quant_interleave`), so the resident bytes are the file's. A fused
projection (q/k/v, gate/up) whose parts have different formats (Q4_K_M files mix Q4_K and Q6_K)
is a list of segments, each a run of rows of one format.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from qworker.model.kernels import quant_interleave as interleave

# ggml type id -> (name, values per block, bytes per block)
FORMATS: dict[int, tuple[str, int, int]] = {
    2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
}
TYPE_IDS = {name: type_id for type_id, (name, _, _) in FORMATS.items()}
INT8_DOT_TYPES = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"})  # the int8 dot serves
INT16_DOT_TYPES = INT8_DOT_TYPES | {"Q4_K", "Q6_K"}  # the int16 dot serves


@dataclass(frozen=True)
class Segment:
    type_id: int
    raw: torch.Tensor  # uint8 [rows, row_bytes], contiguous
    x8: bool = False  # raw's bytes in the 8-row interleaved layout (quant_interleave)

    @property
    def name(self) -> str:
        return FORMATS[self.type_id][0]

    @property
    def rows(self) -> int:
        return int(self.raw.shape[0])


@dataclass(frozen=True)
class QuantWeight:
    segments: tuple[Segment, ...]
    in_features: int

    def __post_init__(self) -> None:
        for seg in self.segments:
            _, elems, nbytes = FORMATS[seg.type_id]
            assert seg.raw.dtype == torch.uint8 and seg.raw.is_contiguous()
            assert self.in_features % elems == 0
            assert seg.raw.shape[1] == self.in_features // elems * nbytes, "row bytes"

    @classmethod
    def of(cls, type_name: str, raw: torch.Tensor, in_features: int) -> QuantWeight:
        return cls((Segment(TYPE_IDS[type_name], raw.contiguous()),), in_features)

    @property
    def shape(self) -> tuple[int, int]:
        return sum(seg.rows for seg in self.segments), self.in_features

    @property
    def nbytes(self) -> int:
        return sum(seg.raw.numel() for seg in self.segments)

    @property
    def type_names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(seg.name for seg in self.segments))

    @property
    def x8_serves(self) -> bool:
        """Every segment can take (or has) the 8-row interleaved layout."""
        return all(interleave.serves(seg.type_id, seg.rows, self.in_features)
                   for seg in self.segments)

    @property
    def is_x8(self) -> bool:
        return all(seg.x8 for seg in self.segments)

    def to_x8(self) -> QuantWeight:
        """The same weight with its bytes repacked into the x8 layout (a new copy)."""
        assert self.x8_serves and not any(seg.x8 for seg in self.segments)
        return QuantWeight(tuple(Segment(seg.type_id, interleave.to_x8(seg.type_id, seg.raw),
                                         x8=True) for seg in self.segments), self.in_features)

    def map_rows(self, fn: object) -> QuantWeight:
        """The same weight with each segment's raw rows passed through fn (a row permutation)."""
        assert callable(fn) and len(self.segments) == 1
        seg = self.segments[0]
        assert not seg.x8, "rows of an interleaved weight are not rows of raw"
        return QuantWeight((Segment(seg.type_id, fn(seg.raw).contiguous()),), self.in_features)

    @staticmethod
    def cat(parts: list[QuantWeight]) -> QuantWeight:
        """Rows of every part, in order (neighbouring segments of one format merged)."""
        assert len({p.in_features for p in parts}) == 1
        merged: list[Segment] = []
        for seg in (s for p in parts for s in p.segments):
            assert not seg.x8, "interleaved once loaded, never concatenated"
            if merged and merged[-1].type_id == seg.type_id:
                merged[-1] = Segment(seg.type_id, torch.cat([merged[-1].raw, seg.raw]))
            else:
                merged.append(seg)
        return QuantWeight(tuple(merged), parts[0].in_features)

    def dequantize(self, rows: slice | None = None) -> torch.Tensor:
        """float32 [n, k] (or the given rows), by gguf's own reference dequantization."""
        import gguf

        out = []
        for seg in self.segments:
            kind = gguf.GGMLQuantizationType(seg.type_id)
            raw = interleave.from_x8(seg.type_id, seg.raw) if seg.x8 else seg.raw
            out.append(torch.from_numpy(np.ascontiguousarray(
                gguf.quants.dequantize(raw.numpy(), kind), dtype=np.float32)))
        full = torch.cat(out).reshape(self.shape)
        return full if rows is None else full[rows]
