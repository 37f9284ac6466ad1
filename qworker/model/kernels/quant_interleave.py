"""The "x8" layout: a Q4_0, Q4_1, Q5_0, Q8_0, Q4_K or Q6_K weight's rows in groups of 8, repacked
once at load and exactly as compact as the file's blocks (csrc/quant_x8.h documents it and runs
it). For each group and block index: the 8 rows' f16 scales side by side (then, for Q4_1, their
8 minimums; for Q5_0, the values' fifth bits; for the K-quants, each 32-value sub-block's scales
and minimums of the 8 rows), then their values interleaved so that a 32-bit lane holds two
values of one row.
The tensor keeps its shape [rows, row bytes]; only the order of the bytes changes.
"""

from __future__ import annotations

import numpy as np
import torch

X8_TYPES = frozenset({2, 3, 6, 8, 12, 14})  # ggml ids: Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K
_BLOCK_BYTES = {2: 18, 3: 20, 6: 22, 8: 34, 12: 144, 14: 210}
_Q5_0, _Q4_K, _Q6_K = 6, 12, 14
_K_QUANTS = frozenset({_Q4_K, _Q6_K})  # 256 values a block, in 8 sub-blocks of 32
GROUP_ROWS = 16  # the kernels take two groups at a time (a float32 GEMM panel is 16 rows)


def serves(type_id: int, rows: int, in_features: int) -> bool:
    elems = 256 if type_id in _K_QUANTS else 32
    return type_id in X8_TYPES and rows % GROUP_ROWS == 0 and in_features % elems == 0


def _scale_bytes(type_id: int) -> int:
    return 4 if type_id == 3 else 2  # d (and Q4_1's minimum) as f16


def to_x8(type_id: int, raw: torch.Tensor) -> torch.Tensor:
    """Raw rows [n, row bytes] as the file stores them -> the same bytes in the x8 layout."""
    rows, row_bytes = raw.shape
    if type_id in _K_QUANTS:
        assert serves(type_id, rows, row_bytes // _BLOCK_BYTES[type_id] * 256), "not x8"
        return _k_to_x8(type_id, raw)
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
    else:
        packed = _pack_nibbles(values)
    out = np.concatenate([*parts, packed.reshape(groups, nb, -1)], axis=-1)
    return torch.from_numpy(np.ascontiguousarray(out).reshape(rows, row_bytes))


def from_x8(type_id: int, x8: torch.Tensor) -> torch.Tensor:
    """The inverse of to_x8: the rows as the file stores them."""
    rows, row_bytes = x8.shape
    if type_id in _K_QUANTS:
        return _k_from_x8(type_id, x8)
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
        v = _unpack_nibbles(packed.reshape(groups, nb, 128))
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


def _pack_nibbles(values: np.ndarray) -> np.ndarray:
    """[g, r, b, 32] values below 16 -> [g, b, 128]: chunk c, 16-bit word 2r + t, nibble
    n = 2h + s (byte h, its low / high half) holds row r's value 8c + 2n + t."""
    groups, nb = values.shape[0], values.shape[2]
    v = values.reshape(groups, 8, nb, 4, 2, 2, 2)  # value 8c + 4h + 2s + t: [g, r, b, c, h, s, t]
    v = v.transpose(0, 2, 3, 1, 6, 4, 5)  # [g, b, c, r, t, h, s]
    return (v[..., 0] | (v[..., 1] << 4)).reshape(groups, nb, 128)


def _unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """The inverse of _pack_nibbles: [g, b, 128] -> [g, r, b, 32]."""
    groups, nb = packed.shape[:2]
    p = packed.reshape(groups, nb, 4, 8, 2, 2)  # [g, b, c, r, t, h]
    v = np.stack([p & 0xF, p >> 4], axis=-1)  # [g, b, c, r, t, h, s]
    return v.transpose(0, 3, 1, 2, 5, 6, 4).reshape(groups, 8, nb, 32)  # value 8c + 4h + 2s + t


def _pack_pairs_of_bits(high: np.ndarray) -> np.ndarray:
    """[g, r, b, 32] values below 4 -> [g, b, 64]: chunk c's byte 2r + t holds at bits 2n, 2n + 1
    row r's value 8c + 2n + t (the bytes of chunk c widen to its 16-bit words)."""
    groups, nb = high.shape[0], high.shape[2]
    h = high.reshape(groups, 8, nb, 4, 4, 2).transpose(0, 2, 3, 1, 5, 4)  # [g, b, c, r, t, n]
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)
    return np.bitwise_or.reduce(h << shifts, axis=-1).astype(np.uint8).reshape(groups, nb, 64)


