"""The real default model (SmolLM2-135M-Instruct GGUF) against transformers on the same file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from qworker.engine.config import EngineConfig
from qworker.engine.engine import Engine
from qworker.engine.request import Request, SamplingParams, StepOutput
from qworker.model.decoder import DecoderModel, load_model
from qworker.model.tokenizer.tokenizer import Tokenizer
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
def ours(smollm2_path: Path) -> DecoderModel:
    return load_model(smollm2_path, dtype=torch.float32, device=TEST_DEVICE)


@pytest.fixture(scope="module")
def reference(smollm2_reference: transformers.PreTrainedModel) -> transformers.PreTrainedModel:
    return smollm2_reference


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer: Tokenizer) -> list[list[int]]:
    return [smollm2_tokenizer.encode_chat(chat) for chat in CHATS]


def test_teacher_forced_logits_match(ours: DecoderModel, reference: transformers.PreTrainedModel,
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


def test_greedy_tokens_match(ours: DecoderModel, reference: transformers.PreTrainedModel,
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


def test_logprobs_equal_transformers_log_softmax(ours: DecoderModel,
                                                 reference: transformers.PreTrainedModel,
                                                 prompts: list[list[int]],
                                                 smollm2_tokenizer: Tokenizer) -> None:
    # sampled with a temperature and a penalty (logprobs are the raw distribution's), prompts
    # prefilled in chunks of 16 beside each other's decodes
    engine = Engine(ours, smollm2_tokenizer, EngineConfig(num_blocks=128, max_num_seqs=4,
                                                          prefill_chunk=16,
                                                          max_batched_tokens=32))
    params = SamplingParams(max_tokens=8, temperature=0.8, repetition_penalty=1.3, seed=5,
                            logprobs=5, prompt_logprobs=3, ignore_eos=True)
    outputs: dict[str, list[StepOutput]] = {}
    for i, prompt in enumerate(prompts[:2]):
        engine.add(Request(f"p{i}", prompt, params))
        outputs[f"p{i}"] = []
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
    for i, prompt in enumerate(prompts[:2]):
        outs = outputs[f"p{i}"]
        generated = [t for out in outs for t in out.new_token_ids]
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + generated])).logits[0].float()
        expected = torch.log_softmax(logits, dim=-1)
        given = [e for out in outs for e in out.prompt_logprobs or []]
        positions = list(range(len(prompt) - 1))
        given += [e for out in outs for e in out.logprobs or []]
        positions += [len(prompt) - 1 + k for k in range(len(generated))]
        assert len(given) == len(prompt) - 1 + len(generated)
        for pos, entry in zip(positions, given, strict=True):
            row = expected[pos]
            assert abs(entry.logprob - row[entry.token_id].item()) < 1e-4, (i, pos)
            top = row.topk(len(entry.top)).values.tolist()
            assert [v for _, v in entry.top] == pytest.approx(top, abs=1e-4), (i, pos)
            assert all(abs(row[t].item() - v) < 1e-4 for t, v in entry.top), (i, pos)
