"""Random GGUF blocks of every kept format, and tiny Llama (or Qwen2) GGUF files made of them."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
KEPT = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)
_HALVES = {Q.Q4_0: (0,), Q.Q8_0: (0,), Q.Q5_0: (0,), Q.Q4_1: (0, 2), Q.Q5_1: (0, 2),
           Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}  # offsets of a block's f16 scales


def random_blocks(kind: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, row bytes]: random bits, with finite, small scales."""
    elems, nbytes = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, size=(rows, cols // elems, nbytes), dtype=np.uint8)
    for offset in _HALVES[kind]:
        scale = rng.uniform(-0.02, 0.02, size=raw.shape[:2]).astype(np.float16)
        raw[..., offset : offset + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


SIZES = dict(vocab=64, hidden=256, inter=256, layers=1, heads=4, kv_heads=2)
EXPERTS = dict(count=4, per_token=2)  # arch="qwen3moe": each expert's MLP of SIZES["inter"]


def write_tiny_gguf(path: Path, kind: Q, seed: int = 0, tied: bool = True,
                    others: dict[str, Q] | None = None, arch: str = "llama",
                    shard_tensors: int = 0) -> Path:
    """A one-layer Llama whose every matrix is random blocks of `kind` (norms float32), but
    those `others` names by their short name ("attn_v") in another format. arch="qwen2": the
    same with random float32 biases on q, k and v, as Qwen2 files have them. arch="qwen3moe":
    q/k norms, and routed experts (EXPERTS) in place of the MLP: a float32 router and 3-D expert
    tensors, as llama.cpp writes them. shard_tensors: split into shards of that many tensors,
    as llama.cpp's gguf-split does (the first shard's path is returned)."""
    rng = np.random.default_rng(seed)
    s = SIZES
    head_dim = s["hidden"] // s["heads"]
    writer = gguf.GGUFWriter(path, arch, split_max_tensors=shard_tensors)
    writer.add_context_length(256)
    writer.add_embedding_length(s["hidden"])
    writer.add_block_count(s["layers"])
    writer.add_feed_forward_length(s["inter"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(s["vocab"])])
    writer.add_eos_token_id(2)
    moe = arch == "qwen3moe"
    if moe:
        writer.add_expert_count(EXPERTS["count"])
        writer.add_expert_used_count(EXPERTS["per_token"])
        writer.add_expert_feed_forward_length(s["inter"])
    kv = s["kv_heads"] * head_dim
    matrices = {"token_embd.weight": (s["vocab"], s["hidden"])}
    if not tied:
        matrices["output.weight"] = (s["vocab"], s["hidden"])
    for i in range(s["layers"]):
        matrices |= {f"blk.{i}.attn_q.weight": (s["hidden"], s["hidden"]),
                     f"blk.{i}.attn_k.weight": (kv, s["hidden"]),
                     f"blk.{i}.attn_v.weight": (kv, s["hidden"]),
                     f"blk.{i}.attn_output.weight": (s["hidden"], s["hidden"])}
        mlp = "_exps" if moe else ""  # an expert's matrices stacked: [experts, rows, columns]
        matrices |= {f"blk.{i}.ffn_gate{mlp}.weight": (s["inter"], s["hidden"]),
                     f"blk.{i}.ffn_up{mlp}.weight": (s["inter"], s["hidden"]),
                     f"blk.{i}.ffn_down{mlp}.weight": (s["hidden"], s["inter"])}
        if moe:
            router = rng.normal(0, 1, (EXPERTS["count"], s["hidden"])).astype(np.float32)
            writer.add_tensor(f"blk.{i}.ffn_gate_inp.weight", router)
            for norm in ("attn_q_norm", "attn_k_norm"):
                writer.add_tensor(f"blk.{i}.{norm}.weight",
                                  rng.uniform(0.5, 1.5, head_dim).astype(np.float32))
        if arch == "qwen2":
            for proj, rows in (("attn_q", s["hidden"]), ("attn_k", kv), ("attn_v", kv)):
                writer.add_tensor(f"blk.{i}.{proj}.bias",
                                  rng.uniform(-1, 1, rows).astype(np.float32))
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight",
                              rng.uniform(0.5, 1.5, s["hidden"]).astype(np.float32))
    writer.add_tensor("output_norm.weight", np.ones(s["hidden"], np.float32))
    for name, (rows, cols) in matrices.items():
        this = (others or {}).get(name.split(".")[-2], kind)
        stack = EXPERTS["count"] if "_exps" in name else 1
        blocks = random_blocks(this, stack * rows, cols, rng)
        writer.add_tensor(name, blocks.reshape(stack, rows, -1) if stack > 1 else blocks,
                          raw_dtype=this)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return min(path.parent.glob(f"{path.stem}-*-of-*.gguf")) if shard_tensors else path
