"""An architecture: what sets a decoder family apart from Llama, declared once.

The loader reads it (which tensors a checkpoint holds, under which names, how a GGUF lays them out),
the Python layers build from it, and the native decode graph runs it or refuses it (then every step
goes layer by layer). A field's default is Llama's, so a family states only its differences. What
varies between checkpoints of one family (sizes, biases, tied embeddings, the activation, sliding
windows) is the checkpoint's, in `ModelConfig`, which carries its family's declaration.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    name: str  # HF `model_type`, GGUF `general.architecture`
    # norms
    qk_norm: bool = False  # an RMSNorm over each q and each k head, before RoPE (Qwen3)
    post_norms: bool = False  # norms of the attention's and the MLP's outputs too (Gemma 2, 3)
    norm_offset: float = 0.0  # a norm scales by offset + w (Gemma: 1 + w)
    # what a checkpoint leaves unsaid
    activation: str = "silu"  # of the MLP's gate, times up: "silu" | "gelu_tanh"
    qkv_bias: bool = False  # q/k/v biases (Qwen2); a HF config's `attention_bias` says otherwise
    tied_embeddings: bool = False  # the LM head is the embedding, where a HF config does not say
    # embeddings
    embed_scale: bool = False  # embeddings times sqrt(hidden) (Gemma)
    # MLP
    experts: bool = False  # routed experts in place of one MLP (Qwen3-MoE)
    experts_normalized: bool = False  # top k weights sum to 1 where a config does not say (Mixtral)
    # checkpoint layout
    fused_qkv: bool = False  # q, k and v stored as one `qkv_proj` (Phi-3; GGUF `attn_qkv`)
    fused_gate_up: bool = False  # gate and up stored as one `gate_up_proj` (Phi-3; GGUF `ffn_up`)
    gguf_permuted_qk: bool = False  # llama.cpp's converter interleaves q/k rows for its RoPE
