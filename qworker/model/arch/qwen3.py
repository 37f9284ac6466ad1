"""Qwen3 (dense): Llama's layers with an RMSNorm over each q and k head before RoPE, no q/k/v
biases, and a head size of its own (128 at every size)."""

from qworker.model.arch.architecture import Architecture

QWEN3 = Architecture("qwen3", qk_norm=True)
