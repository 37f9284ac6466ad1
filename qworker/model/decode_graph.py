"""A decode-only step's decoder layers, final norm and LM head in one native call
(`csrc/decoder.cpp`): the CPU's stand-in for a captured CUDA graph.

It runs the kernels of the layer-by-layer path, in the same order on the same kinds of buffers, so
its results are the same; what it saves is that path's per-op Python, tensor allocations and
thread wake-ups (a single-stream step: 11.6 -> 7.9 ms here). It serves steps whose every row is a
single-token decode, at a row count for which every projection and the LM head run the native GEMM
(as `kernel_choice` measured, or by default); others (and any step it declines) go layer by
layer.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from qworker.model import kernel_choice, native
from qworker.model.config import ModelConfig
from qworker.model.decode_abi import DecodeDims, DecodeLayer, field_names
from qworker.model.kv_cache import KVCache

if TYPE_CHECKING:
    from qworker.model.attention import AttentionPlan
    from qworker.model.batch import DecodeGroup
    from qworker.model.linear import Linear
    from qworker.model.llama import DecoderLayer, RMSNorm


@dataclass(frozen=True)
class _LayerTable:
    cache: KVCache  # held, so that a later cache can never reuse its identity
    versions: tuple[int, ...]  # of every weight, when the table was made
    layers: ctypes.Array[DecodeLayer] | None  # None: this model is not served
    lm_head: torch.Tensor | None  # its pack
    buckets: frozenset[int]  # the kernel_choice buckets at which every layer runs native
    keep: tuple[torch.Tensor, ...]  # what the layers' pointers point into


class DecodeGraph:
    def __init__(self, layers: list[DecoderLayer], norm: RMSNorm, lm_head: Linear,
                 config: ModelConfig) -> None:
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head
        self.config = config
        self.enabled = True  # off: every step goes layer by layer (benchmarks compare the two)
        self._table: _LayerTable | None = None

    def reset(self) -> None:
        """Forget the table (after the layers' kernel choice changed)."""
        self._table = None

    def run(self, x: torch.Tensor, plan: AttentionPlan, cache: KVCache) -> torch.Tensor | None:
        """Logits of the batch's `logits_indices` rows, in the model's dtype (x, the residual
        stream, is updated in place); None, with x untouched, where this step or model is not
        served."""
        batch = plan.batch
        served = (plan.fused and batch.decodes and not batch.prefills
                  and x.dtype in native.GEMM_DTYPES)
        if not (self.enabled and served):
            return None
        table = self._layer_table(cache)
        if table.layers is None or table.lm_head is None:
            return None
        if kernel_choice.bucket(x.shape[0]) not in table.buckets:
            return None
        c = self.config
        tables, lens = _in_row_order(batch.decodes, x.shape[0])
        dims = DecodeDims(hidden=c.hidden_size, heads=c.num_heads, kv_heads=c.num_kv_heads,
                          head_dim=c.head_dim, inter=c.intermediate_size,
                          num_blocks=cache.num_blocks, block_size=cache.block_size)
        return native.decode_step(
            x, table.layers, self.norm.weight, table.lm_head, batch.logits_indices,
            plan.rope.cos, plan.rope.sin, batch.positions, batch.slot_mapping, tables, lens, dims,
            c.rms_norm_eps, c.head_dim**-0.5)

    def _layer_table(self, cache: KVCache) -> _LayerTable:
        versions = tuple(w._version for w in self._weights())
        table = self._table
        if table is None or table.cache is not cache or table.versions != versions:
            table = self._table = self._make_table(cache, versions)
        return table

    def _weights(self) -> list[torch.Tensor]:
        """Read afresh each step: holding them would keep a released weight alive."""
        weights = [p for layer in self.layers for p in layer.parameters()]
        return [*weights, self.norm.weight, *self.lm_head.parameters()]

    def _make_table(self, cache: KVCache, versions: tuple[int, ...]) -> _LayerTable:
        linears = [self.lm_head]
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears += (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        buckets = frozenset(b for b, size in enumerate(kernel_choice.BUCKETS)
                            if all(lin.kind_for(size) == "native" for lin in linears))
        rows: list[DecodeLayer] = []
        keep: list[torch.Tensor] = []
        for layer, k, v in zip(self.layers, cache.keys, cache.values, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            packs = [lin.packed("native") for lin in projections] if buckets else [None]
            if any(pack is None for pack in packs) or not native.serves(k):
                return _LayerTable(cache, versions, None, None, frozenset(), ())
            qkv, o, gate_up, down = packs
            parts = {"input_norm": layer.input_layernorm.weight, "qkv": qkv,
                     "qkv_bias": attn.qkv_proj.bias, "o": o,
                     "post_norm": layer.post_attention_layernorm.weight, "gate_up": gate_up,
                     "down": down, "k_cache": k, "v_cache": v}
            rows.append(_pointing_at(parts))
            keep.extend(p for p in parts.values() if p is not None)
        return _LayerTable(cache, versions, (DecodeLayer * len(rows))(*rows),
                           self.lm_head.packed("native"), buckets, tuple(keep))


def _pointing_at(parts: dict[str, torch.Tensor | None]) -> DecodeLayer:
    """A layer whose every field (by its C name) points at that tensor's data; null for None."""
    assert parts.keys() == set(field_names(DecodeLayer)), "ctypes ignores a misspelt field"
    assert all(p is None or p.is_contiguous() for p in parts.values())
    return DecodeLayer(**{name: None if p is None else p.data_ptr() for name, p in parts.items()})


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
