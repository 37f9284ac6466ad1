"""A Hugging Face model's weights written as a GGUF file the way llama.cpp's converter writes them:
tensor names from gguf-py's own table for the architecture, q/k rows permuted for `llama`, the
metadata of the HF config, a byte-level vocabulary of placeholder tokens; Gemma's norms with
their 1 added."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
import transformers

from qworker.model.layers.rope import llama3_divisors

Q = gguf.GGMLQuantizationType
# llama.cpp writes Mistral as `llama` (gguf-py has no plain `mistral` architecture)
GGUF_ARCHITECTURES = {"mistral": "llama", "qwen3_moe": "qwen3moe", "mixtral": "llama",
                      "gemma3_text": "gemma3"}
NORMS_PLUS_ONE = ("gemma3",)  # llama.cpp's converter stores 1 + w for Gemma's norms


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (HF's half-split RoPE -> interleaved pairs)."""
    pairs = w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
    return pairs.swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    path: Path, config: transformers.PretrainedConfig, state: dict[str, torch.Tensor],
    qtype: Q = Q.F32, types: dict[str, Q] | None = None, arch: str | None = None,
) -> Path:
    """A GGUF of `state` (HF names) for `config`; matrices in `qtype` (`types` by HF name), 1-D
    tensors in float32; `arch` as the file's architecture (default: the config's)."""
    arch = arch or GGUF_ARCHITECTURES.get(config.model_type, config.model_type)
    hidden, heads = config.hidden_size, config.num_attention_heads
    kv_heads = config.num_key_value_heads or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    rope = getattr(config, "rope_parameters", None) or {}
    rope = rope.get("full_attention", rope)  # per layer type (Gemma 3): the global layers'
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(hidden)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    if head_dim != hidden // heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(rope.get("rope_theta") or getattr(config, "rope_theta", 1e4))
    if arch != "llama" and getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
    if getattr(config, "num_experts", None):
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        if hasattr(config, "moe_intermediate_size"):  # Mixtral's: its intermediate_size
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_expert_weights_norm(getattr(config, "norm_topk_prob", True))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(config.vocab_size)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight",
                          llama3_divisors(head_dim, rope["rope_theta"], rope).numpy())
    family = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(family, config.num_hidden_layers)
    # a dense layer among experts (mlp_only_layers): llama.cpp's qwen3moe has no name for its MLP
    dense = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    for name, tensor in _experts_apart(state).items():
        array = tensor.float().numpy()
        if arch == "llama" and ".q_proj." in name:
            array = llama_cpp_permute(array, heads)
        elif arch == "llama" and ".k_proj." in name:
            array = llama_cpp_permute(array, kv_heads)
        elif arch in NORMS_PLUS_ONE and name.endswith("norm.weight"):
            array = array + 1
        gguf_name = (names.get_name(name, try_suffixes=(".weight", ".bias"))
                     or dense.get_name(name, try_suffixes=(".weight", ".bias")))
        assert gguf_name is not None, f"gguf-py names no {name} for {arch}"
        if not gguf_name.endswith((".weight", ".bias")):  # transformers' 3-D experts
            gguf_name += ".weight"
        kind = (types or {}).get(name, qtype if array.ndim >= 2 else Q.F32)
        if kind == Q.I32:
            writer.add_tensor(gguf_name, array.astype(np.int32))
        elif kind == Q.F16:
            writer.add_tensor(gguf_name, array.astype(np.float16))
        elif kind == Q.F32:
            writer.add_tensor(gguf_name, array)
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _experts_apart(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' fused experts (`mlp.experts.gate_up_proj`, [experts, 2 x inter, hidden]) as
    the converter's 3-D gate and up tensors."""
    out = {}
    for name, tensor in state.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            out[name.replace("gate_up_proj", "gate_proj")] = gate.contiguous()
            out[name.replace("gate_up_proj", "up_proj")] = up.contiguous()
        else:
            out[name] = tensor
    return out
