"""Gemma 3 (text): q/k RMSNorm per head, norms after attention and after the MLP too, GeGLU (tanh
GELU), embeddings times sqrt(hidden), norms scaling by 1 + w (in float32), tied embeddings. Its
local / global layers (sliding windows, their own RoPE bases) and its attention scale
(`query_pre_attn_scalar`) are the checkpoint's, in `ModelConfig`. HF calls the text model
`gemma3_text`; llama.cpp writes it as `gemma3`, its norms with the 1 already added."""

from qworker.model.arch.architecture import Architecture

GEMMA3 = Architecture("gemma3", qk_norm=True, post_norms=True, norm_offset=1.0,
                      activation="gelu_tanh", tied_embeddings=True, embed_scale=True)
