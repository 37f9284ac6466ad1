"""Mistral: Llama's layers; v0.1's sliding window is its config's (`ModelConfig.layer_attention`).
llama.cpp writes Mistral as `llama`; a GGUF that says `mistral` is read unpermuted."""

from qworker.model.arch.architecture import Architecture

MISTRAL = Architecture("mistral")
