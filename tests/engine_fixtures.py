"""Tiny random models and engines over the real SmolLM2 tokenizer, for fast exact engine tests."""

from __future__ import annotations

import torch

from qworker.engine.config import EngineConfig
from qworker.engine.engine import Engine
from qworker.engine.prefix_cache import block_hash
from qworker.engine.sequence import Sequence
from qworker.model.config import ModelConfig
from qworker.model.decoder import DecoderModel
from qworker.model.tokenizer.tokenizer import Tokenizer
from tests.model_harness import TEST_DEVICE


def tiny_model(vocab_size: int, dtype: torch.dtype = torch.float64, seed: int = 0) -> DecoderModel:
    torch.manual_seed(seed)
    config = ModelConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=8, max_position_embeddings=512, tie_word_embeddings=True,
    )
    model = DecoderModel(config, dtype=dtype, device=TEST_DEVICE)
    with torch.no_grad():  # sharper logits than the default init, so sampling is not uniform noise
        model.embed_tokens.weight.normal_(0, 1.0)
    return model


def tiny_engine(tokenizer: Tokenizer, model: DecoderModel, **settings: object) -> Engine:
    defaults: dict[str, object] = dict(num_blocks=256, block_size=4, max_num_seqs=8,
                                       max_batched_tokens=64, prefill_chunk=32)
    return Engine(model, tokenizer, EngineConfig(**{**defaults, **settings}))


def blocks_computed_twice(work: list[tuple[Sequence, int]], block_size: int) -> list[str]:
    """The full blocks (same tokens after the same prefix, same salt) that two sequences of one
    step complete: none with prefix caching, where a later one waits for it to be cached. Not
    counted: a block that holds its sequence's last token, which it computes anyway (to sample).
    A runner hook returns them to the test (an exception there would only fail the step)."""
    writers: dict[bytes, str] = {}
    twice = []
    for seq, n in work:
        parent = None
        for i in range(min(seq.num_computed + n, len(seq.token_ids) - 1) // block_size):
            parent = block_hash(parent, seq.token_ids[i * block_size:(i + 1) * block_size],
                                seq.cache_salt)
            completed_now = (i + 1) * block_size > seq.num_computed
            if completed_now and writers.setdefault(parent, seq.request_id) != seq.request_id:
                twice.append(f"block {i} of {seq.request_id} and of {writers[parent]}")
    return twice
