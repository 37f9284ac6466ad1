"""The "x8" layout: a Q4_0, Q4_1, Q5_0 or Q8_0 weight's rows in groups of 8, repacked once at load
and exactly as compact as the file's blocks (csrc/quant_x8.h documents it and runs it). For
each group and 32-value block index: the 8 rows' f16 scales side by side (then, for Q4_1, their
8 minimums; for Q5_0, the values' fifth bits), then their values interleaved so that a 32-bit
lane holds two values of one row.
The tensor keeps its shape [rows, row bytes]; only the order of the bytes changes.
"""

from __future__ import annotations

import numpy as np
import torch

X8_TYPES = frozenset({2, 3, 6, 8})  # ggml ids: Q4_0, Q4_1, Q5_0, Q8_0
_BLOCK_BYTES = {2: 18, 3: 20, 6: 22, 8: 34}
_Q5_0 = 6
GROUP_ROWS = 16  # the kernels take two groups at a time (a float32 GEMM panel is 16 rows)


def serves(type_id: int, rows: int, in_features: int) -> bool:
    return type_id in X8_TYPES and rows % GROUP_ROWS == 0 and in_features % 32 == 0


def _scale_bytes(type_id: int) -> int:
    return 4 if type_id == 3 else 2  # d (and Q4_1's minimum) as f16


def to_x8(type_id: int, raw: torch.Tensor) -> torch.Tensor:
    """Raw rows [n, row bytes] as the file stores them -> the same bytes in the x8 layout."""
    rows, row_bytes = raw.shape
    assert serves(type_id, rows, row_bytes // _BLOCK_BYTES[type_id] * 32), "not an x8 shape"
    nbytes, head = _BLOCK_BYTES[type_id], _scale_bytes(type_id)
    blocks = raw.numpy().reshape(rows // 8, 8, -1, nbytes)  # [g, r, b, bytes]
    groups, nb = blocks.shape[0], blocks.shape[2]
    scales = blocks[..., :head].reshape(groups, 8, nb, head // 2, 2)  # [g, r, b, which, 2]
    scales = scales.transpose(0, 2, 3, 1, 4).reshape(groups, nb, 8 * head)  # [g, b, which, r]
    values = _values(type_id, blocks[..., head:])  # [g, r, b, 32], uint8 (Q8_0: its int8 bits)
    parts = [scales]
    if type_id == _Q5_0:
        parts.append(_fifth_bits(values >> 4))
        values = values & 0xF
    if type_id == 8:  # chunk p, byte 2r + t: value 2p + t
        packed = values.reshape(groups, 8, nb, 16, 2).transpose(0, 2, 3, 1, 4)
    else:  # chunk c, 16-bit word 2r + t, nibble n = 2h + s (byte h, its low / high half):
        v = values.reshape(groups, 8, nb, 4, 2, 2, 2)  # value 8c + 4h + 2s + t: [g,r,b,c,h,s,t]
        v = v.transpose(0, 2, 3, 1, 6, 4, 5)  # [g, b, c, r, t, h, s]
        packed = v[..., 0] | (v[..., 1] << 4)
    out = np.concatenate([*parts, packed.reshape(groups, nb, -1)], axis=-1)
    return torch.from_numpy(np.ascontiguousarray(out).reshape(rows, row_bytes))


def from_x8(type_id: int, x8: torch.Tensor) -> torch.Tensor:
    """The inverse of to_x8: the rows as the file stores them."""
    rows, row_bytes = x8.shape
    nbytes, head = _BLOCK_BYTES[type_id], _scale_bytes(type_id)
    nb = row_bytes // nbytes
    group = x8.numpy().reshape(rows // 8, nb, 8 * nbytes)  # [g, b, group block]
    groups = group.shape[0]
    scales = group[..., : 8 * head].reshape(groups, nb, head // 2, 8, 2).transpose(0, 3, 1, 2, 4)
    packed = group[..., 8 * head :]
    if type_id == _Q5_0:
        high, packed = packed[..., :32], packed[..., 32:]
    if type_id == 8:
        values = packed.reshape(groups, nb, 16, 8, 2).transpose(0, 3, 1, 2, 4)
        qs = values.reshape(groups, 8, nb, 32)
    else:
        p = packed.reshape(groups, nb, 4, 8, 2, 2)  # [g, b, c, r, t, h]
        v = np.stack([p & 0xF, p >> 4], axis=-1)  # [g, b, c, r, t, h, s]
        v = v.transpose(0, 3, 1, 2, 5, 6, 4).reshape(groups, 8, nb, 32)  # value 8c+4h+2s+t
        qs = v[..., :16] | (v[..., 16:] << 4)  # the file's: byte j = value j | value j+16 << 4
        if type_id == _Q5_0:  # the file's qh (a little-endian 32-bit mask) before qs
            qs = np.concatenate([_mask_bytes(_unfifth_bits(high)), qs], axis=-1)
    out = np.concatenate([scales.reshape(groups, 8, nb, head), qs], axis=-1)
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.uint8).reshape(rows, row_bytes))


def _values(type_id: int, qs: np.ndarray) -> np.ndarray:
    """A block's 32 values in order, from its value bytes (after the scales; Q5_0: 0..31)."""
    if type_id == 8:
        return qs
    if type_id == _Q5_0:  # a 32-bit mask of fifth bits (value j: bit j), then the nibbles
        bits = np.unpackbits(qs[..., :4], axis=-1, bitorder="little")
        return _values(2, qs[..., 4:]) | (bits << 4)
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1)  # byte j: values j and j + 16


def _fifth_bits(high: np.ndarray) -> np.ndarray:
    """[g, r, b, 32] bits -> [g, b, 32] bytes: in half h, byte j = 2r + t holds at bit
    4 (c % 2) + n that of value 8c + 2n + t, c = 2h + c % 2."""
    h = high.reshape(*high.shape[:3], 2, 2, 4, 2)  # [g, r, b, h, c % 2, n, t]
    h = h.transpose(0, 2, 3, 1, 6, 4, 5)  # [g, b, h, r, t, c % 2, n]
    h = h.reshape(*h.shape[:5], 8)  # bit 4 (c % 2) + n
    return np.packbits(h, axis=-1, bitorder="little").reshape(h.shape[0], h.shape[1], 32)


def _unfifth_bits(packed: np.ndarray) -> np.ndarray:
    """The inverse of _fifth_bits: [g, b, 32] bytes -> [g, 8, b, 32] bits by value."""
    groups, nb = packed.shape[:2]
    bits = np.unpackbits(packed[..., None], axis=-1, bitorder="little")  # [g, b, 32, 8]
    h = bits.reshape(groups, nb, 2, 8, 2, 2, 4)  # [g, b, h, r, t, c % 2, n]
    return h.transpose(0, 3, 1, 2, 5, 6, 4).reshape(groups, 8, nb, 32)


def _mask_bytes(bits: np.ndarray) -> np.ndarray:
    """[..., 32] bits -> the 4 bytes of their little-endian 32-bit mask."""
    return np.packbits(bits, axis=-1, bitorder="little")
