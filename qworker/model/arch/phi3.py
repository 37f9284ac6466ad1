"""Phi-3: Llama's layers, stored fused: q, k and v as one `qkv_proj` (GGUF `attn_qkv`), gate and up
as one `gate_up_proj` (GGUF `ffn_up`). Phi-3-mini-4k's sliding window is its config's; the
128k variants' LongRoPE is refused (`rope scaling 'longrope'`, GGUF `rope_factors_*`)."""

from qworker.model.arch.architecture import Architecture

PHI3 = Architecture("phi3", fused_qkv=True, fused_gate_up=True)
