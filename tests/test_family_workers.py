"""Models of other families as a user runs them: a tiny GGUF file through `qworker serve`, each
job's greedy tokens those of the same file expanded to float32, or of transformers on the same
weights (every pick clear of the runner-up by more than the kernels' error, so any kernel the
worker chooses gives the same)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis
import torch

from qworker.model.batch import SequenceInput, build_batch
from qworker.model.decoder import DecoderModel, load_model
from qworker.model.kv_cache import KVCache
from qworker_client.protocol import ErrorEvent, TokenEvent
from tests.gguf_writer import write_gguf
from tests.quant_fixtures import Q, write_tiny_gguf
from tests.service_harness import (
    KEYS,
    events,
    spawn_worker,
    stop_process,
    submit,
    wait_for,
    wait_terminal,
)

NEW_TOKENS = 6
KERNEL_ERROR = 1e-3  # of the logits' largest magnitude: the int16 dot is within 5e-4 of float32


def greedy(model: DecoderModel, prompt: list[int]) -> list[int]:
    """NEW_TOKENS greedy tokens, each step recomputed whole; asserts every pick is clear."""
    tokens = list(prompt)
    for _ in range(NEW_TOKENS):
        cache = KVCache.allocate(model.config, 2, 16, model.dtype)
        batch = build_batch([SequenceInput(tokens, 0, [0, 1])], 16)
        logits = model(batch, cache)[0]
        top = logits.topk(2).values
        assert top[0] - top[1] > KERNEL_ERROR * logits.abs().max(), "a near tie: another seed"
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3moe"])  # biases; routed experts kept in blocks
def test_a_kept_quantized_family_serves_through_a_worker(
        redis_url: str, tmp_path: Path, arch: str) -> None:
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", Q.Q8_0, seed=11, arch=arch)
    prompts = {"a": [5, 9, 1, 33], "b": [60, 12, 17, 40, 41], "c": [7]}
    dense = load_model(path, dtype=torch.float32, weights="float32")
    want = {job: greedy(dense, prompt) for job, prompt in prompts.items()}
    log = tmp_path / "worker.log"
    worker = spawn_worker(redis_url, arch, "--model", str(path), "--weights", "quantized",
                          "--dtype", "float32", log_path=log)
    client = redis.Redis.from_url(redis_url)
    try:
        wait_for(lambda: worker.poll() is not None or client.exists(KEYS.worker(arch)),
                 timeout=180, what="the worker to start")
        assert worker.poll() is None, log.read_text()[-2000:]
        for job, prompt in prompts.items():
            submit(client, job, prompt_token_ids=json.dumps(prompt), max_tokens=NEW_TOKENS,
                   temperature=0, ignore_eos="true")
        wait_terminal(client, prompts, timeout=120)
    finally:
        stop_process(worker)
        client.close()
    got = {job: [e.token_id for e in events(redis.Redis.from_url(redis_url), job)
                 if isinstance(e, TokenEvent)] for job in prompts}
    assert got == want
    assert "quantized (Q8_0)" in log.read_text()  # the weights it ran: kept in their blocks


def _hf_greedy(hf: torch.nn.Module, prompt: list[int]) -> list[int]:
    """transformers' greedy tokens, each pick clear of the runner-up."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = hf(torch.tensor([tokens])).logits[0, -1]
            top = logits.topk(2).values
            assert top[0] - top[1] > KERNEL_ERROR * logits.abs().max(), "a near tie: another seed"
            tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]


def test_a_gemma3_base_model_serves_through_a_worker_and_refuses_a_chat(
        redis_url: str, tmp_path: Path) -> None:
    """Local layers with a window of 8 under prompts longer than it, the greedy tokens
    transformers gives; a chat job (the file has no chat template) one invalid_request line."""
    from tests.test_model_reference import hf_model

    hf = hf_model("gemma3", seed=7)
    state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    path = write_gguf(tmp_path / "gemma3.gguf", hf.config, state)
    prompts = {"a": [5, 9, 1, 33, 60, 12, 17, 40, 41, 7, 3, 88], "b": [7, 70, 2, 9, 1],
               "c": [int(t) for t in torch.arange(20) * 4 % 96]}
    want = {job: _hf_greedy(hf, prompt) for job, prompt in prompts.items()}
    log = tmp_path / "worker.log"
    worker = spawn_worker(redis_url, "gemma3", "--model", str(path), "--dtype", "float32",
                          log_path=log)
    client = redis.Redis.from_url(redis_url)
    try:
        wait_for(lambda: worker.poll() is not None or client.exists(KEYS.worker("gemma3")),
                 timeout=180, what="the worker to start")
        assert worker.poll() is None, log.read_text()[-2000:]
        for job, prompt in prompts.items():
            submit(client, job, prompt_token_ids=json.dumps(prompt), max_tokens=NEW_TOKENS,
                   temperature=0, ignore_eos="true")
        submit(client, "chat", messages=json.dumps([{"role": "user", "content": "hi"}]))
        ends = wait_terminal(client, [*prompts, "chat"], timeout=120)
    finally:
        stop_process(worker)
        client.close()
    got = {job: [e.token_id for e in events(redis.Redis.from_url(redis_url), job)
                 if isinstance(e, TokenEvent)] for job in prompts}
    assert got == want
    chat = ends["chat"]
    assert isinstance(chat, ErrorEvent) and chat.code == "invalid_request"
    assert chat.message.startswith("the model has no chat template (a base model)")
    assert "decode_graph_refused" not in log.read_text()  # the graph runs Gemma 3's features
