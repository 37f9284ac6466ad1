"""A decoder of any supported architecture (`arch/`: Llama, Mistral, Qwen2, ...) over a paged KV
cache, built from its declaration (`ModelConfig.arch`).

q/k/v and gate/up projections are fused into one matmul each; every dense layer runs once over the
packed tokens of a step, and logits are computed only for the rows the caller asks for. A
decode-only step runs in one native call where the decode graph serves it (`decode_graph.py`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import structlog
import torch
from torch import nn

from qworker.model.batch import ForwardBatch
from qworker.model.config import ModelConfig
from qworker.model.decode_graph import DecodeGraph
from qworker.model.kernels import kernel_choice, native
from qworker.model.kernels.linear import Linear
from qworker.model.kernels.quant_linear import QuantLinear
from qworker.model.kernels.quant_weight import QuantWeight
from qworker.model.kv_cache import KVCache
from qworker.model.layers.decoder_layer import DecoderLayer
from qworker.model.layers.embedding import Embedding, quant_lookup
from qworker.model.layers.norm import RMSNorm
from qworker.model.layers.paged_attention import AttentionPlan
from qworker.model.layers.rope import RotaryTable
from qworker.model.loading.tensors import Weight
from qworker.model.step_choice import Verdict, weigh

log = structlog.get_logger(__name__)


class DecoderModel(nn.Module):
    def __init__(
        self, config: ModelConfig, dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu", init_weights: bool = True,
    ) -> None:
        """With init_weights=False the parameters stay on the meta device until
        `load_hf_weights` (which allocates only what it does not keep quantized)."""
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        with torch.device(self.device if init_weights else "meta"):
            self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
            layers = [DecoderLayer(config, i, config.attention_of(i))
                      for i in range(config.num_layers)]
            self.layers = nn.ModuleList(layers)
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps,
                                float32_product=config.arch.norm_offset != 0.0)
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.decode_graph = DecodeGraph(layers, self.norm, self.lm_head, config)
        self.decode_rows = 1  # the most rows of a decode-only step (choose_kernels says)
        self.step_verdicts: dict[int, Verdict] = {}  # graph or not, by whole steps, by rows
        self.rope = RotaryTable(
            config.head_dim, config.context_length, config.rope_theta,
            config.rope_scaling, dtype, device,
        )
        own_bases = {a.rope_theta for a in config.layer_attention if a.rope_theta is not None}
        self.layer_ropes = {  # a layer's own base (Gemma 3's local layers), unscaled
            theta: RotaryTable(config.head_dim, config.context_length, theta, None, dtype, device)
            for theta in sorted(own_bases)}
        # sqrt(hidden) in the model's dtype, as the reference casts it
        self.embed_scale = (torch.tensor(config.hidden_size**0.5, dtype=dtype, device=device)
                            if config.arch.embed_scale else None)
        self.to(dtype=dtype, device=device if init_weights else "meta")
        self.requires_grad_(False)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """Logits [len(batch.logits_indices), vocab] (float32, float64 for a float64 model)."""
        x = self.embed_tokens(batch.input_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        plans = self._plans(batch, cache)
        logits = self.decode_graph.run(x, plans, cache)
        if logits is None:  # not a step the graph serves: layer by layer
            logits = self._layer_by_layer(x, plans, cache)
        return logits if logits.dtype == torch.float64 else logits.float()

    def _plans(self, batch: ForwardBatch, cache: KVCache) -> tuple[AttentionPlan, ...]:
        """The attention plan of each KV group (`KVCache.layer_groups`): the batch through its
        block tables, over its layers' cache geometry."""
        group = self.config.num_heads // self.config.num_kv_heads
        if cache.layer_groups is None:
            return (AttentionPlan.build(batch, cache.keys[0], self.rope, group,
                                        self.layer_ropes),)
        assert batch.window is not None, "a cache of two KV groups takes window tables"
        return tuple(AttentionPlan.build(b, cache.keys[cache.first_layer_of(g)], self.rope,
                                         group, self.layer_ropes)
                     for g, b in enumerate((batch, batch.window)))

    def _layer_by_layer(self, x: torch.Tensor, plans: tuple[AttentionPlan, ...],
                        cache: KVCache) -> torch.Tensor:
        pending = None
        groups = cache.layer_groups or (0,) * len(self.layers)
        for layer, k, v, g in zip(self.layers, cache.keys, cache.values, groups, strict=True):
            x, pending = layer(x, pending, plans[g], k, v)
        plan = plans[0]
        rows = plan.batch.logits_indices
        _, x = self.norm.add_and_norm(x[rows], None if pending is None else pending[rows],
                                      plan.fused)
        return self.lm_head(x)

    def choose_kernels(self, max_rows: int, max_logit_rows: int, cache_dir: Path | None = None,
                       steps_on: KVCache | None = None,
                       step_timer: kernel_choice.Timer = kernel_choice.one_call,
                       ) -> dict[str, tuple[str, ...]]:
        """Measures every linear layer's kernels (`kernel_choice`) for steps of up to `max_rows`
        tokens, `max_logit_rows` of which sample; then, given a cache to run steps on, weighs
        whole decode steps on and off the decode graph wherever the picks take it off
        (`step_choice`). The choice by shape (before the steps' verdicts), logged once."""
        layers = [(m, max_rows) for m in self.modules()
                  if isinstance(m, Linear | QuantLinear) and m is not self.lm_head]
        graph_rows = max_logit_rows if self.decode_graph.refused is None else 0
        self.decode_rows = max_logit_rows
        chosen = kernel_choice.choose([*layers, (self.lm_head, max_logit_rows)], cache_dir,
                                      graph_rows=graph_rows)
        self._follow_repacked_head()
        self.decode_graph.reset()
        self.step_verdicts = {}
        if steps_on is not None and graph_rows > 0 and self.decode_graph.enabled:
            self.step_verdicts = weigh(self, steps_on, cache_dir, step_timer)
            self._follow_repacked_head()
        log.info("kernels_chosen", **self.kernel_report())
        return chosen

    def _follow_repacked_head(self) -> None:
        """A tied quantized embedding reads its rows from the LM head's weight, repacked or not
        by the choice (so the file layout is not kept beside the repacked one)."""
        quant = getattr(self.lm_head, "quant", None)
        if (self.config.tie_word_embeddings and isinstance(quant, QuantWeight)
                and self.embed_tokens.quant is not None and quant is not self.embed_tokens.quant):
            self.embed_tokens.release_to(quant_lookup(quant, self.dtype), self.device)
            self.embed_tokens.quant = quant

    def release_weights(self) -> int:
        """After the kernel choice: drops each linear layer's original weight that its packs
        make redundant, and a tied embedding's where the LM head runs only the native GEMM (rows
        are then read from its pack). Returns the bytes no longer held."""
        before = self.weight_bytes()
        tied = getattr(self.lm_head, "weight", None) is self.embed_tokens.weight
        for module in self.modules():
            if isinstance(module, Linear) and (module is not self.lm_head or not tied):
                module.release_weight()
        head = self.lm_head
        if tied and head.kinds_run() <= native.PACKED_KINDS and head.release_weight():
            pack = self.lm_head.packed("native")
            assert pack is not None
            self.embed_tokens.release_to(lambda ids: native.gemm_rows(pack, ids))
        self.decode_graph.reset()
        after = self.weight_bytes()
        log.info("weights_released", freed_bytes=before - after, weight_bytes=after)
        return before - after

    def weight_bytes(self) -> int:
        """Bytes of every distinct weight and pack this model holds."""
        seen: dict[int, int] = {}
        quant = [seg.raw for m in self.modules() if isinstance(q := getattr(m, "quant", None),
                                                              QuantWeight) for seg in q.segments]
        for tensor in [*self.parameters(), *self.buffers(), *_packs(self), *quant]:
            if tensor.is_mkldnn:  # an opaque oneDNN pack: no storage to look at
                seen[id(tensor)] = tensor.numel() * tensor.element_size()
            else:
                storage = tensor.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())

    def weights_kept(self) -> str:
        """"quantized (Q4_1, Q8_0)" where matrices stay in GGUF blocks, else the dtype."""
        formats = {name: None for m in self.modules() if isinstance(m, QuantLinear)
                   for name in m.quant.type_names}
        dtype = str(self.dtype).removeprefix("torch.")
        return f"quantized ({', '.join(formats)})" if formats else dtype

    def kernel_report(self) -> dict[str, str]:
        """What runs each op here, in words: the native level (or why there is none), the
        attention path, and each linear shape's kernel per token bucket."""
        status = native.status()
        on_cpu = self.device.type == "cpu"
        c = self.config
        attention = "native" if native.serves(self.norm.weight) else "torch"
        if attention == "native" and self.dtype == torch.bfloat16 and native.amx_attention_serves(
                c.num_heads // c.num_kv_heads, c.head_dim, 16):
            attention = "native, decodes on AMX tiles (blocks of whole 16s)"
        report = {"native": (status.level or f"missing: {status.reason}") if on_cpu else "cuda",
                  "attention": attention,
                  "weights": self.weights_kept(), "weight_bytes": str(self.weight_bytes())}
        shapes: dict[str, Linear | QuantLinear] = {}
        for module in self.modules():
            if isinstance(module, Linear | QuantLinear):
                shapes.setdefault(kernel_choice.shape_key(module), module)
        report["decode_graph"] = self._graph_report(shapes.values())
        for key, layer in shapes.items():
            kinds = layer.choice or tuple(layer.kind_for(b) for b in kernel_choice.BUCKETS)
            report[f"linear {key}"] = kernel_choice.describe({key: kinds})[key]
        return report

    def _graph_report(self, layers: Iterable[Linear | QuantLinear]) -> str:
        """Which decode-only steps the decode graph runs: those whose bucket every layer runs a
        graph kernel at (a step it does not run goes layer by layer); and where whole steps were
        weighed both ways (`step_choice`), which way won and by how much."""
        if self.decode_graph.refused is not None:
            return f"refused ({self.decode_graph.refused})"
        buckets = kernel_choice.BUCKETS[: kernel_choice.bucket(self.decode_rows) + 1]
        off = [rows for rows in buckets if any(
            layer.kind_for(rows) not in kernel_choice.GRAPH_KINDS for layer in layers)]
        report = (f"off at {', '.join(map(str, off))} rows (a layer's kernel it does not run)"
                  if off else f"runs decode steps of 1-{self.decode_rows} rows")
        weighed = [v.describe() for v in self.step_verdicts.values()]
        return f"{report}; weighed by whole steps: {', '.join(weighed)}" if weighed else report

    def load_hf_weights(self, weights: Mapping[str, Weight], dense_head: bool = False) -> None:
        """Load tensors named as in a Hugging Face Llama checkpoint (fusing q/k/v and gate/up).
        A `QuantWeight` stays in its blocks: its layer becomes a `QuantLinear` (an embedding, a
        quantized row lookup, shared with a tied LM head); nothing else is allocated for it. A
        norm whose architecture scales by offset + w holds offset + w (so every norm kernel runs
        it), added in float32. `dense_head`: the LM head's matrix (or the embedding a tied head
        shares) is expanded all the same (`weights_auto.expand_head`)."""
        given = _fused(weights, self.config)
        head = "lm_head.weight" if "lm_head.weight" in given else "embed_tokens.weight"
        if dense_head and isinstance(quant_head := given.get(head), QuantWeight):
            given[head] = quant_head.dequantize()
        offset = self.config.arch.norm_offset
        for name, tensor in given.items():
            if offset and name.endswith("norm.weight") and isinstance(tensor, torch.Tensor):
                given[name] = tensor.float() + offset
        kept = [n for n, w in given.items() if isinstance(w, QuantWeight)]
        for name in kept:
            quant = given.pop(name)
            assert isinstance(quant, QuantWeight)
            self._keep_quantized(name.removesuffix(".weight"), quant, given)
        self._materialize()
        own = {n: t for n, t in self.state_dict().items() if n not in kept}
        missing = set(own) - set(given) - ({"lm_head.weight"} if self.config.tie_word_embeddings
                                           else set())
        assert not missing, f"weights missing: {sorted(missing)[:5]}"
        for name, tensor in given.items():
            if name in own:
                expected = own[name].shape
                assert expected == tensor.shape, f"{name}: {tensor.shape} for {expected}"
                own[name].copy_(tensor)

    def _keep_quantized(self, module_name: str, quant: QuantWeight,
                        given: dict[str, Weight]) -> None:
        if module_name == "embed_tokens":
            self.embed_tokens.release_to(quant_lookup(quant, self.dtype), self.device)
            self.embed_tokens.quant = quant
            if self.config.tie_word_embeddings:
                self._set_module("lm_head", QuantLinear(quant, None, self.dtype))
            return
        bias = given.get(f"{module_name}.bias")  # left in `given`: copied in as any tensor is
        assert bias is None or isinstance(bias, torch.Tensor)
        # in the model's dtype, as a dense layer's and as the decode graph reads it (T*)
        self._set_module(module_name, QuantLinear(quant, None if bias is None else
                                                  bias.to(self.dtype), self.dtype))

    def _set_module(self, dotted: str, module: QuantLinear) -> None:
        parent, _, name = dotted.rpartition(".")
        setattr(self.get_submodule(parent) if parent else self, name, module)
        self.decode_graph.reset()
        if dotted == "lm_head":
            module.float_out = True  # logits as its kernels compute them, never rounded to bf16
            self.decode_graph.lm_head = module

    def _materialize(self) -> None:
        """Allocates every parameter still on the meta device (a tied one once)."""
        made: dict[int, nn.Parameter] = {}
        for module in self.modules():
            for name, param in list(module._parameters.items()):
                if param is not None and param.is_meta:
                    if id(param) not in made:
                        made[id(param)] = nn.Parameter(torch.empty_like(param, device=self.device),
                                                       requires_grad=False)
                    module._parameters[name] = made[id(param)]


def _packs(model: nn.Module) -> list[torch.Tensor]:
    packs = []
    for module in model.modules():
        if isinstance(module, Linear) and module._packs is not None:
            packs += [p for p in module._packs[1].values() if p is not None]
    return packs


def _cat(parts: list[Weight]) -> Weight:
    """Rows of every part; quantized parts stay so where all are (else all dequantized)."""
    quant = [p for p in parts if isinstance(p, QuantWeight)]
    if len(quant) == len(parts):
        return QuantWeight.cat(quant)
    return torch.cat([p.dequantize() if isinstance(p, QuantWeight) else p.float() for p in parts]
                     if quant else [p for p in parts if isinstance(p, torch.Tensor)])


def _fused(weights: Mapping[str, Weight], config: ModelConfig) -> dict[str, Weight]:
    """Checkpoint names -> this model's: q/k/v and gate/up joined where the checkpoint holds
    them apart (a Phi-3 checkpoint holds them joined already)."""
    out = {name.removeprefix("model."): tensor for name, tensor in weights.items()}
    for i in range(config.num_layers):
        _join(out, f"layers.{i}.self_attn.", ("q_proj", "k_proj", "v_proj"), "qkv_proj")
        _join(out, f"layers.{i}.mlp.", ("gate_proj", "up_proj"), "gate_up_proj")
        for j in range(config.experts.count if config.experts else 0):
            _join(out, f"layers.{i}.mlp.experts.{j}.", ("gate_proj", "up_proj"), "gate_up_proj")
    if config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def _join(weights: dict[str, Weight], prefix: str, parts: tuple[str, ...], whole: str) -> None:
    for kind in ("weight", "bias"):
        found = [weights.pop(name) for p in parts if (name := f"{prefix}{p}.{kind}") in weights]
        if found:
            assert len(found) == len(parts), f"{prefix}{whole}.{kind}: parts missing"
            weights[f"{prefix}{whole}.{kind}"] = _cat(found)


WEIGHTS = ("auto", "quantized", "bfloat16", "float32")  # --weights


def load_model(
    name_or_path: str | Path, dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu", weights: str = "dense", cache_dir: Path | None = None,
) -> DecoderModel:
    """Build a model from a HF folder, a .gguf file or a known model name. weights="quantized"
    keeps a GGUF's block-quantized matrices in their blocks ("auto": so for a quantized file, on
    the CPU, unless expanding it adds at most 256 MB and measures faster, the LM head weighed
    apart; `loading/weights_auto.py`, its timing cached in `cache_dir`); anything else
    dequantizes them to `dtype`."""
    from qworker.model.loading.checkpoint import load_checkpoint
    from qworker.model.loading.hub import resolve_model
    from qworker.model.loading.weights_auto import expand_head, keep_quantized

    path = resolve_model(str(name_or_path))
    auto = weights == "auto" and torch.device(device).type == "cpu"
    keep = weights == "quantized" or (auto and keep_quantized(path, dtype, cache_dir))
    dense_head = keep and auto and expand_head(path, dtype, cache_dir)
    config, weights_ = load_checkpoint(path, keep_quantized=keep)
    model = DecoderModel(config, dtype=dtype, device=device, init_weights=False)
    model.load_hf_weights(weights_, dense_head=dense_head)
    return model
