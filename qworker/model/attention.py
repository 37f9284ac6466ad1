"""Paged attention: write a step's K/V into cache slots, then attend each token to its sequence.

The cache of one layer is `[kv_heads, blocks, block_size, head_dim]`. Decodes (one new token per
sequence) are attended in one batched call over their gathered blocks; prefill chunks one sequence
at a time, causal within the chunk and full over what was cached. Grouped-query attention is folded
into the query-length axis, so K/V are never repeated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qworker.model.batch import DecodeGroup, ForwardBatch, PrefillChunk


def write_kv(
    cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v: [N, kv_heads, head_dim] into the flat slots (block * block_size + offset)."""
    kv_heads, _, _, head_dim = cache_k.shape
    cache_k.view(kv_heads, -1, head_dim).index_copy_(1, slot_mapping, k.transpose(0, 1))
    cache_v.view(kv_heads, -1, head_dim).index_copy_(1, slot_mapping, v.transpose(0, 1))


def paged_attention(
    q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, batch: ForwardBatch,
    scale: float,
) -> torch.Tensor:
    """q: [N, heads, head_dim] (positions already rotated) -> [N, heads, head_dim]."""
    if batch.decode is not None and not batch.prefills:
        return _decode(q, cache_k, cache_v, batch.decode, scale)
    out = torch.empty_like(q)
    if batch.decode is not None:
        rows = batch.decode.token_index
        out[rows] = _decode(q[rows], cache_k, cache_v, batch.decode, scale)
    for chunk in batch.prefills:
        out[chunk.start : chunk.end] = _prefill(q[chunk.start : chunk.end], cache_k, cache_v,
                                                chunk, scale)
    return out


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Blocks of a [kv_heads, blocks, block_size, d] cache -> [kv_heads, len * block_size, d]."""
    kv_heads, _, block_size, head_dim = cache.shape
    picked = cache.index_select(1, block_ids)
    return picked.view(kv_heads, block_ids.numel() * block_size, head_dim)


def _decode(
    q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, group: DecodeGroup,
    scale: float,
) -> torch.Tensor:
    num, heads, head_dim = q.shape
    kv_heads = cache_k.shape[0]
    keys = _gather(cache_k, group.block_tables.flatten()).view(kv_heads, num, -1, head_dim)
    values = _gather(cache_v, group.block_tables.flatten()).view(kv_heads, num, -1, head_dim)
    length = keys.shape[2]
    visible = torch.arange(length, device=q.device)[None, :] < group.context_lens[:, None]
    grouped_q = q.view(num, kv_heads, heads // kv_heads, head_dim).transpose(0, 1)
    out = F.scaled_dot_product_attention(  # [kvh, D, g, d]: each sequence's g queries, its keys
        grouped_q, keys, values, attn_mask=visible[None, :, None, :], scale=scale
    )
    return out.transpose(0, 1).reshape(num, heads, head_dim)


def _prefill(
    q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, chunk: PrefillChunk,
    scale: float,
) -> torch.Tensor:
    num, heads, head_dim = q.shape
    kv_heads = cache_k.shape[0]
    group = heads // kv_heads
    total = chunk.num_cached + num
    keys = _gather(cache_k, chunk.block_table)[:, :total]  # [kvh, T, d]
    values = _gather(cache_v, chunk.block_table)[:, :total]
    # query i of the chunk sits at position num_cached + i and sees keys 0..num_cached + i
    query_pos = torch.arange(chunk.num_cached, total, device=q.device)
    visible = torch.arange(total, device=q.device)[None, :] <= query_pos[:, None]  # [n, T]
    grouped_q = q.view(num, kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [kvh, g, n, d]
    out = F.scaled_dot_product_attention(  # 4-D, so CPU takes its fused flash kernel
        grouped_q.reshape(1, kv_heads, group * num, head_dim), keys[None], values[None],
        attn_mask=visible.repeat(group, 1)[None, None], scale=scale,
    )  # [1, kvh, g * n, d]
    return out.view(kv_heads, group, num, head_dim).permute(2, 0, 1, 3).reshape(num, heads,
                                                                              head_dim)
