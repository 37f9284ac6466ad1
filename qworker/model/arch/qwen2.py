"""Qwen2 / Qwen2.5: Llama's layers with biases on q, k and v."""

from qworker.model.arch.architecture import Architecture

QWEN2 = Architecture("qwen2", qkv_bias=True)
