"""Paged attention: write a step's K/V into cache slots, then attend each token to its sequence.

The cache of one layer is `[kv_heads, blocks, block_size, head_dim]`, read as rows of whole blocks
(`[kv_heads * blocks, block_size * head_dim]`): a sequence's keys are one `index_select` of rows,
already in the `[kv_heads, tokens, head_dim]` layout attention consumes. Decodes (one new token per
sequence) are attended in two batched matmuls per group of similar lengths; prefill chunks one at a
time, by the native flash kernel where it serves the cache (first and later chunks alike: it reads
the cached context in place), else by PyTorch's fused SDPA kernel. Grouped-query attention is
folded into the query axis: K/V are never repeated.

A layer with a sliding window (a token sees itself and the window - 1 before it) tells the native
kernels its window; on the torch path, where some sequence of the step is longer than the window,
its masks hide what lies before each token's window (`AttentionPlan.windowed`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from qworker.model.batch import DecodeGroup, ForwardBatch
from qworker.model.kernels import native
from qworker.model.layers.rope import RotaryTable


@dataclass(frozen=True)
class DecodePlan:
    group: DecodeGroup
    # for the torch path only (the native kernel reads the cache in place):
    block_rows: torch.Tensor | None = None  # block rows of the group's sequences, heads-major
    bias: torch.Tensor | None = None  # [1, D, 1, L]: 0 where visible, -inf past each context


@dataclass(frozen=True)
class AttentionPlan:
    """What every layer's attention needs from a batch, computed once per forward."""

    batch: ForwardBatch
    rope: RotaryTable
    fused: bool  # native kernels serve this cache: rope + store, norms and activations fused
    decodes: tuple[DecodePlan, ...]
    prefill_rows: tuple[torch.Tensor, ...]
    prefill_masks: tuple[torch.Tensor | None, ...]  # [1, 1, group * n, T]; None: nothing cached
    prefill_skipped: tuple[int, ...]  # positions before each chunk's rows (whole blocks)
    cache_k: torch.Tensor  # layer 0's: the geometry and dtype every layer's cache shares
    group: int  # query heads per KV head
    ropes: dict[float, RotaryTable] = field(default_factory=dict)  # layers' own bases, unscaled
    _windowed: dict[int, AttentionPlan] = field(default_factory=dict)
    _rotations: dict[float, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def build(cls, batch: ForwardBatch, cache_k: torch.Tensor, rope: RotaryTable,
              group: int, ropes: dict[float, RotaryTable] | None = None,
              window: int | None = None) -> AttentionPlan:
        """`window`: the plan of a layer with that sliding window on the torch path."""
        kv_heads, num_blocks, block_size, _ = cache_k.shape
        device = cache_k.device
        heads = torch.arange(kv_heads, device=device)[:, None] * num_blocks
        native_attention = native.serves(cache_k) and window is None

        def rows(block_ids: torch.Tensor) -> torch.Tensor:
            return (heads + block_ids.flatten()[None, :]).flatten()

        decodes = []
        for d in batch.decodes:
            if native_attention:  # the kernel reads the cache in place
                decodes.append(DecodePlan(d))
                continue
            tables, first = d.block_tables, torch.zeros_like(d.context_lens)
            if window is not None:  # only the blocks the window can see
                tables, first = _window_blocks(d.block_tables, d.context_lens, window, block_size)
            width = tables.shape[1] * block_size
            key_pos = first[:, None] * block_size + torch.arange(width, device=device)[None, :]
            hidden = key_pos >= d.context_lens[:, None]
            if window is not None:
                hidden |= key_pos < d.context_lens[:, None] - window
            bias = torch.zeros(hidden.shape, dtype=_score_dtype(cache_k.dtype), device=device)
            bias.masked_fill_(hidden, float("-inf"))
            decodes.append(DecodePlan(d, rows(tables), bias[None, :, None]))
        masks: list[torch.Tensor | None] = []
        skipped = []  # positions before a chunk's first block its window sees
        for chunk in batch.prefills:
            skip = 0 if window is None else (
                max(0, chunk.num_cached - window + 1) // block_size * block_size)
            skipped.append(skip)
            if window is None and (chunk.num_cached == 0 or native_attention):
                masks.append(None)  # causal by itself, or the kernel masks by itself
                continue
            total = chunk.num_cached + chunk.end - chunk.start
            query_pos = torch.arange(chunk.num_cached, total, device=device)[:, None]
            key_pos = torch.arange(skip, total, device=device)[None, :]
            visible = key_pos <= query_pos
            if window is not None:
                visible &= key_pos > query_pos - window
            masks.append(visible.repeat(group, 1)[None, None])
        prefill_rows = tuple(rows(c.block_table[skip // block_size:])
                             for c, skip in zip(batch.prefills, skipped, strict=True))
        return cls(batch, rope, native.serves(cache_k), tuple(decodes), prefill_rows,
                   tuple(masks), tuple(skipped), cache_k, group, ropes or {})

    def windowed(self, window: int) -> AttentionPlan:
        """On the torch path, the plan of a layer that sees only `window` positions up to each
        token: this one where no sequence of the step is longer, else one whose masks hide the
        rest (made once per forward)."""
        if self.longest_context <= window:
            return self
        if window not in self._windowed:
            self._windowed[window] = AttentionPlan.build(
                self.batch, self.cache_k, self.rope, self.group, self.ropes, window)
        return self._windowed[window]

    @functools.cached_property
    def longest_context(self) -> int:
        """The most positions any token of the step attends to, without a window."""
        batch = self.batch
        decoded = [int(d.context_lens.max()) for d in batch.decodes]
        return max([*decoded, *(c.num_cached + c.end - c.start for c in batch.prefills), 0])

    def rope_of(self, theta: float | None) -> RotaryTable:
        """The model's table (None), or the one of a layer's own base."""
        return self.rope if theta is None else self.ropes[theta]

    def rotation_of(self, theta: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        """`rotation` by the table of a layer's own base (None: the model's)."""
        if theta is None:
            return self.rotation
        if theta not in self._rotations:
            self._rotations[theta] = self.ropes[theta].lookup(self.batch.positions)
        return self._rotations[theta]


    @functools.cached_property
    def rotation(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, 1, head_dim] rotary cos / sin of every token's position."""
        return self.rope.lookup(self.batch.positions)


def _window_blocks(tables: torch.Tensor, lens: torch.Tensor, window: int,
                   block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Of each row's blocks, the few its window can see: [D, n] block ids from each row's first
    visible block on (past its table: its last again, every position there hidden), and the
    index of that first block [D]."""
    first = (lens - window).clamp(min=0) // block_size
    count = min(tables.shape[1], (window - 1) // block_size + 2)
    index = first[:, None] + torch.arange(count, device=tables.device)[None, :]
    return tables.gather(1, index.clamp(max=tables.shape[1] - 1)), first


def _score_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def write_kv(
    cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v: [N, kv_heads, head_dim] into the flat slots (block * block_size + offset)."""
    kv_heads, _, _, head_dim = cache_k.shape
    cache_k.view(kv_heads, -1, head_dim).index_copy_(1, slot_mapping, k.transpose(0, 1))
    cache_v.view(kv_heads, -1, head_dim).index_copy_(1, slot_mapping, v.transpose(0, 1))


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_k: torch.Tensor,
    cache_v: torch.Tensor, plan: AttentionPlan, scale: float, window: int | None = None,
) -> torch.Tensor:
    """q: [N, heads, head_dim], k / v: [N, kv_heads, head_dim] of the step's tokens (rotated,
    already written to the cache) -> [N, heads, head_dim]. `window`: the layer's sliding window."""
    if window is not None and not plan.fused:
        plan = plan.windowed(window)
    only = plan.decodes[0] if len(plan.decodes) == 1 and not plan.batch.prefills else None
    if only is not None and isinstance(only.group.rows, slice):  # every row, in order
        return _decode(q, cache_k, cache_v, only, scale, window)
    out = torch.empty_like(q)
    for d in plan.decodes:
        out[d.group.rows] = _decode(q[d.group.rows], cache_k, cache_v, d, scale, window)
    for chunk, block_rows, mask, skipped in zip(plan.batch.prefills, plan.prefill_rows,
                                                plan.prefill_masks, plan.prefill_skipped,
                                                strict=True):
        rows = slice(chunk.start, chunk.end)
        if plan.fused:  # read back from the cache just written, after its cached tokens
            hides = window is not None and chunk.num_cached + chunk.end - chunk.start > window
            out[rows] = native.prefill_attention(q[rows], cache_k, cache_v, chunk.block_table,
                                                 chunk.num_cached, scale,
                                                 window if hides else None)
        elif mask is None:  # a first chunk: its own keys are all there is, causal
            out[rows] = _causal(q[rows], k[rows], v[rows], scale)
        else:
            out[rows] = _prefill(q[rows], cache_k, cache_v, block_rows, mask,
                                 chunk.num_cached - skipped, scale)
    return out


def _gather(cache: torch.Tensor, block_rows: torch.Tensor) -> torch.Tensor:
    """Block rows of a [kv_heads, blocks, block_size, d] cache -> [kv_heads, tokens, d]."""
    kv_heads, num_blocks, block_size, head_dim = cache.shape
    picked = cache.view(kv_heads * num_blocks, block_size * head_dim).index_select(0, block_rows)
    return picked.view(kv_heads, -1, head_dim)


def _decode(
    q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, plan: DecodePlan,
    scale: float, window: int | None = None,
) -> torch.Tensor:
    """`window` for the native kernel (always given, as the decode graph gives it: the same
    kernel); the torch path's plan has it in its bias."""
    if plan.block_rows is None or plan.bias is None:
        return native.decode_attention(q, cache_k, cache_v, plan.group.block_tables,
                                       plan.group.context_lens, scale, window)
    num, heads, head_dim = q.shape
    kv_heads = cache_k.shape[0]
    keys = _gather(cache_k, plan.block_rows).view(kv_heads, num, -1, head_dim)
    values = _gather(cache_v, plan.block_rows).view(kv_heads, num, -1, head_dim)
    grouped_q = q.view(num, kv_heads, heads // kv_heads, head_dim).transpose(0, 1)  # [kvh,D,g,d]
    # a handful of queries per sequence: two batched matmuls beat the fused kernel here
    scores = torch.matmul(grouped_q, keys.transpose(-1, -2)).to(plan.bias.dtype)
    weights = torch.softmax(scores * scale + plan.bias, dim=-1).to(q.dtype)
    out = torch.matmul(weights, values)  # [kvh, D, g, d]
    return out.transpose(0, 1).reshape(num, heads, head_dim)


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    out = F.scaled_dot_product_attention(  # [1, heads, n, d]
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        is_causal=True, scale=scale, enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def _prefill(
    q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, block_rows: torch.Tensor,
    mask: torch.Tensor, num_cached: int, scale: float,
) -> torch.Tensor:
    """num_cached: the tokens of `block_rows` before the chunk."""
    num, heads, head_dim = q.shape
    kv_heads = cache_k.shape[0]
    group = heads // kv_heads
    total = num_cached + num
    keys = _gather(cache_k, block_rows)[:, :total]  # [kvh, T, d]
    values = _gather(cache_v, block_rows)[:, :total]
    grouped_q = q.view(num, kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [kvh, g, n, d]
    out = F.scaled_dot_product_attention(  # 4-D, so CPU takes its fused flash kernel
        grouped_q.reshape(1, kv_heads, group * num, head_dim), keys[None], values[None],
        attn_mask=mask, scale=scale,
    )  # [1, kvh, g * n, d]
    return out.view(kv_heads, group, num, head_dim).permute(2, 0, 1, 3).reshape(num, heads,
                                                                              head_dim)
