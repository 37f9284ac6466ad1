"""Checkpoint loading: a Hugging Face safetensors folder or a GGUF file -> config + tensors.

Tensors come back under Hugging Face Llama names (`model.layers.0.self_attn.q_proj.weight`, ...),
checked against the shapes the config implies, so `llama.py` never sees a malformed checkpoint.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from qworker.model.config import SUPPORTED_ARCHITECTURES, ModelConfig, UnsupportedModelError
from qworker.model.kernels.quant_weight import TYPE_IDS, QuantWeight

if TYPE_CHECKING:
    from qworker.model.loading.gguf_file import GGUFFile, GGUFTensor

Weight = torch.Tensor | QuantWeight  # a GGUF block-quantized weight may be kept as it is


class LoaderError(Exception):
    """A checkpoint could not be loaded; the message names the file and the problem."""


class UnsupportedArchitectureError(LoaderError, UnsupportedModelError):
    """The checkpoint is readable but describes a model this worker cannot run."""


# --------------------------------------------------------------------------------------------
# Shapes


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of `config` must hold, by Hugging Face name."""
    hidden, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    q_dim = config.num_heads * config.head_dim
    kv_dim = config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(config.num_layers):
        layer = f"model.layers.{i}."
        shapes |= {
            layer + "self_attn.q_proj.weight": (q_dim, hidden),
            layer + "self_attn.k_proj.weight": (kv_dim, hidden),
            layer + "self_attn.v_proj.weight": (kv_dim, hidden),
            layer + "self_attn.o_proj.weight": (hidden, q_dim),
            layer + "mlp.gate_proj.weight": (inter, hidden),
            layer + "mlp.up_proj.weight": (inter, hidden),
            layer + "mlp.down_proj.weight": (hidden, inter),
            layer + "input_layernorm.weight": (hidden,),
            layer + "post_attention_layernorm.weight": (hidden,),
        }
        if config.attention_bias:
            shapes |= {
                layer + "self_attn.q_proj.bias": (q_dim,),
                layer + "self_attn.k_proj.bias": (kv_dim,),
                layer + "self_attn.v_proj.bias": (kv_dim,),
            }
    return shapes