def _unpack_pairs_of_bits(packed: np.ndarray) -> np.ndarray:
    """The inverse of _pack_pairs_of_bits: [g, b, 64] -> [g, r, b, 32]."""
    groups, nb = packed.shape[:2]
    p = packed.reshape(groups, nb, 4, 8, 2, 1)  # [g, b, c, r, t, -]
    h = (p >> np.array([0, 2, 4, 6], dtype=np.uint8)) & 3  # [g, b, c, r, t, n]
    return h.transpose(0, 3, 1, 2, 5, 4).reshape(groups, 8, nb, 32)


def _q4k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A Q4_K block's 12 scale bytes [..., 12] -> its 8 sub-blocks' 6-bit scales and minimums."""
    q = packed.astype(np.uint8)
    low, high = q[..., 0:4], q[..., 8:12]
    scales = np.concatenate([low & 63, (high & 0xF) | ((low >> 6) << 4)], axis=-1)
    mins = np.concatenate([q[..., 4:8] & 63, (high >> 4) | ((q[..., 4:8] >> 6) << 4)], axis=-1)
    return scales, mins


def _q4k_scale_bytes(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """The inverse of _q4k_scales: [..., 8] each -> the 12 bytes."""
    out = np.empty((*scales.shape[:-1], 12), dtype=np.uint8)
    out[..., 0:4] = (scales[..., :4] & 63) | ((scales[..., 4:] >> 4) << 6)
    out[..., 4:8] = (mins[..., :4] & 63) | ((mins[..., 4:] >> 4) << 6)
    out[..., 8:12] = (scales[..., 4:] & 0xF) | ((mins[..., 4:] & 0xF) << 4)
    return out


def _k_values(type_id: int, blocks: np.ndarray) -> np.ndarray:
    """[..., block bytes] -> [..., 256] values in order: Q4_K 0..15, Q6_K 0..63 (unsigned)."""
    if type_id == _Q4_K:
        qs = blocks[..., 16:144].reshape(*blocks.shape[:-1], 4, 32)  # 64 values a chunk
        return np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(*blocks.shape[:-1], 256)
    ql = blocks[..., 0:128].reshape(*blocks.shape[:-1], 2, 64)
    qh = blocks[..., 128:192].reshape(*blocks.shape[:-1], 2, 1, 32)
    low = np.concatenate([ql & 0xF, ql >> 4], axis=-1).reshape(*ql.shape[:-1], 4, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3  # [..., 2, 4, 32]
    return (low | (high << 4)).reshape(*blocks.shape[:-1], 256)


def _k_value_bytes(type_id: int, values: np.ndarray) -> np.ndarray:
    """The inverse of _k_values: [..., 256] -> the block's value bytes (Q4_K's qs; Q6_K's ql
    and qh)."""
    lead = values.shape[:-1]
    if type_id == _Q4_K:
        v = values.reshape(*lead, 4, 2, 32)
        return (v[..., 0, :] | (v[..., 1, :] << 4)).reshape(*lead, 128)
    v = values.reshape(*lead, 2, 4, 32)
    low = (v & 0xF).reshape(*lead, 2, 2, 64)
    ql = (low[..., 0, :] | (low[..., 1, :] << 4)).reshape(*lead, 128)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]
    qh = np.bitwise_or.reduce((v >> 4) << shifts, axis=-2).astype(np.uint8)
    return np.concatenate([ql, qh.reshape(*lead, 64)], axis=-1)


def _k_to_x8(type_id: int, raw: torch.Tensor) -> torch.Tensor:
    """Q4_K group block (1,152 bytes): 8 d, 8 dmin (f16); for each sub-block s, byte 32 + 8s + r
    row r's scale | (its minimum & 3) << 6, and byte 96 + 4s + r % 4 in nibble r // 4 the rest
    of its minimum; then each sub-block's values as Q4_0's 128 bytes.
    Q6_K (1,680 bytes): 8 d; for each sub-block s, 16 bytes at 16 + 16s: the 8 rows' int8 scales
    of its values 0-15, then of 16-31; then each sub-block's low 4 bits as Q4_0's 128 bytes and
    its high 2 bits as 64 (`_pack_pairs_of_bits`)."""
    rows, row_bytes = raw.shape
    nbytes = _BLOCK_BYTES[type_id]
    blocks = raw.numpy().reshape(rows // 8, 8, -1, nbytes)  # [g, r, b, bytes]
    groups, nb = blocks.shape[0], blocks.shape[2]
    values = _k_values(type_id, blocks).reshape(groups, 8, nb * 8, 32)  # by sub-block
    if type_id == _Q4_K:
        halves = blocks[..., 0:4].reshape(groups, 8, nb, 2, 2).transpose(0, 2, 3, 1, 4)
        scales, mins = _q4k_scales(blocks[..., 4:16])  # [g, r, b, 8]
        low = (scales | ((mins & 3) << 6)).transpose(0, 2, 3, 1)  # [g, b, s, r]
        rest = (mins >> 2).transpose(0, 2, 3, 1)
        nibbles = rest[..., :4] | (rest[..., 4:] << 4)  # [g, b, s, 4]
        parts = [halves.reshape(groups, nb, 32), low.reshape(groups, nb, 64),
                 nibbles.reshape(groups, nb, 32), _pack_nibbles(values).reshape(groups, nb, -1)]
    else:
        d = blocks[..., 208:210].transpose(0, 2, 1, 3).reshape(groups, nb, 16)
        scales = blocks[..., 192:208].reshape(groups, 8, nb, 8, 2).transpose(0, 2, 3, 4, 1)
        low = _pack_nibbles(values & 0xF).reshape(groups, nb, 8, 128)
        high = _pack_pairs_of_bits(values >> 4).reshape(groups, nb, 8, 64)
        parts = [d, scales.reshape(groups, nb, 128),
                 np.concatenate([low, high], axis=-1).reshape(groups, nb, -1)]
    out = np.concatenate(parts, axis=-1)
    return torch.from_numpy(np.ascontiguousarray(out).reshape(rows, row_bytes))


def _k_from_x8(type_id: int, x8: torch.Tensor) -> torch.Tensor:
    """The inverse of _k_to_x8."""
    rows, row_bytes = x8.shape
    nbytes = _BLOCK_BYTES[type_id]
    nb = row_bytes // nbytes
    group = x8.numpy().reshape(rows // 8, nb, 8 * nbytes)
    groups = group.shape[0]
    if type_id == _Q4_K:
        halves = group[..., 0:32].reshape(groups, nb, 2, 8, 2).transpose(0, 3, 1, 2, 4)
        low = group[..., 32:96].reshape(groups, nb, 8, 8).transpose(0, 3, 1, 2)  # [g, r, b, s]
        nibbles = group[..., 96:128].reshape(groups, nb, 8, 4)
        rest = np.concatenate([nibbles & 0xF, nibbles >> 4], axis=-1).transpose(0, 3, 1, 2)
        scales, mins = low & 63, (low >> 6) | (rest << 2)
        values = _unpack_nibbles(group[..., 128:].reshape(groups, nb * 8, 128))
        head = [halves.reshape(groups, 8, nb, 4), _q4k_scale_bytes(scales, mins)]
        out = np.concatenate([*head, _k_value_bytes(type_id, values.reshape(groups, 8, nb,
                                                                             256))], axis=-1)
    else:
        d = group[..., 0:16].reshape(groups, nb, 8, 2).transpose(0, 2, 1, 3)
        scales = group[..., 16:144].reshape(groups, nb, 8, 2, 8).transpose(0, 4, 1, 2, 3)
        subs = group[..., 144:].reshape(groups, nb * 8, 192)
        values = _unpack_nibbles(np.ascontiguousarray(subs[..., :128])) | (
            _unpack_pairs_of_bits(np.ascontiguousarray(subs[..., 128:])) << 4)
        out = np.concatenate([_k_value_bytes(type_id, values.reshape(groups, 8, nb, 256)),
                              scales.reshape(groups, 8, nb, 16), d], axis=-1)
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.uint8).reshape(rows, row_bytes))
