"""Tiny random models and engines over the real SmolLM2 tokenizer, for fast exact engine tests."""

from __future__ import annotations

import torch

from qworker.engine.config import EngineConfig
from qworker.engine.engine import Engine
from qworker.model.config import ModelConfig
from qworker.model.llama import LlamaModel
from qworker.model.tokenizer import Tokenizer
from tests.model_harness import TEST_DEVICE


def tiny_model(vocab_size: int, dtype: torch.dtype = torch.float64, seed: int = 0) -> LlamaModel:
    torch.manual_seed(seed)
    config = ModelConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=8, max_position_embeddings=512, tie_word_embeddings=True,
    )
    model = LlamaModel(config, dtype=dtype, device=TEST_DEVICE)
    with torch.no_grad():  # sharper logits than the default init, so sampling is not uniform noise
        model.embed_tokens.weight.normal_(0, 1.0)
    return model


def tiny_engine(tokenizer: Tokenizer, model: LlamaModel, **settings: object) -> Engine:
    defaults: dict[str, object] = dict(num_blocks=256, block_size=4, max_num_seqs=8,
                                       max_batched_tokens=64, prefill_chunk=32)
    return Engine(model, tokenizer, EngineConfig(**{**defaults, **settings}))
