"""What a checkpoint must hold: every tensor a config implies, by Hugging Face name and shape (as
its family's declaration lays them out), checked before the model sees any; and the errors
loading raises."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from qworker.model.config import ModelConfig, UnsupportedModelError
from qworker.model.errors import ModelInputError
from qworker.model.kernels.quant_weight import QuantWeight

Weight = torch.Tensor | QuantWeight  # a GGUF block-quantized weight may be kept as it is


class LoaderError(ModelInputError):
    """A checkpoint could not be loaded; the message names the file and the problem."""


class UnsupportedArchitectureError(LoaderError, UnsupportedModelError):
    """The checkpoint is readable but describes a model this worker cannot run."""


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of `config` must hold, by Hugging Face name."""
    arch = config.arch
    hidden, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    q_dim = config.num_heads * config.head_dim
    kv_dim = config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab, hidden)
    projections = {"qkv_proj": q_dim + 2 * kv_dim} if arch.fused_qkv else {
        "q_proj": q_dim, "k_proj": kv_dim, "v_proj": kv_dim}
    for i in range(config.num_layers):
        layer = f"model.layers.{i}."
        for proj, rows in projections.items():
            shapes[f"{layer}self_attn.{proj}.weight"] = (rows, hidden)
            if config.attention_bias:
                shapes[f"{layer}self_attn.{proj}.bias"] = (rows,)
        shapes[layer + "self_attn.o_proj.weight"] = (hidden, q_dim)
        if arch.qk_norm:
            shapes[layer + "self_attn.q_norm.weight"] = (config.head_dim,)
            shapes[layer + "self_attn.k_norm.weight"] = (config.head_dim,)
        experts = config.experts
        if experts is not None and experts.sparse(i):
            shapes[layer + "mlp.gate.weight"] = (experts.count, hidden)
            for j in range(experts.count):
                shapes |= _mlp_shapes(f"{layer}mlp.experts.{j}.", hidden,
                                      experts.intermediate_size, fused=False)
        else:
            shapes |= _mlp_shapes(layer + "mlp.", hidden, inter, arch.fused_gate_up)
        shapes |= {
            layer + "input_layernorm.weight": (hidden,),
            layer + "post_attention_layernorm.weight": (hidden,),
        }
        if arch.post_norms:
            shapes[layer + "pre_feedforward_layernorm.weight"] = (hidden,)
            shapes[layer + "post_feedforward_layernorm.weight"] = (hidden,)
    return shapes


def _mlp_shapes(prefix: str, hidden: int, inter: int,
                fused: bool) -> dict[str, tuple[int, ...]]:
    parts = {"gate_up_proj": 2 * inter} if fused else {"gate_proj": inter, "up_proj": inter}
    shapes: dict[str, tuple[int, ...]] = {f"{prefix}{p}.weight": (n, hidden)
                                          for p, n in parts.items()}
    return shapes | {prefix + "down_proj.weight": (hidden, inter)}


def _natural_key(name: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def validate(
    config: ModelConfig,
    shapes: Mapping[str, tuple[int, ...]],
    origin: Mapping[str, Path],
    checkpoint: Path,
) -> None:
    """Raise LoaderError unless `shapes` (name -> shape) are exactly the tensors `config` needs.

    `origin` says which file each tensor came from, for the message; `checkpoint` is named for
    tensors that are missing.
    """
    expected = expected_shapes(config)
    unexpected = shapes.keys() - expected.keys()
    if unexpected:
        first = min(unexpected, key=_natural_key)
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise LoaderError(
            f"{origin.get(first, checkpoint)}: unexpected tensor {first!r}{more} "
            f"for a {config.arch.name} model with {config.num_layers} layers"
            f"{', tied embeddings' if config.tie_word_embeddings else ''}"
            f"{'' if config.attention_bias else ', no attention bias'}"
        )
    missing = [name for name in expected if name not in shapes]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise LoaderError(f"{checkpoint}: missing tensor {missing[0]!r}{more}")
    wrong = [name for name, shape in expected.items() if shapes[name] != shape]
    if wrong:
        name = wrong[0]
        others = f" (and {len(wrong) - 1} more of the wrong shape)" if len(wrong) > 1 else ""
        raise LoaderError(
            f"{origin.get(name, checkpoint)}: tensor {name!r} has shape "
            f"{shapes[name]}, but the config implies {expected[name]}{others}"
        )
