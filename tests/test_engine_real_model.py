"""The real default model through the engine: batched greedy texts equal one-at-a-time runs."""

from __future__ import annotations

from pathlib import Path

import torch

from qworker.engine.config import EngineConfig
from qworker.engine.engine import Engine
from qworker.engine.request import SamplingParams
from qworker.model.decoder import load_model
from qworker.model.tokenizer.tokenizer import Tokenizer

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion to a child in two sentences.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
    "What does a KV cache store in a transformer?",
    "Give me a name for a pet turtle.",
    "Why is the sky blue?",
]


def test_generate_batched_equals_one_at_a_time(smollm2_path: Path,
                                               smollm2_tokenizer: Tokenizer) -> None:
    model = load_model(smollm2_path, dtype=torch.float32)
    config = EngineConfig(num_blocks=256, block_size=16, max_num_seqs=8, prefill_chunk=24,
                          max_batched_tokens=64)
    engine = Engine(model, smollm2_tokenizer, config)
    prompts = [smollm2_tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    batched = engine.generate(prompts, params)
    alone = [engine.generate([p], params)[0] for p in prompts]
    assert [c.text for c in batched] == [c.text for c in alone]
    assert all(c.text.strip() for c in batched), "the model said nothing"
    assert "Paris" in batched[0].text
