"""GGUF files: the metadata read as a ModelConfig (by the family's declaration), the tensor table
named as Hugging Face names them and checked before any tensor is read, then the tensors,
dequantized or kept in their blocks; and whether a quantized file is kept so (`--weights auto`)."""

from __future__ import annotations

import re
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from qworker.model.arch import ARCHITECTURES, GGUF_NAMES, GGUF_WITH_EXPERTS
from qworker.model.arch.architecture import Architecture
from qworker.model.config import Experts, LayerAttention, ModelConfig, UnsupportedModelError
from qworker.model.kernels.quant_weight import TYPE_IDS, QuantWeight
from qworker.model.loading.tensors import (
    LoaderError,
    UnsupportedArchitectureError,
    Weight,
    validate,
)

if TYPE_CHECKING:
    from qworker.model.loading.gguf_file import GGUFFile, GGUFTensor
    from qworker.model.loading.gguf_shards import GGUFShards

    GGUFReader = GGUFFile | GGUFShards  # one file, or a split one's shards as one

_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",  # gate and up as one, where the declaration says (`_hf_name`)
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.gate",  # the experts' router
}
ROPE_FREQS = "rope_freqs.weight"  # read into the config (`_rope_freq_factors`), no weight
# 3-D [experts, rows, columns]: expert j's matrix is HF's `mlp.experts.{j}.<name>`
_GGUF_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                      "ffn_down_exps": "down_proj"}
# where the declaration has norms after attention and MLP (Gemma): the MLP's input norm is a third
_GGUF_POST_NORM_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GEMMA3_LOCAL_ROPE_THETA = 10000.0  # llama.cpp's, for Gemma 3's local layers: the file says none
_GEMMA3_27B_LAYERS = 62  # llama.cpp scales its attention by 1 / sqrt(hidden / heads), not head_dim
_GGUF_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
SUPPORTED_GGUF_TYPES = ("F32", "F16", "BF16", *TYPE_IDS)  # Q4_0 ... Q6_K
# General end-of-generation tokens llama.cpp also stops on when a file marks them as control tokens.
_EOG_TOKEN_TEXTS = frozenset(
    {"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>"}
)
_CONTROL_TOKEN = 3  # llama.cpp's token type for special tokens such as <|im_end|>
_USER_DEFINED_TOKEN = 4  # a SentencePiece vocabulary's <end_of_turn> may be one (llama.cpp: EOG)


def open_gguf(path: Path) -> GGUFReader:
    """The GGUF file at `path` (a shard's name: all its shards as one), with any parse failure
    as a LoaderError."""
    from qworker.model.loading.gguf_file import (  # imports gguf: only when used
        GGUFFile,
        GGUFFormatError,
    )
    from qworker.model.loading.gguf_shards import GGUFShards, shard_paths

    try:
        shards = shard_paths(Path(path))
        return GGUFFile(path) if shards is None else GGUFShards(shards)
    except (GGUFFormatError, OSError, UnicodeDecodeError, struct.error) as exc:
        raise LoaderError(f"{path}: not a readable GGUF file: {exc}") from exc


