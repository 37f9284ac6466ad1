"""Hugging Face checkpoints: a folder's `config.json` (read by its family's declaration) and its
safetensors shards, one file or several with an index."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from qworker.model.arch import ARCHITECTURES
from qworker.model.arch.architecture import Architecture
from qworker.model.config import Experts, LayerAttention, ModelConfig, UnsupportedModelError
from qworker.model.loading.tensors import LoaderError, UnsupportedArchitectureError, validate

# HF `hidden_act` / `hidden_activation` names of the activations the layers run
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# HF `model_type`s of a family named otherwise in ARCHITECTURES (its GGUF name)
_FAMILIES = {"gemma3_text": "gemma3"}
_LOCAL_ROPE_THETA = 10000.0  # Gemma 3's local layers', where a config does not say
# Gemma3TextConfig's defaults: a multimodal Gemma 3 folder's `text_config` states only the rest
_GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "model_type": "gemma3_text", "vocab_size": 262_208, "hidden_size": 2304,
    "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
    "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "bos_token_id": 2,
    "eos_token_id": 1, "tie_word_embeddings": True, "rope_theta": 1_000_000.0,
    "rope_local_base_freq": _LOCAL_ROPE_THETA, "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "sliding_window_pattern": 6,
}
# a multimodal Gemma 3 folder's tensors: the text model's under a prefix (older and newer
# transformers), the vision tower's and the projector's beside them (dropped)
_TEXT_PREFIXES = {"language_model.": "", "model.language_model.": "model."}
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                    "model.multi_modal_projector.")


def hf_config(raw: dict[str, Any]) -> ModelConfig:
    """The ModelConfig a Hugging Face `config.json` describes; its family first, so a model of
    another kind is refused for what it is, not for a field it lacks."""
    name = raw.get("model_type", "llama")
    if name == "gemma3" and isinstance(raw.get("text_config"), dict):  # its text model alone
        outer = {k: raw[k] for k in ("bos_token_id", "eos_token_id") if k in raw}
        raw = _GEMMA3_TEXT_DEFAULTS | outer | raw["text_config"]
        name = raw["model_type"]
    arch = ARCHITECTURES.get(_FAMILIES.get(name, name))
    if arch is None:
        raise UnsupportedModelError(f"unsupported architecture {name!r}; "
                                    f"supported: {', '.join(sorted(ARCHITECTURES))}")
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if raw.get(cap) is not None:
            raise UnsupportedModelError(f"{cap} {raw[cap]} is not supported")
    if raw.get("use_bidirectional_attention"):
        raise UnsupportedModelError("bidirectional attention is not supported")
    num_heads = raw["num_attention_heads"]
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    rope, local_theta = _rope_parameters(raw, arch.name)
    scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
    partial = raw.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0
    if partial != 1.0:
        raise UnsupportedModelError(f"partial rotary embeddings (partial_rotary_factor {partial}) "
                                    "are not supported")
    act = raw.get("hidden_act") or raw.get("hidden_activation") or arch.activation
    if act not in _ACTIVATIONS and act not in _ACTIVATIONS.values():
        raise UnsupportedModelError(f"unsupported activation {act!r} "
                                    f"(supported: {', '.join(_ACTIVATIONS)})")
    num_layers = raw["num_hidden_layers"]
    return ModelConfig(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
        arch=arch,
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
        rope_theta=raw.get("rope_theta") or rope.get("rope_theta", 10000.0),
        rope_scaling=scaling,
        tie_word_embeddings=raw.get("tie_word_embeddings", arch.tied_embeddings),
        attention_bias=raw.get("attention_bias", arch.qkv_bias),
        activation=_ACTIVATIONS.get(act, act),
        layer_attention=_windows(raw, num_layers, local_theta),
        experts=_experts(raw, arch, num_layers),
        query_pre_attn_scalar=raw.get("query_pre_attn_scalar"),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def _rope_parameters(raw: dict[str, Any], family: str) -> tuple[dict[str, Any], float | None]:
    """The (global) layers' RoPE parameters, and the windowed layers' own base where they have
    one (Gemma 3). transformers >= 5 folds rope_theta and rope_scaling into one
    `rope_parameters` dict, one per layer type where they differ; older configs say
    `rope_local_base_freq`."""
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    local = raw.get("rope_local_base_freq")
    if "full_attention" in rope:
        local = (rope.get("sliding_attention") or {}).get("rope_theta")
        rope = rope["full_attention"] or {}
    if local is None and family == "gemma3":
        local = _LOCAL_ROPE_THETA
    return rope, local


def _windows(raw: dict[str, Any], num_layers: int,
             local_theta: float | None = None) -> tuple[LayerAttention, ...]:
    """Each layer's sliding window (and, given, the windowed layers' own RoPE base), as
    transformers reads the config: `layer_types` where given; else every
    `sliding_window_pattern`-th layer global (Gemma 3); else, with `use_sliding_window` (Qwen2,
    Qwen3), the layers from `max_window_layers` on; else (Mistral, Phi-3) every layer, where
    `sliding_window` is set."""
    window = raw.get("sliding_window")
    if window is None or raw.get("use_sliding_window") is False:
        return ()
    types = raw.get("layer_types")
    if types is None and local_theta is not None:
        pattern = raw.get("sliding_window_pattern", 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                 for i in range(num_layers)]
    if types is None:
        first = raw.get("max_window_layers", 0) if "use_sliding_window" in raw else 0
        types = ["sliding_attention" if i >= first else "full_attention"
                 for i in range(num_layers)]
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise UnsupportedModelError(f"unsupported layer types {sorted(unknown)}")
    if "sliding_attention" not in types:
        return ()
    return tuple(LayerAttention(window, local_theta) if kind == "sliding_attention"
                 else LayerAttention() for kind in types)


def _experts(raw: dict[str, Any], arch: Architecture, num_layers: int) -> Experts | None:
    """The routed experts as transformers reads them: a layer is sparse unless it is in
    `mlp_only_layers` or its number (from 1) is not a multiple of `decoder_sparse_step`."""
    if not arch.experts:
        return None
    step = raw.get("decoder_sparse_step", 1)
    only = set(raw.get("mlp_only_layers") or ())
    return Experts(
        count=raw["num_experts"] if "num_experts" in raw else raw["num_local_experts"],
        per_token=raw["num_experts_per_tok"],
        intermediate_size=raw.get("moe_intermediate_size") or raw["intermediate_size"],
        normalize=bool(raw.get("norm_topk_prob", arch.experts_normalized)),
        dense_layers=frozenset(i for i in range(num_layers) if i in only or (i + 1) % step),
    )


INDEX_FILE = "model.safetensors.index.json"
# Mixtral's experts by Qwen3-MoE's names, the ones the model takes (w1 gate, w3 up, w2 down)
_MIXTRAL_NAMES = re.compile(r"\.block_sparse_moe\.(gate|experts\.\d+\.w[123])\.")
_MIXTRAL_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _qwen_moe_name(match: re.Match[str]) -> str:
    part = match[1]
    if part != "gate":
        expert, _, w = part.rpartition(".")
        part = f"{expert}.{_MIXTRAL_PARTS[w]}"
    return f".mlp.{part}."

# Buffers some older checkpoints saved alongside the weights; the model recomputes them.
_IGNORED_HF_SUFFIXES = (".rotary_emb.inv_freq",)


def load_hf_folder(folder: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    config = _read_hf_config(folder / "config.json")
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    weight_map = _read_index(folder)
    if weight_map:
        files = sorted({folder / name for name in weight_map.values()})
    else:
        files = _plain_shards(folder)
    for file in files:
        for name, tensor in _read_safetensors(file).items():
            if name in tensors:
                raise LoaderError(f"{file}: tensor {name!r} also appears in {origin[name]}")
            tensors[name], origin[name] = tensor, file
    for name, shard in weight_map.items():
        if origin.get(name) != folder / shard:
            raise LoaderError(
                f"{folder / INDEX_FILE}: lists tensor {name!r} in {shard}, which does not hold it"
            )
    for name in [n for n in tensors if n.endswith(_IGNORED_HF_SUFFIXES)]:
        del tensors[name]
    tensors = {_MIXTRAL_NAMES.sub(_qwen_moe_name, n): t for n, t in tensors.items()}
    if config.arch.name == "gemma3":
        tensors, origin = _text_model(tensors), _text_model(origin)
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # some exporters save the tied copy anyway
    validate(config, {n: tuple(t.shape) for n, t in tensors.items()}, origin, folder)
    return config, tensors


def _text_model(named: dict[str, Any]) -> dict[str, Any]:
    """A multimodal checkpoint's text model, named as a text checkpoint names it."""
    out = {}
    for name, value in named.items():
        if name.startswith(_VISION_PREFIXES):
            continue
        prefix = next((p for p in _TEXT_PREFIXES if name.startswith(p)), None)
        out[name if prefix is None else _TEXT_PREFIXES[prefix] + name[len(prefix):]] = value
    return out


def _read_json(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoaderError(f"{file}: cannot read JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise LoaderError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def _read_hf_config(file: Path) -> ModelConfig:
    raw = _read_json(file)
    try:
        return hf_config(raw)
    except UnsupportedModelError as exc:
        raise UnsupportedArchitectureError(f"{file}: {exc}") from exc
    except KeyError as exc:
        raise LoaderError(f"{file}: missing field {exc}") from exc
    except (TypeError, ValueError, ZeroDivisionError) as exc:
        raise LoaderError(f"{file}: invalid config: {exc}") from exc


def _read_index(folder: Path) -> dict[str, str]:
    index_file = folder / INDEX_FILE
    if not index_file.is_file():
        return {}
    weight_map = _read_json(index_file).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise LoaderError(f"{index_file}: no weight_map")
    for file in sorted(set(weight_map.values())):
        if not (folder / file).is_file():
            raise LoaderError(f"{index_file}: shard {file} does not exist in {folder}")
    return weight_map


def _plain_shards(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise LoaderError(f"{folder}: no *.safetensors weights (other formats are not supported)")
    return files


def _read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(file)
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise LoaderError(f"{file}: not a readable safetensors file: {exc}") from exc
