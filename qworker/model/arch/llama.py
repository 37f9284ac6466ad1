"""Llama 2 / 3, SmolLM2, TinyLlama: the family every field's default describes."""

from qworker.model.arch.architecture import Architecture

LLAMA = Architecture("llama", gguf_permuted_qk=True)
