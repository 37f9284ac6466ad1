"""All decoder layers of a decode-only step in one native call (`csrc/decoder.cpp`): the CPU's
stand-in for a captured CUDA graph.

It runs the kernels of the layer-by-layer path, in the same order on the same kinds of buffers, so
its results are the same; what it saves is that path's per-op Python, tensor allocations and
thread wake-ups (a single-stream step: 12.7 -> 9.5 ms here). It serves steps whose every row is a
single-token decode, on models whose projections all take the native GEMM; others (and any step it
declines) go layer by layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from qworker.model import native
from qworker.model.config import ModelConfig
from qworker.model.kv_cache import KVCache

if TYPE_CHECKING:
    from qworker.model.attention import AttentionPlan
    from qworker.model.batch import DecodeGroup
    from qworker.model.llama import DecoderLayer


@dataclass(frozen=True)
class _LayerTable:
    cache: KVCache  # held, so that a later cache can never reuse its identity
    versions: tuple[int, ...]  # of every weight, when the table was made
    addresses: torch.Tensor | None  # [layers, 9]; None: this model is not served
    keep: tuple[torch.Tensor, ...]  # what the addresses point into


class DecodeGraph:
    def __init__(self, layers: list[DecoderLayer], config: ModelConfig) -> None:
        self.layers = layers
        self.config = config
        self.weights = [p for layer in layers for p in layer.parameters()]
        self.enabled = True  # off: every step goes layer by layer (benchmarks compare the two)
        self._table: _LayerTable | None = None

    def run(self, x: torch.Tensor, plan: AttentionPlan, cache: KVCache) -> torch.Tensor | None:
        """The last layer's output, not yet added to x (x, the residual stream, is updated in
        place); None, with x untouched, where this step or model is not served."""
        batch = plan.batch
        served = plan.fused and not batch.prefills and x.dtype in native.GEMM_DTYPES
        if not (self.enabled and served):
            return None
        addresses = self._addresses(cache)
        if addresses is None:
            return None
        c = self.config
        tables, lens = _in_row_order(batch.decodes, x.shape[0])
        dims = (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
                cache.num_blocks, cache.block_size)
        delta = torch.empty_like(x)
        done = native.decode_layers(
            x, delta, addresses, plan.rope.cos, plan.rope.sin, batch.positions,
            batch.slot_mapping, tables, lens, dims, c.rms_norm_eps, c.head_dim**-0.5)
        return delta if done else None

    def _addresses(self, cache: KVCache) -> torch.Tensor | None:
        versions = tuple(w._version for w in self.weights)
        table = self._table
        if table is None or table.cache is not cache or table.versions != versions:
            table = self._table = self._make_table(cache, versions)
        return table.addresses

    def _make_table(self, cache: KVCache, versions: tuple[int, ...]) -> _LayerTable:
        rows, keep = [], []
        for layer, k, v in zip(self.layers, cache.keys, cache.values, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            packs = [lin.pack() for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                            mlp.down_proj)]
            if any(kind != "native" for kind, _ in packs) or not native.serves(k):
                return _LayerTable(cache, versions, None, ())
            (_, qkv), (_, o), (_, gate_up), (_, down) = packs
            bias = attn.qkv_proj.bias
            parts = [layer.input_layernorm.weight, qkv, bias, o,
                     layer.post_attention_layernorm.weight, gate_up, down, k, v]
            assert all(p is None or p.is_contiguous() for p in parts)
            rows.append([0 if p is None else p.data_ptr() for p in parts])
            keep.extend(p for p in parts if p is not None)
        return _LayerTable(cache, versions, torch.tensor(rows, dtype=torch.int64), tuple(keep))


def _in_row_order(groups: tuple[DecodeGroup, ...], rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables [rows, max_blocks] and context lengths [rows] of all decode groups, by row."""
    if len(groups) == 1 and isinstance(groups[0].rows, slice) and groups[0].rows == slice(0, rows):
        return groups[0].block_tables, groups[0].context_lens
    width = max(g.block_tables.shape[1] for g in groups)
    tables = torch.zeros((rows, width), dtype=torch.int64)
    lens = torch.zeros(rows, dtype=torch.int64)
    for g in groups:
        tables[g.rows, : g.block_tables.shape[1]] = g.block_tables
        lens[g.rows] = g.context_lens
    return tables, lens
