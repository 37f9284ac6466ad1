"""GGUF files of real models' shapes with random weights, for benchmarks at real sizes: a model's
speed does not depend on its weights' values. The quantization follows llama.cpp's type mix for
the named file type (Q4_K_M: Q4_K, with Q6_K for the LM head, or the embedding where it is tied,
and for the `attn_v` and `ffn_down` of the layers llama.cpp gives more bits).

    .venv/bin/python -m benchmarks.real_shapes qwen2-1.5b [--type Q4_K_M] [--dir /tmp]

Prints the file's path (written once: an existing file of that name is reused). Then, e.g.:

    .venv/bin/python -m benchmarks.single_stream --model /tmp/qworker-qwen2-1.5b-Q4_K_M.gguf

A shape with experts (`qwen3moe-small`) writes llama.cpp's 3-D `ffn_*_exps` tensors and a float32
router (`ffn_gate_inp`) per layer.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from qworker.model.layers.rope import llama3_divisors

Q = gguf.GGMLQuantizationType
# a block's f16 scales: byte offsets (the rest of a block is any bits)
_SCALE_OFFSETS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
                  Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


@dataclass(frozen=True)
class Shape:
    arch: str  # the GGUF's general.architecture
    vocab: int
    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    context: int
    rope_theta: float
    tied: bool
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3
    llama3_rope: dict[str, float] | None = None  # stored as rope_freqs.weight
    experts: int = 0  # routed experts in place of every layer's MLP (a float32 router), or 0
    experts_used: int = 0  # per token
    expert_inter: int = 0  # an expert's MLP width


SHAPES = {
    "llama2-7b": Shape("llama", vocab=32000, hidden=4096, inter=11008, layers=32, heads=32,
                       kv_heads=32, head_dim=128, context=4096, rope_theta=1e4, tied=False),
    "qwen2-1.5b": Shape("qwen2", vocab=151936, hidden=1536, inter=8960, layers=28, heads=12,
                        kv_heads=2, head_dim=128, context=32768, rope_theta=1e6, tied=True,
                        qkv_bias=True),
    "qwen2-7b": Shape("qwen2", vocab=152064, hidden=3584, inter=18944, layers=28, heads=28,
                      kv_heads=4, head_dim=128, context=32768, rope_theta=1e6, tied=False,
                      qkv_bias=True),
    "qwen3-0.6b": Shape("qwen3", vocab=151936, hidden=1024, inter=3072, layers=28, heads=16,
                        kv_heads=8, head_dim=128, context=40960, rope_theta=1e6, tied=True,
                        qk_norm=True),
    "llama3.2-1b": Shape("llama", vocab=128256, hidden=2048, inter=8192, layers=16, heads=32,
                         kv_heads=8, head_dim=64, context=131072, rope_theta=5e5, tied=True,
                         llama3_rope={"factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192}),
    # Qwen3-30B-A3B's experts (128, top 8, each 768 wide) and attention heads, at half its
    # hidden size and 8 of its 48 layers: ~1.5 GB as Q4_K_M
    "qwen3moe-small": Shape("qwen3moe", vocab=151936, hidden=1024, inter=768, layers=8, heads=32,
                            kv_heads=4, head_dim=128, context=40960, rope_theta=1e6, tied=True,
                            qk_norm=True, experts=128, experts_used=8, expert_inter=768),
}
FILE_TYPES = ("Q4_K_M", "Q8_0", "Q4_0", "BF16")


def random_blocks(kind: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, row bytes] of `kind`: random bits with small, finite f16 scales."""
    elems, nbytes = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, size=(rows, cols // elems, nbytes), dtype=np.uint8)
    for offset in _SCALE_OFFSETS[kind]:
        scale = rng.uniform(0.001, 0.004, size=raw.shape[:2]).astype(np.float16)
        raw[..., offset : offset + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's `use_more_bits`: the first and last eighth of the layers, every third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_type(file_type: str, name: str, shape: Shape) -> Q:
    """The type llama.cpp gives the tensor `name` in a file of `file_type`."""
    if file_type != "Q4_K_M":
        return Q[file_type]
    head = name == "output.weight" or (shape.tied and name == "token_embd.weight")
    if head:
        return Q.Q6_K
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    more_bits = ("attn_v.weight", "ffn_down.weight", "ffn_down_exps.weight")
    if name.endswith(more_bits) and _more_bits(layer, shape.layers):
        return Q.Q6_K
    return Q.Q4_K


def matrices(shape: Shape) -> dict[str, tuple[int, int]]:
    """Every matrix's GGUF name and (rows, columns); an expert tensor's (`_exps`): one expert's
    (it stacks `Shape.experts` of them)."""
    s, q, kv = shape, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    out = {"token_embd.weight": (s.vocab, s.hidden)}
    if not s.tied:
        out["output.weight"] = (s.vocab, s.hidden)
    for i in range(s.layers):
        out |= {f"blk.{i}.attn_q.weight": (q, s.hidden), f"blk.{i}.attn_k.weight": (kv, s.hidden),
                f"blk.{i}.attn_v.weight": (kv, s.hidden),
                f"blk.{i}.attn_output.weight": (s.hidden, q)}
        mlp, inter = ("_exps", s.expert_inter) if s.experts else ("", s.inter)
        out |= {f"blk.{i}.ffn_gate{mlp}.weight": (inter, s.hidden),
                f"blk.{i}.ffn_up{mlp}.weight": (inter, s.hidden),
                f"blk.{i}.ffn_down{mlp}.weight": (s.hidden, inter)}
    return out


def routers(shape: Shape) -> dict[str, tuple[int, int]]:
    """Every layer's float32 router (as llama.cpp's quantizer leaves it) and its shape."""
    return {f"blk.{i}.ffn_gate_inp.weight": (shape.experts, shape.hidden)
            for i in range(shape.layers) if shape.experts}


def _stack(name: str, shape: Shape) -> int:
    return shape.experts if "_exps" in name else 1


def vectors(shape: Shape) -> dict[str, int]:
    """Every float32 vector (norms, biases, RoPE factors) and its length."""
    s, kv = shape, shape.kv_heads * shape.head_dim
    out = {"output_norm.weight": s.hidden}
    if s.llama3_rope:
        out["rope_freqs.weight"] = s.head_dim // 2
    for i in range(s.layers):
        out |= {f"blk.{i}.attn_norm.weight": s.hidden, f"blk.{i}.ffn_norm.weight": s.hidden}
        if s.qkv_bias:
            out |= {f"blk.{i}.attn_q.bias": s.heads * s.head_dim, f"blk.{i}.attn_k.bias": kv,
                    f"blk.{i}.attn_v.bias": kv}
        if s.qk_norm:
            out |= {f"blk.{i}.attn_q_norm.weight": s.head_dim,
                    f"blk.{i}.attn_k_norm.weight": s.head_dim}
    return out


def _metadata(writer: gguf.GGUFWriter, shape: Shape) -> None:
    s = shape
    writer.add_context_length(s.context)
    writer.add_embedding_length(s.hidden)
    writer.add_block_count(s.layers)
    writer.add_feed_forward_length(s.inter)
    writer.add_head_count(s.heads)
    writer.add_head_count_kv(s.kv_heads)
    writer.add_key_length(s.head_dim)
    writer.add_value_length(s.head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(s.rope_theta)
    if s.experts:
        writer.add_expert_count(s.experts)
        writer.add_expert_used_count(s.experts_used)
        writer.add_expert_feed_forward_length(s.expert_inter)
    # a placeholder byte-level BPE vocabulary that llama.cpp and our tokenizer load: its
    # newline token ("Ċ") and one merge of two of its tokens
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["Ċ", "t", "u", "tu", *(f"x{i}" for i in range(4, s.vocab))])
    writer.add_token_merges(["t u"])
    writer.add_eos_token_id(2)


def write(path: Path, shape: Shape, file_type: str, seed: int = 0) -> Path:
    """The file, tensor by tensor (the writer never holds the whole model)."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, shape.arch)
    _metadata(writer, shape)
    mats, vecs = matrices(shape), vectors(shape)
    for name, (rows, cols) in mats.items():
        kind, stack = tensor_type(file_type, name, shape), _stack(name, shape)
        lead = (stack,) if stack > 1 else ()
        if kind == Q.BF16:
            writer.add_tensor_info(name, (*lead, rows, cols), np.dtype(np.uint16),
                                   stack * rows * cols * 2, raw_dtype=kind)
        else:
            elems, nbytes = gguf.GGML_QUANT_SIZES[kind]
            row_bytes = cols // elems * nbytes
            writer.add_tensor_info(name, (*lead, rows, row_bytes), np.dtype(np.uint8),
                                   stack * rows * row_bytes, raw_dtype=kind)
    for name, (rows, cols) in routers(shape).items():
        writer.add_tensor_info(name, (rows, cols), np.dtype(np.float32), 4 * rows * cols)
    for name, n in vecs.items():
        writer.add_tensor_info(name, (n,), np.dtype(np.float32), 4 * n)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, (rows, cols) in mats.items():
        kind, stack = tensor_type(file_type, name, shape), _stack(name, shape)
        if kind == Q.BF16:
            values = rng.normal(0, 0.02, size=(stack * rows, cols)).astype(np.float32)
            writer.write_tensor_data((values.view(np.uint32) >> 16).astype(np.uint16))
        else:
            writer.write_tensor_data(random_blocks(kind, stack * rows, cols, rng))
    for rows, cols in routers(shape).values():
        writer.write_tensor_data(rng.normal(0, 0.05, size=(rows, cols)).astype(np.float32))
    for name, n in vecs.items():
        if name == "rope_freqs.weight":
            writer.write_tensor_data(llama3_divisors(shape.head_dim, shape.rope_theta,
                                                     shape.llama3_rope or {}).numpy())
        elif name.endswith(".bias"):
            writer.write_tensor_data(rng.normal(0, 0.1, n).astype(np.float32))
        else:
            writer.write_tensor_data(rng.uniform(0.5, 1.5, n).astype(np.float32))
    writer.close()
    return path


def model_file(name: str, file_type: str = "Q4_K_M", directory: Path = Path("/tmp")) -> Path:
    """The path of `name`'s file of `file_type` in `directory`, written if it is not there."""
    path = directory / f"qworker-{name}-{file_type}.gguf"
    if not path.is_file():
        partial = path.with_name(f".{path.name}.partial")
        write(partial, SHAPES[name], file_type)
        partial.rename(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=sorted(SHAPES))
    parser.add_argument("--type", default="Q4_K_M", choices=FILE_TYPES)
    parser.add_argument("--dir", type=Path, default=Path("/tmp"))
    args = parser.parse_args()
    print(model_file(args.name, args.type, args.dir))


if __name__ == "__main__":
    main()