def gguf_value(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """A metadata value (int, float, str, bool or list), or `default` when the key is absent."""
    return reader.get(key, default)


def gguf_eos_token_ids(reader: GGUFReader) -> tuple[int, ...]:
    """The file's eos / eot / eom ids, then any other control token that ends generation."""
    ids = [gguf_value(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    tokens = gguf_value(reader, "tokenizer.ggml.tokens", [])
    types = gguf_value(reader, "tokenizer.ggml.token_type", [])
    pairs = enumerate(zip(tokens, types, strict=False))
    ids += [i for i, (text, kind) in pairs if text in _EOG_TOKEN_TEXTS
            and kind in (_CONTROL_TOKEN, _USER_DEFINED_TOKEN)]
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def load_gguf(path: Path, keep_quantized: bool = False) -> tuple[ModelConfig, dict[str, Weight]]:
    """Config and tensors, the tensor table checked against the config before any is read."""
    reader = open_gguf(path)
    config = gguf_config(reader, path)
    _check_gguf_types(reader, path)
    weights = [t for t in reader.tensors if t.name != ROPE_FREQS]  # in the config
    names = {t.name: _hf_name(t.name, config.arch, path) for t in weights}
    shapes = {names[t.name]: tuple(int(n) for n in reversed(t.shape)) for t in weights}
    for t in weights:
        if (experts := _expert_names(t)) is not None:
            shape = shapes.pop(names[t.name])
            shapes |= dict.fromkeys(experts, shape[1:])
    validate(config, shapes, dict.fromkeys(shapes, path), path)
    tensors: dict[str, Weight] = {}
    for t in weights:
        if (experts := _expert_names(t)) is not None:
            tensors.update(zip(experts, _gguf_experts(t, keep_quantized), strict=True))
        else:
            tensors[names[t.name]] = gguf_tensor(t, keep_quantized)
    if config.arch.gguf_permuted_qk:
        _unpermute_qk(tensors, config)
    if config.arch.norm_offset:  # llama.cpp's converter added it; HF's names hold w alone
        for name, tensor in tensors.items():
            if name.endswith("norm.weight") and isinstance(tensor, torch.Tensor):
                tensors[name] = tensor.float() - config.arch.norm_offset
    return config, tensors


def gguf_config(reader: GGUFReader, path: Path) -> ModelConfig:
    """The ModelConfig a GGUF's metadata describes."""
    arch = gguf_value(reader, "general.architecture")
    if arch is None:
        raise LoaderError(f"{path}: no general.architecture in the GGUF metadata")
    if GGUF_NAMES.get(arch, arch) not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{path}: unsupported architecture {arch!r}; "
            f"supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    family = ARCHITECTURES[GGUF_NAMES.get(arch, arch)]
    if gguf_value(reader, f"{arch}.expert_count") and arch in GGUF_WITH_EXPERTS:
        family = ARCHITECTURES[GGUF_WITH_EXPERTS[arch]]  # llama.cpp's Mixtral is `llama`

    def get(key: str, default: Any = None) -> Any:
        value = gguf_value(reader, f"{arch}.{key}", default)
        if isinstance(value, list):
            raise UnsupportedArchitectureError(f"{path}: per-layer {arch}.{key} is not supported")
        return value

    def need(key: str) -> Any:
        value = get(key)
        if value is None:
            raise LoaderError(f"{path}: no {arch}.{key} in the GGUF metadata")
        return value

    names = {t.name for t in reader.tensors}
    if names & {"rope_factors_long.weight", "rope_factors_short.weight"}:
        raise UnsupportedArchitectureError(f"{path}: rope_factors (LongRoPE) are not supported")
    hidden, heads = need("embedding_length"), need("attention.head_count")
    if not isinstance(hidden, int) or not isinstance(heads, int) or heads <= 0:
        raise LoaderError(f"{path}: {arch}.embedding_length {hidden!r} or "
                          f"{arch}.attention.head_count {heads!r} is not a positive integer")
    head_dim = get("attention.key_length", hidden // heads)
    if get("attention.value_length", head_dim) != head_dim:
        raise UnsupportedArchitectureError(f"{path}: values and keys of different sizes")
    if get("rope.dimension_count", head_dim) != head_dim:
        raise UnsupportedArchitectureError(f"{path}: partial rotary embeddings are not supported")
    window = get("attention.sliding_window")
    layers = need("block_count")
    try:
        return ModelConfig(
            vocab_size=_gguf_vocab_size(reader),
            hidden_size=hidden,
            intermediate_size=need("feed_forward_length"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=get("attention.head_count_kv", heads),
            head_dim=head_dim,
            max_position_embeddings=get("context_length", 2048),
            rms_norm_eps=_shortest_f32(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=_shortest_f32(get("rope.freq_base", 10000.0)),
            rope_scaling=_gguf_rope_scaling(reader, arch, path),
            tie_word_embeddings="output.weight" not in names,
            attention_bias=bool(names & {"blk.0.attn_q.bias", "blk.0.attn_qkv.bias"}),
            activation=family.activation,
            arch=family,
            layer_attention=_gguf_layer_attention(reader, arch, window, layers),
            experts=_gguf_experts_config(get, names, layers) if family.experts else None,
            query_pre_attn_scalar=(hidden // heads if arch == "gemma3"
                                   and layers == _GEMMA3_27B_LAYERS else None),
            bos_token_id=gguf_value(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_ids=gguf_eos_token_ids(reader),
        )
    except UnsupportedModelError as exc:
        raise UnsupportedArchitectureError(f"{path}: {exc}") from exc
    except (TypeError, ValueError) as exc:
        raise LoaderError(f"{path}: invalid metadata: {exc}") from exc


def _gguf_experts_config(get: Any, names: set[str], layers: int) -> Experts:
    """The experts as llama.cpp writes them; a layer with no router (`ffn_gate_inp`) is dense.
    llama.cpp normalizes the top k's weights (Qwen3-MoE, Mixtral) unless the file says otherwise;
    Mixtral's files give the experts' size as the model's `feed_forward_length`."""
    return Experts(
        count=get("expert_count"), per_token=get("expert_used_count"),
        intermediate_size=get("expert_feed_forward_length") or get("feed_forward_length"),
        normalize=bool(get("expert_weights_norm", True)),
        dense_layers=frozenset(i for i in range(layers)
                               if f"blk.{i}.ffn_gate_inp.weight" not in names),
    )


def _gguf_layer_attention(reader: GGUFReader, arch: str, window: int | None,
                          layers: int) -> tuple[LayerAttention, ...]:
    """Every layer windowed where the file names a window; Gemma 3's every sixth global, as
    llama.cpp runs it (or by `attention.sliding_window_pattern`: a period, or a flag a layer),
    its windowed layers on their own RoPE base."""
    if not window:
        return ()
    if arch != "gemma3":
        return (LayerAttention(window),) * layers
    pattern = gguf_value(reader, f"{arch}.attention.sliding_window_pattern", 6)
    windowed = ([bool(p) for p in pattern] if isinstance(pattern, list)
                else [bool((i + 1) % pattern) for i in range(layers)])
    if len(windowed) != layers:
        raise ValueError(f"{arch}.attention.sliding_window_pattern names {len(windowed)} layers "
                         f"of {layers}")
    local = LayerAttention(window, _GEMMA3_LOCAL_ROPE_THETA)
    return tuple(local if w else LayerAttention() for w in windowed)


def _shortest_f32(value: float) -> float:
    """GGUF stores float32: give 1e-05 back rather than 9.999999747378752e-06 (same float32)."""
    return float(str(np.float32(value)))


def _gguf_vocab_size(reader: GGUFReader) -> int:
    tokens = reader.get("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens)
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    return 0 if embed is None else int(embed.shape[-1])


def _gguf_rope_scaling(reader: GGUFReader, arch: str, path: Path) -> dict[str, Any] | None:
    kind = gguf_value(reader, f"{arch}.rope.scaling.type")
    factors = _rope_freq_factors(reader, path)
    if factors is not None:
        if kind not in (None, "none"):
            raise UnsupportedArchitectureError(f"{path}: rope_freqs beside {kind!r} scaling")
        return {"rope_type": "freq_factors", "factors": factors}
    if kind in (None, "none"):
        return None
    factor = gguf_value(reader, f"{arch}.rope.scaling.factor")
    scaling: dict[str, Any] = {"rope_type": kind, "factor": factor}
    original = gguf_value(reader, f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = original
    return scaling


def _rope_freq_factors(reader: GGUFReader, path: Path) -> tuple[float, ...] | None:
    """`rope_freqs.weight`: what llama.cpp's converter makes of Llama 3's RoPE scaling, a
    divisor of each frequency (of every layer alike)."""
    tensor = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if tensor is None:
        return None
    if tensor.tensor_type.name != "F32" or len(tensor.shape) != 1:
        raise LoaderError(f"{path}: {ROPE_FREQS} is not a float32 vector")
    return tuple(float(f) for f in np.array(tensor.data, dtype=np.float32))


def _check_gguf_types(reader: GGUFReader, path: Path) -> None:
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in SUPPORTED_GGUF_TYPES:
            raise LoaderError(
                f"{path}: tensor {tensor.name!r} has GGUF type {tensor.tensor_type.name}, which is "
                f"not supported (supported: {', '.join(SUPPORTED_GGUF_TYPES)})"
            )


def _hf_name(gguf_name: str, arch: Architecture, path: Path) -> str:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    match = _GGUF_LAYER_RE.fullmatch(gguf_name)
    if match and match[2] in _GGUF_EXPERT_NAMES and arch.experts:
        return f"model.layers.{match[1]}.mlp.experts.{_GGUF_EXPERT_NAMES[match[2]]}.{match[3]}"
    if match and (match[2] in _GGUF_LAYER_NAMES
                  or arch.post_norms and match[2] in _GGUF_POST_NORM_NAMES):
        part = (_GGUF_POST_NORM_NAMES if arch.post_norms and match[2] in _GGUF_POST_NORM_NAMES
                else _GGUF_LAYER_NAMES)[match[2]]
        if match[2] == "ffn_up" and arch.fused_gate_up:
            part = "mlp.gate_up_proj"
        return f"model.layers.{match[1]}.{part}.{match[3]}"
    raise LoaderError(f"{path}: unknown GGUF tensor {gguf_name!r}")


def gguf_tensor(tensor: GGUFTensor, keep_quantized: bool) -> Weight:
    import gguf

    kind = tensor.tensor_type
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dimensions innermost first
    if keep_quantized and kind.name in TYPE_IDS and len(shape) == 2:
        raw = torch.from_numpy(np.array(tensor.data, dtype=np.uint8).reshape(shape[0], -1))
        return QuantWeight.of(kind.name, raw, shape[1])
    if kind == gguf.GGMLQuantizationType.F32:
        array = np.array(tensor.data, dtype=np.float32)
    elif kind == gguf.GGMLQuantizationType.F16:
        array = np.array(tensor.data, dtype=np.float16)
    elif kind == gguf.GGMLQuantizationType.BF16:
        bits = np.array(tensor.data).view(np.int16)
        return torch.from_numpy(bits).view(torch.bfloat16).reshape(shape)
    elif kind.name in TYPE_IDS and len(shape) == 2 and native_loaded():
        return _native_dequantize(tensor)
    else:
        array = gguf.quants.dequantize(tensor.data, kind)
    return torch.from_numpy(np.ascontiguousarray(array)).reshape(shape)


def _expert_names(tensor: GGUFTensor) -> list[str] | None:
    """Expert j's HF name for each j of a 3-D expert tensor; None for any other tensor (a 2-D
    one under an expert name is named whole, and the shape check reports it)."""
    match = _GGUF_LAYER_RE.fullmatch(tensor.name)
    if not match or match[2] not in _GGUF_EXPERT_NAMES or len(tensor.shape) != 3:
        return None
    return [f"model.layers.{match[1]}.mlp.experts.{j}.{_GGUF_EXPERT_NAMES[match[2]]}.{match[3]}"
            for j in range(int(tensor.shape[2]))]


def _gguf_experts(tensor: GGUFTensor, keep_quantized: bool) -> list[Weight]:
    """A 3-D expert tensor as one matrix per expert: kept in its blocks (each expert's rows a
    view of one copy of the file's bytes) or expanded."""
    count, rows, cols = (int(n) for n in reversed(tensor.shape))
    kind = tensor.tensor_type
    if keep_quantized and kind.name in TYPE_IDS:
        raw = torch.from_numpy(np.array(tensor.data, dtype=np.uint8).reshape(count * rows, -1))
        return [QuantWeight.of(kind.name, raw[j * rows : (j + 1) * rows], cols)
                for j in range(count)]
    whole = (_native_dequantize(tensor) if kind.name in TYPE_IDS and native_loaded()
             else gguf_tensor(tensor, keep_quantized=False))
    assert isinstance(whole, torch.Tensor)
    return list(whole.reshape(count, rows, cols).unbind(0))


def native_loaded() -> bool:
    from qworker.model.kernels import native

    return native.library() is not None


def _native_dequantize(tensor: GGUFTensor) -> torch.Tensor:
    """float32 [n, k] by the native kernel: bit for bit gguf's numpy dequantization, 8x faster."""
    from qworker.model.kernels import native

    raw = torch.from_numpy(np.array(tensor.data, dtype=np.uint8))
    raw = raw.reshape(-1, raw.shape[-1])  # a 3-D tensor's matrices: rows after rows
    rows = torch.arange(raw.shape[0])
    return native.quant_rows(TYPE_IDS[tensor.tensor_type.name], raw, rows, tensor.shape[0])


def _unpermute_qk(tensors: dict[str, Weight], config: ModelConfig) -> None:
    """Undo the row interleaving llama.cpp's converter applies to q/k for its RoPE layout."""
    for i in range(config.num_layers):
        for proj, heads in (("q_proj", config.num_heads), ("k_proj", config.num_kv_heads)):
            for kind in ("weight", "bias"):
                name = f"model.layers.{i}.self_attn.{proj}.{kind}"
                tensor = tensors.get(name)
                if isinstance(tensor, QuantWeight):  # rows are whole runs of blocks
                    tensors[name] = tensor.map_rows(lambda raw, h=heads: _unpermute_rows(raw, h))
                elif tensor is not None:
                    tensors[name] = _unpermute_rows(tensor, heads)


def _unpermute_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    # Stored per head as (half, 2) pairs of rows; HF wants (2, half): first halves, then second.
    rows = weight.shape[0]
    if rows % (2 * heads):
        return weight  # the shape check reports it
    split = weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:])
    return split.transpose(1, 2).reshape(weight.shape).contiguous()


def quantized_gguf(path: str | Path) -> Path | None:
    """The GGUF file of a checkpoint, if it is one holding block-quantized matrices."""
    path = Path(path)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1 or (path / "config.json").is_file():
            return None
        path = ggufs[0]
    if path.suffix.lower() != ".gguf":
        return None
    return path if any(t.tensor_type.name in TYPE_IDS for t in open_gguf(path).tensors) else None


def is_quantized_file(path: str | Path) -> bool:
    return quantized_gguf(path) is not None


def expanded_bytes(path: Path, itemsize: int) -> int:
    """Bytes of a GGUF's matrices expanded to a dense dtype of `itemsize` bytes."""
    return sum(int(t.n_elements) for t in open_gguf(path).tensors) * itemsize


def available_memory() -> int:
    """Bytes this process may still allocate: MemAvailable, or the cgroup's limit if lower."""
    available = 1 << 62
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            available = min(available, int(limit))
    except OSError:
        pass
    return available
