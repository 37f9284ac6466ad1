"""A decode-only step's decoder layers, final norm and LM head in one native call
(`csrc/decoder.cpp`): the CPU's stand-in for a captured CUDA graph.

It runs the kernels of the layer-by-layer path, in the same order on the same kinds of buffers, so
its results are the same; what it saves is that path's per-op Python, tensor allocations and
thread wake-ups (a single-stream step: 11.6 -> 7.9 ms here). It serves steps whose every row is a
single-token decode, at a row count for which every projection and the LM head run a native
kernel (as `kernel_choice` measured, or by default): the native GEMM of a dense layer, or the
chosen kernel of a layer kept in GGUF blocks (`QuantLinear`: in float32 as that layer runs it; a
bfloat16 step's activations converted to float32 for it and its results back, as the layer
does). Others (and any step it declines) go layer by layer.

It reads the architecture's declaration (`ModelConfig.arch`): what the graph runs (q/k biases and
norms, SiLU and tanh GELU, Gemma's norms after attention and MLP, a layer's own RoPE base, the
attention scale, routed experts: the router, `native.route`'s routing, each chosen expert over
its rows at its own row count's kernels, `_experts`) it runs; a model that asks for anything else
is refused once, with one log line, and every step of it goes layer by layer (`refusal`). A new
feature of a declaration is refused here until decoder.cpp runs it. A layer's sliding window it
hands the decode attention kernel, as the layer-by-layer path does, and a layer of a model's
windowed KV group (`KVCache.layer_groups`) its group's block tables and slots.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import structlog
import torch
from torch import nn

from qworker.model.batch import DecodeGroup
from qworker.model.config import ModelConfig
from qworker.model.kernels import kernel_choice, native
from qworker.model.kernels.decode_abi import (
    ACTIVATIONS,
    GEMM_KERNELS,
    DecodeDims,
    DecodeExperts,
    DecodeLayer,
    DecodeProj,
    DecodeQuantSegment,
    field_names,
)
from qworker.model.kernels.linear import Linear
from qworker.model.kernels.padded_linear import PaddedLinear
from qworker.model.kernels.quant_linear import QuantLinear
from qworker.model.kv_cache import KVCache
from qworker.model.layers.decoder_layer import DecoderLayer
from qworker.model.layers.experts import RoutedExperts
from qworker.model.layers.mlp import MLP
from qworker.model.layers.norm import RMSNorm
from qworker.model.layers.paged_attention import AttentionPlan

log = structlog.get_logger(__name__)


def refusal(config: ModelConfig) -> str | None:
    """Why the graph cannot run this model's decode steps as the layers do; None where it can.
    (Embedding scale is the embedding's, before the graph; a norm's 1 + w is its weight's.)"""
    arch = config.arch
    unrun = {
        f"activation {config.activation}": config.activation not in ACTIVATIONS,
    }
    reasons = [what for what, asked in unrun.items() if asked]
    return f"{arch.name}: {', '.join(reasons)}" if reasons else None


@dataclass(frozen=True)
class _BucketTable:
    """The layers and the LM head as the kernel choice runs them at one token-count bucket."""

    layers: ctypes.Array[DecodeLayer] | None  # None: some layer runs no native kernel here
    lm_head: DecodeProj | None  # None: the LM head runs no native kernel here
    keep: tuple[object, ...]  # what their pointers point into


@dataclass
class _Tables:
    cache: KVCache  # held, so that a later cache can never reuse its identity
    versions: tuple[int, ...]  # of every weight, when the tables were made
    by_bucket: dict[int, _BucketTable]


class DecodeGraph:
    def __init__(self, layers: list[DecoderLayer], norm: RMSNorm, lm_head: Linear | QuantLinear,
                 config: ModelConfig) -> None:
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head
        self.config = config
        self.enabled = True  # off: every step goes layer by layer (benchmarks compare the two)
        self.refused = refusal(config)  # not None: every step goes layer by layer
        if self.refused is not None:
            log.info("decode_graph_refused", reason=self.refused, fallback="layer by layer")
        self._tables: _Tables | None = None
        self._owners: list[nn.Module] | None = None  # found again after each reset

    def reset(self) -> None:
        """Forget the tables (after the layers' kernel choice, or a layer, changed)."""
        self._tables = None
        self._owners = None

    def run(self, x: torch.Tensor, plans: tuple[AttentionPlan, ...],
            cache: KVCache) -> torch.Tensor | None:
        """Logits of the batch's `logits_indices` rows, in the model's dtype (float32 from a
        quantized LM head, as `QuantLinear.float_out`) (x, the residual
        stream, is updated in place); None, with x untouched, where this step or model is not
        served. plans: each KV group's (`KVCache.layer_groups`); a layer of the windowed group
        reads its group's tables and slots."""
        plan = plans[0]
        batch = plan.batch
        served = (plan.fused and batch.decodes and not batch.prefills
                  and x.dtype in native.GEMM_DTYPES)
        if not (self.enabled and self.refused is None and served):
            return None
        rows = batch.logits_indices
        current = self._current(cache)
        layers = self._table(current, cache, x.shape[0], x.dtype, plan).layers
        lm_head = self._table(current, cache, max(rows.shape[0], 1), x.dtype, plan).lm_head
        if layers is None or lm_head is None:
            return None
        c = self.config
        tables, lens = _in_row_order(batch.decodes, x.shape[0])
        window_slots = window_tables = None
        if batch.window is not None:
            window_slots = batch.window.slot_mapping
            window_tables, _ = _in_row_order(batch.window.decodes, x.shape[0])
        dims = DecodeDims(hidden=c.hidden_size, heads=c.num_heads, kv_heads=c.num_kv_heads,
                          head_dim=c.head_dim, inter=c.intermediate_size,
                          num_blocks=cache.num_blocks, block_size=cache.block_size,
                          window_num_blocks=cache.blocks_of(1) if cache.num_groups > 1 else 0)
        return native.decode_step(
            x, layers, self.norm.weight, lm_head, self.lm_head.out_features, rows,
            plan.rope.cos, plan.rope.sin, batch.positions, batch.slot_mapping, tables, lens, dims,
            c.rms_norm_eps, c.attention_scale, isinstance(self.lm_head, QuantLinear),
            window_slots, window_tables)

    def _current(self, cache: KVCache) -> _Tables:
        """The tables, made anew where the cache or any weight (its version) changed."""
        versions = self._versions()
        tables = self._tables
        if tables is None or tables.cache is not cache or tables.versions != versions:
            tables = self._tables = _Tables(cache, versions, {})
        return tables

    def _table(self, tables: _Tables, cache: KVCache, rows: int, dtype: torch.dtype,
               plan: AttentionPlan) -> _BucketTable:
        bucket = kernel_choice.bucket(rows)
        if bucket not in tables.by_bucket:
            tables.by_bucket[bucket] = self._make_table(cache, kernel_choice.BUCKETS[bucket],
                                                        dtype, plan)
        return tables.by_bucket[bucket]

    def _versions(self) -> tuple[int, ...]:
        """Of every weight, read afresh each step from the modules that hold one (holding the
        weights would keep a released one alive). Only those modules: a MoE model's thousands of
        parameterless quantized experts, walked each step with the caches cold from the weights,
        cost 2.3 ms of a 13.5 ms token."""
        if self._owners is None:
            self._owners = [m for owner in (*self.layers, self.norm, self.lm_head)
                            for m in owner.modules()
                            if any(p is not None for p in m._parameters.values())]
        return tuple(p._version for m in self._owners for p in m._parameters.values()
                     if p is not None)

    def _make_table(self, cache: KVCache, rows: int, dtype: torch.dtype,
                    plan: AttentionPlan) -> _BucketTable:
        keep: list[object] = []
        head = _projection(self.lm_head, rows, dtype, keep)
        entries: list[DecodeLayer] = []
        groups = cache.layer_groups or (0,) * len(self.layers)
        for layer, k, v, group in zip(self.layers, cache.keys, cache.values, groups, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            experts = None
            if isinstance(mlp, RoutedExperts):
                experts = _experts(mlp, rows, dtype, keep)
                projs = [_projection(lin, rows, dtype, keep)
                         for lin in (attn.qkv_proj, attn.o_proj)] + [DecodeProj(), DecodeProj()]
            else:
                linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
                projs = [_projection(lin, rows, dtype, keep) for lin in linears]
            if (not native.serves(k) or any(p is None for p in projs)
                    or (isinstance(mlp, RoutedExperts) and experts is None)):
                return _BucketTable(None, head, tuple(keep))
            qkv, o, gate_up, down = projs
            q_norm, k_norm = attn.q_norm, attn.k_norm
            theta = attn.attends.rope_theta
            rope = None if theta is None else plan.rope_of(theta)
            tensors: dict[str, torch.Tensor | None] = {
                "input_norm": layer.input_layernorm.weight, "qkv_bias": attn.qkv_proj.bias,
                "q_norm": None if q_norm is None else q_norm.weight,
                "k_norm": None if k_norm is None else k_norm.weight,
                "post_norm": layer.post_attention_layernorm.weight, "k_cache": k, "v_cache": v,
                "attn_out_norm": None, "mlp_out_norm": None,
                "cos": None if rope is None else rope.cos,
                "sin": None if rope is None else rope.sin}
            if layer.post_norms:  # the MLP's input norm is a third one
                tensors |= {"attn_out_norm": layer.post_attention_layernorm.weight,
                            "post_norm": layer.pre_feedforward_layernorm.weight,
                            "mlp_out_norm": layer.post_feedforward_layernorm.weight}
            wrong = [n for n, t in tensors.items() if t is not None and t.dtype != dtype]
            assert not wrong, f"the graph reads {wrong} as {dtype}"  # else it misreads them
            entries.append(_pointing_at(tensors, qkv=qkv, o=o, gate_up=gate_up, down=down,
                                        experts=experts,
                                        activation=ACTIVATIONS[_activation(mlp)],
                                        window=attn.attends.window or 0, kv_group=group))
            keep.extend(t for t in tensors.values() if t is not None)
        return _BucketTable((DecodeLayer * len(entries))(*entries), head, tuple(keep))


def _projection(lin: Linear | QuantLinear, rows: int, dtype: torch.dtype,
                keep: list[object]) -> DecodeProj | None:
    """The layer's weight as the graph runs it for a step of `rows` rows (what it points into
    appended to keep); None where the kind chosen there is no native one the graph runs."""
    kind = lin.kind_for(rows)
    if isinstance(lin, QuantLinear):
        if kind not in native.QUANT_METHODS or dtype not in (torch.float32, torch.bfloat16):
            return None
        segments = lin.quant.segments
        array = (DecodeQuantSegment * len(segments))(*[
            DecodeQuantSegment(blocks=seg.raw.data_ptr(), type=seg.type_id,
                               method=native.QUANT_METHODS[kind], rows=seg.rows)
            for seg in segments])
        keep.extend([array, *(seg.raw for seg in segments)])
        return DecodeProj(pack=None, segments=array, num_segments=len(segments))
    pack = lin.packed(kind) if kind in GEMM_KERNELS else None
    if pack is None:
        return None
    keep.append(pack)
    return DecodeProj(pack=pack.data_ptr(), segments=None, num_segments=0,
                      kernel=GEMM_KERNELS[kind])


def _experts(mlp: RoutedExperts, rows: int, dtype: torch.dtype,
             keep: list[object]) -> DecodeExperts | None:
    """A routed-experts layer as the graph runs it for steps of up to `rows` rows: the router at
    the step's bucket, every expert at each bucket an expert's share of the rows can fall in (its
    own count's, as the layer path runs it); None where any of them runs no native kernel."""
    router = _projection(mlp.gate, rows, dtype, keep)
    buckets = kernel_choice.BUCKETS[: kernel_choice.bucket(rows) + 1]
    gate_ups: list[DecodeProj] = []
    downs: list[DecodeProj] = []
    for bucket_rows in buckets:
        for expert in mlp.experts:
            assert isinstance(expert, MLP)
            gate_up = _projection(expert.gate_up_proj, bucket_rows, dtype, keep)
            down = _projection(expert.down_proj, bucket_rows, dtype, keep)
            if router is None or gate_up is None or down is None:
                return None
            gate_ups.append(gate_up)
            downs.append(down)
    assert router is not None
    edges = (ctypes.c_double * len(kernel_choice.EDGES))(*kernel_choice.EDGES)
    gate_up_array = (DecodeProj * len(gate_ups))(*gate_ups)
    down_array = (DecodeProj * len(downs))(*downs)
    expert0 = mlp.experts[0]
    assert isinstance(expert0, MLP)
    table = DecodeExperts(router=router, gate_up=gate_up_array, down=down_array,
                          count=len(mlp.experts), top_k=mlp.top_k, normalize=int(mlp.normalize),
                          inter=expert0.down_proj.in_features, num_buckets=len(buckets),
                          router_width=_router_width(mlp), edges=edges, num_edges=len(edges))
    keep.extend([edges, gate_up_array, down_array, table])
    return table


def _router_width(mlp: RoutedExperts) -> int:
    """The router's output columns as the graph runs it: a dense one's pack is padded."""
    gate = mlp.gate
    return gate.padded_width if isinstance(gate, PaddedLinear) else gate.out_features


def _activation(mlp: MLP | RoutedExperts) -> str:
    if isinstance(mlp, MLP):
        return mlp.activation
    expert = mlp.experts[0]
    assert isinstance(expert, MLP)
    return expert.activation


def _pointing_at(parts: dict[str, torch.Tensor | None], activation: int, window: int,
                 kv_group: int, experts: DecodeExperts | None,
                 **projs: DecodeProj | None) -> DecodeLayer:
    """A layer whose every field (by its C name) points at that tensor's data (null for None),
    or is that projection, the activation, the window or the KV group."""
    named = parts.keys() | projs.keys() | {"experts", "activation", "window", "kv_group"}
    assert named == set(field_names(DecodeLayer)), "a misspelt field"
    assert all(p is None or p.is_contiguous() for p in parts.values())
    pointers = {name: None if p is None else p.data_ptr() for name, p in parts.items()}
    return DecodeLayer(**pointers, **projs,
                       experts=None if experts is None else ctypes.pointer(experts),
                       activation=activation, window=window, kv_group=kv_group)


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
