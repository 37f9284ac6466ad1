"""Qwen3-MoE: Qwen3's layers (q/k RMSNorm per head, no q/k/v bias) with routed experts in place of
the MLP: a router picks each token's top k of the layer's experts by softmax, their weights
rescaled to sum to 1 where the checkpoint says (`norm_topk_prob`; llama.cpp always does), and the
token's output is the experts' outputs so weighted. Layers listed in `mlp_only_layers`, or off
the `decoder_sparse_step`, keep one dense MLP (`ModelConfig.experts`). GGUF calls it `qwen3moe`."""

from qworker.model.arch.architecture import Architecture

QWEN3_MOE = Architecture("qwen3_moe", qk_norm=True, experts=True)