def _natural_key(name: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def validate(
    config: ModelConfig,
    tensors: Mapping[str, Weight],
    origin: Mapping[str, Path],
    checkpoint: Path,
) -> None:
    """Raise LoaderError unless `tensors` are exactly the tensors `config` needs, in its shapes.

    `origin` says which file each tensor came from, for the message; `checkpoint` is named for
    tensors that are missing.
    """
    expected = expected_shapes(config)
    unexpected = tensors.keys() - expected.keys()
    if unexpected:
        first = min(unexpected, key=_natural_key)
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise LoaderError(
            f"{origin.get(first, checkpoint)}: unexpected tensor {first!r}{more} "
            f"for a {config.architecture} model with {config.num_layers} layers"
            f"{', tied embeddings' if config.tie_word_embeddings else ''}"
            f"{'' if config.attention_bias else ', no attention bias'}"
        )
    missing = [name for name in expected if name not in tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise LoaderError(f"{checkpoint}: missing tensor {missing[0]!r}{more}")
    wrong = [name for name, shape in expected.items() if tuple(tensors[name].shape) != shape]
    if wrong:
        name = wrong[0]
        others = f" (and {len(wrong) - 1} more of the wrong shape)" if len(wrong) > 1 else ""
        raise LoaderError(
            f"{origin.get(name, checkpoint)}: tensor {name!r} has shape "
            f"{tuple(tensors[name].shape)}, but the config implies {expected[name]}{others}"
        )


# --------------------------------------------------------------------------------------------
# Entry point


def load_checkpoint(path: str | Path,
                    keep_quantized: bool = False) -> tuple[ModelConfig, dict[str, Weight]]:
    """Load a HF safetensors folder, a `.gguf` file, or a folder holding exactly one `.gguf`.
    With keep_quantized, a GGUF's block-quantized matrices come back as `QuantWeight`s (their
    blocks as stored); otherwise every tensor is dequantized."""
    path = Path(path)
    if not path.exists():
        raise LoaderError(f"{path}: no such file or directory")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise LoaderError(f"{path}: not a .gguf file (pass a GGUF file or a checkpoint folder)")
        return load_gguf(path, keep_quantized)
    if (path / "config.json").is_file():
        return dict_of_weights(load_hf_folder(path))
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return load_gguf(ggufs[0], keep_quantized)
    if ggufs:
        names = ", ".join(p.name for p in ggufs)
        raise LoaderError(f"{path}: holds {len(ggufs)} .gguf files ({names}); pass one of them")
    raise LoaderError(f"{path}: neither a config.json nor a .gguf file in this folder")


def dict_of_weights(loaded: tuple[ModelConfig, dict[str, torch.Tensor]]
                    ) -> tuple[ModelConfig, dict[str, Weight]]:
    return loaded[0], dict(loaded[1])


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


def keep_quantized_by_default(path: str | Path, itemsize: int) -> bool:
    """`--weights auto`: a quantized GGUF stays in its blocks only where its expanded weights
    (with the packs made from them at load, up to twice as much) would not fit comfortably in
    memory. Where they fit, the dense kernels are the faster ones (SmolLM2 Q4_1 on an AVX2 Zen 1:
    workload v1 at 101 tok/s expanded to float32 against 67 kept in its blocks) and exact."""
    file = quantized_gguf(path)
    if file is None:
        return False
    return 2 * expanded_bytes(file, itemsize) > 0.5 * available_memory()


# --------------------------------------------------------------------------------------------
# Hugging Face folders

INDEX_FILE = "model.safetensors.index.json"
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
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # some exporters save the tied copy anyway
    validate(config, tensors, origin, folder)
    return config, tensors


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
        return ModelConfig.from_hf(raw)
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


# --------------------------------------------------------------------------------------------
# GGUF

_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
SUPPORTED_GGUF_TYPES = ("F32", "F16", "BF16", *TYPE_IDS)  # Q4_0 ... Q6_K
# General end-of-generation tokens llama.cpp also stops on when a file marks them as control tokens.
_EOG_TOKEN_TEXTS = frozenset(
    {"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>"}
)
_CONTROL_TOKEN = 3  # llama.cpp's token type for special tokens such as <|im_end|>


def open_gguf(path: Path) -> GGUFFile:
    """The GGUF file at `path`, with any parse failure as a LoaderError."""
    from qworker.model.loading.gguf_file import (  # imports gguf: only when used
        GGUFFile,
        GGUFFormatError,
    )

    try:
        return GGUFFile(path)
    except (GGUFFormatError, OSError, UnicodeDecodeError, struct.error) as exc:
        raise LoaderError(f"{path}: not a readable GGUF file: {exc}") from exc


def gguf_value(reader: GGUFFile, key: str, default: Any = None) -> Any:
    """A metadata value (int, float, str, bool or list), or `default` when the key is absent."""
    return reader.get(key, default)


def gguf_eos_token_ids(reader: GGUFFile) -> tuple[int, ...]:
    """The file's eos / eot / eom ids, then any other control token that ends generation."""
    ids = [gguf_value(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    tokens = gguf_value(reader, "tokenizer.ggml.tokens", [])
    types = gguf_value(reader, "tokenizer.ggml.token_type", [])
    pairs = enumerate(zip(tokens, types, strict=False))
    ids += [i for i, (text, kind) in pairs if text in _EOG_TOKEN_TEXTS and kind == _CONTROL_TOKEN]
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def load_gguf(path: Path, keep_quantized: bool = False) -> tuple[ModelConfig, dict[str, Weight]]:
    reader = open_gguf(path)
    config = gguf_config(reader, path)
    _check_gguf_types(reader, path)
    tensors = {_hf_name(t.name, path): _gguf_tensor(t, keep_quantized) for t in reader.tensors}
    if config.architecture == "llama":
        _unpermute_qk(tensors, config)
    validate(config, tensors, dict.fromkeys(tensors, path), path)
    return config, tensors


def gguf_config(reader: GGUFFile, path: Path) -> ModelConfig:
    """The ModelConfig a GGUF's metadata describes."""
    arch = gguf_value(reader, "general.architecture")
    if arch is None:
        raise LoaderError(f"{path}: no general.architecture in the GGUF metadata")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{path}: unsupported architecture {arch!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

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
    if "rope_freqs.weight" in names:
        raise UnsupportedArchitectureError(
            f"{path}: rope_freqs (Llama 3 RoPE scaling) is not supported"
        )
    hidden, heads = need("embedding_length"), need("attention.head_count")
    head_dim = get("attention.key_length", hidden // heads)
    if get("rope.dimension_count", head_dim) != head_dim:
        raise UnsupportedArchitectureError(f"{path}: partial rotary embeddings are not supported")
    try:
        return ModelConfig(
            vocab_size=_gguf_vocab_size(reader),
            hidden_size=hidden,
            intermediate_size=need("feed_forward_length"),
            num_layers=need("block_count"),
            num_heads=heads,
            num_kv_heads=get("attention.head_count_kv", heads),
            head_dim=head_dim,
            max_position_embeddings=get("context_length", 2048),
            rms_norm_eps=_shortest_f32(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=_shortest_f32(get("rope.freq_base", 10000.0)),
            rope_scaling=_gguf_rope_scaling(reader, arch),
            tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            architecture=arch,
            bos_token_id=gguf_value(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_ids=gguf_eos_token_ids(reader),
        )
    except UnsupportedModelError as exc:
        raise UnsupportedArchitectureError(f"{path}: {exc}") from exc


def _shortest_f32(value: float) -> float:
    """GGUF stores float32: give 1e-05 back rather than 9.999999747378752e-06 (same float32)."""
    return float(str(np.float32(value)))


def _gguf_vocab_size(reader: GGUFFile) -> int:
    tokens = reader.get("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens)
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    return 0 if embed is None else int(embed.shape[-1])


def _gguf_rope_scaling(reader: GGUFFile, arch: str) -> dict[str, Any] | None:
    kind = gguf_value(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = gguf_value(reader, f"{arch}.rope.scaling.factor")
    scaling: dict[str, Any] = {"rope_type": kind, "factor": factor}
    original = gguf_value(reader, f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = original
    return scaling


def _check_gguf_types(reader: GGUFFile, path: Path) -> None:
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in SUPPORTED_GGUF_TYPES:
            raise LoaderError(
                f"{path}: tensor {tensor.name!r} has GGUF type {tensor.tensor_type.name}, which is "
                f"not supported (supported: {', '.join(SUPPORTED_GGUF_TYPES)})"
            )


def _hf_name(gguf_name: str, path: Path) -> str:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    match = _GGUF_LAYER_RE.fullmatch(gguf_name)
    if match and match[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{match[1]}.{_GGUF_LAYER_NAMES[match[2]]}.{match[3]}"
    raise LoaderError(f"{path}: unknown GGUF tensor {gguf_name!r}")


def _gguf_tensor(tensor: GGUFTensor, keep_quantized: bool) -> Weight:
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


def native_loaded() -> bool:
    from qworker.model.kernels import native

    return native.library() is not None


def _native_dequantize(tensor: GGUFTensor) -> torch.Tensor:
    """float32 [n, k] by the native kernel: bit for bit gguf's numpy dequantization, 8x faster."""
    from qworker.model.kernels import native

    raw = torch.from_numpy(np.array(tensor.data, dtype=np.uint8))
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
