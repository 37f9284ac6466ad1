"""The real default model (SmolLM2-135M-Instruct GGUF) against transformers on the same file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from qworker.engine.config import EngineConfig
from qworker.engine.engine import Engine
from qworker.engine.request import SamplingParams
from qworker.model.llama import LlamaModel, load_model
from qworker.model.tokenizer import Tokenizer
from tests.model_harness import TEST_DEVICE, run_schedule

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Name three colours."}],
    [{"role": "user", "content": "Write a Python function that adds two numbers."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a fun fact about octopuses."}],
]


@pytest.fixture(scope="module")
def ours(smollm2_path: Path) -> LlamaModel:
    return load_model(smollm2_path, dtype=torch.float32, device=TEST_DEVICE)


@pytest.fixture(scope="module")
def reference(smollm2_path: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer: Tokenizer) -> list[list[int]]:
    return [smollm2_tokenizer.encode_chat(chat) for chat in CHATS]


def test_teacher_forced_logits_match(ours: LlamaModel, reference: transformers.PreTrainedModel,
                                     prompts: list[list[int]]) -> None:
    # prefill in chunks of 16 with all four prompts packed in each step
    longest = max(len(p) for p in prompts)
    schedule = []
    for start in range(0, longest, 16):
        schedule.append([(i, min(16, len(p) - start)) for i, p in enumerate(prompts)
                         if start < len(p)])
    with torch.no_grad():
        expected = [reference(torch.tensor([p])).logits[0] for p in prompts]
    for seq, pos, logits in run_schedule(ours, prompts, schedule, block_size=16):
        err = (logits - expected[seq][pos]).abs().max().item()
        assert err < 1e-3, f"prompt {seq} position {pos}: max abs error {err:.3g}"


def test_greedy_tokens_match(ours: LlamaModel, reference: transformers.PreTrainedModel,
                             prompts: list[list[int]], smollm2_tokenizer: Tokenizer) -> None:
    engine = Engine(ours, smollm2_tokenizer, EngineConfig(num_blocks=128, max_num_seqs=4))
    # min_tokens bans EOS as min_new_tokens does in transformers
    params = SamplingParams(max_tokens=32, min_tokens=32, temperature=0.0)
    completions = engine.generate(prompts, params)
    for prompt, completion in zip(prompts, completions, strict=True):
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32,
                                     do_sample=False, pad_token_id=0)
        assert completion.token_ids == out[0, len(prompt):].tolist()
