"""Mixtral: Llama's layers with routed experts in every layer: a router picks each token's top k
of the experts by softmax, their weights always rescaled to sum to 1 (`ModelConfig.experts`).
Its HF checkpoints name them `block_sparse_moe.gate` and `block_sparse_moe.experts.N.w1/w3/w2`
(gate, up, down; read as Qwen3-MoE's names, `loading/hf_folder`); llama.cpp writes Mixtral as
`llama` with experts (`llama.expert_count`, 3-D expert tensors), q/k rows permuted."""

from qworker.model.arch.architecture import Architecture

MIXTRAL = Architecture("mixtral", experts=True, experts_normalized=True, gguf_permuted_qk=True)
