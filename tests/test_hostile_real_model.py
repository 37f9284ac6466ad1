"""Hostile entries beside innocent jobs, against a real redis-server and a real worker on the real
default model (SmolLM2, float64 so greedy ids compare exactly): token ids beyond the vocabulary,
stop ids beyond it with `min_tokens`, a foreign token in a job's output stream, 1M-character
prompts, prompts past the context, a fault injected into one job's step, an orphaned entry that
is reclaimed (and so runs alone until its first token) and a near-zero temperature.

At the end the worker is still up, every innocent job has its greedy ids unchanged, every bad entry
has its error event and dead letter, and nothing is left pending."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
import torch

from qworker.engine.config import EngineConfig
from qworker.engine.engine import Engine
from qworker.engine.request import SamplingParams
from qworker.engine.sequence import Sequence
from qworker.model.decoder import DecoderModel, load_model
from qworker.model.tokenizer.tokenizer import Tokenizer
from qworker_client.protocol import DoneEvent, ErrorEvent, Job, TokenEvent
from tests.service_harness import (
    KEYS,
    check_stream,
    events,
    group_pending,
    submit,
    thread_worker,
    wait_for,
    wait_terminal,
)

VOCAB = 49152
MAX_TOKENS = 4
INNOCENT = {"moon": "the moon", "owls": "owls"}
MILLION = "x" * 1_000_000
# name -> (wire fields, error code, what the message says)
HOSTILE: dict[str, tuple[dict[str, str], str, str]] = {
    "ids-huge": ({"prompt_token_ids": "[99999999]"}, "invalid_request",
                 "prompt_token_ids[0] = 99999999 is outside the vocabulary (0..49151)"),
    "ids-vocab": ({"prompt_token_ids": f"[1, 2, {VOCAB}]"}, "invalid_request",
                  f"prompt_token_ids[2] = {VOCAB} is outside the vocabulary (0..49151)"),
    "stop-beyond": ({"prompt": "hi", "stop_token_ids": f"[{VOCAB}]", "min_tokens": "2"},
                    "invalid_request", f"stop_token_ids[0] = {VOCAB} is outside"),
    "stop-max-id": ({"prompt": "hi", "stop_token_ids": f"[7, {2**31 - 1}]", "min_tokens": "1"},
                    "invalid_request", f"stop_token_ids[1] = {2**31 - 1} is outside"),
    "readback-beyond": ({"prompt": "hi"}, "invalid_request",
                        "output_token_ids[0] = 99999999 is outside"),
    "ids-past-context": ({"prompt_token_ids": json.dumps([5] * 5000)}, "prompt_too_long",
                         "prompt of 5000 tokens does not fit"),
    "text-past-context": ({"prompt": "x" * 100_000}, "prompt_too_long", "tokens does not fit"),
    "fault": ({"messages": json.dumps([{"role": "user", "content": "Say something."}]),
               "temperature": "0"}, "internal", "IndexError: index out of range"),
    **{f"messages-1m-{k}": ({"messages": json.dumps([{"role": "user", "content": MILLION}])},
                            "prompt_too_long", "characters does not fit")
       for k in range(4)},
    "prompt-1m": ({"prompt": MILLION}, "prompt_too_long", "1000000 characters does not fit"),
}
FAULT_AFTER = 2  # the injected fault hits the "fault" job's step once it has this many tokens
# odd but valid: each must finish with all its tokens
ODD: dict[str, dict[str, str]] = {
    "ids-edges": {"prompt_token_ids": f"[0, {VOCAB - 1}, 1]", "ignore_eos": "true"},
    "sampler-extremes": {"prompt": "Once upon a time", "top_k": "1000000", "min_p": "1",
                         "repetition_penalty": "10", "frequency_penalty": "-2",
                         "presence_penalty": "2", "temperature": "5", "ignore_eos": "true"},
    "stop-ids-in-vocab": {"prompt": "Count: 1, 2, 3,", "stop_token_ids": f"[0, 1, 2, {VOCAB - 1}]",
                          "min_tokens": str(MAX_TOKENS), "ignore_eos": "false"},
}


def chat(topic: str) -> str:
    return json.dumps([{"role": "user", "content": f"Write one sentence about {topic}."}])


@pytest.fixture(scope="module")
def model(smollm2_path: Path) -> DecoderModel:
    return load_model(smollm2_path, dtype=torch.float64)


def engine(model: DecoderModel, tokenizer: Tokenizer) -> Engine:
    return Engine(model, tokenizer, EngineConfig(requeue_preempted=True, max_num_seqs=16,
                                                 block_size=16, num_blocks=256))


def greedy_ids(model: DecoderModel, tokenizer: Tokenizer, messages: list[str]) -> list[list[int]]:
    prompts = [tokenizer.encode_chat(json.loads(m)) for m in messages]
    done = engine(model, tokenizer).generate(
        prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    return [c.token_ids for c in done]


def inject_fault(e: Engine, job_id: str) -> None:
    """An unknown fault: the runner raises whenever the job's sequence is in the step."""
    real_run = e.runner.run

    def run(work: list[tuple[Sequence, int]]) -> dict[Sequence, int]:
        if any(s.request_id == job_id and s.num_output_tokens >= FAULT_AFTER for s, _ in work):
            raise IndexError("index out of range in self")
        return real_run(work)

    e.runner.run = run  # type: ignore[method-assign]


def timed(fn: Callable[[Job], list[int]], seconds: dict[str, float]
          ) -> Callable[[Job], list[int]]:
    def wrapper(job: Job) -> list[int]:
        started = time.perf_counter()
        try:
            return fn(job)
        finally:
            seconds[job.id or ""] = time.perf_counter() - started
    return wrapper


def token_ids(client: redis.Redis, job_id: str) -> list[int]:
    return [e.token_id for e in events(client, job_id) if isinstance(e, TokenEvent)]


@pytest.mark.internal_errors_expected  # the injected fault, and only it
def test_hostile_entries_cost_only_themselves_on_the_real_model(
        redis_url: str, model: DecoderModel, smollm2_tokenizer: Tokenizer,
        monkeypatch: pytest.MonkeyPatch) -> None:
    innocents = {**{f"innocent-{k}": chat(t) for k, t in INNOCENT.items()},
                 "orphan": chat("rivers"), "tiny-temperature": chat("salt")}
    want = dict(zip(innocents, greedy_ids(model, smollm2_tokenizer, list(innocents.values())),
                    strict=True))
    client = redis.Redis.from_url(redis_url)
    # an entry a worker took and then died with: reclaimed, so it runs alone until its first token
    client.xgroup_create(KEYS.jobs, "workers", id="0", mkstream=True)
    submit(client, "orphan", messages=innocents["orphan"], max_tokens=MAX_TOKENS, temperature=0)
    client.xreadgroup("workers", "dead-worker", {KEYS.jobs: ">"}, count=1)
    # a foreign write: a token id beyond the vocabulary in a job's output stream
    client.xadd(KEYS.out("readback-beyond"), {"type": "token", "i": "0", "token_id": "99999999",
                                              "text": "?"})
    encoded: list[int] = []  # characters of every text the worker's tokenizer was given
    real_encode = smollm2_tokenizer.encode

    def encode(text: str, add_special_tokens: bool = False) -> list[int]:
        encoded.append(len(text))
        return real_encode(text, add_special_tokens)

    monkeypatch.setattr(smollm2_tokenizer, "encode", encode)
    worker_engine = engine(model, smollm2_tokenizer)
    inject_fault(worker_engine, "fault")
    prompt_seconds: dict[str, float] = {}  # job id -> time from job to prompt ids (or refusal)
    started = time.monotonic()
    with thread_worker(redis_url, "hostile", worker_engine, claim_idle_ms=1000) as w:
        w.worker._prompt_ids = timed(w.worker._prompt_ids, prompt_seconds)  # type: ignore[method-assign]
        names = list(innocents)[:2]
        for k, (name, (fields, _, _)) in enumerate(HOSTILE.items()):  # interleaved
            submit(client, name, max_tokens=MAX_TOKENS, **fields)
            if k < len(names):
                submit(client, names[k], messages=innocents[names[k]], max_tokens=MAX_TOKENS,
                       temperature=0)
        submit(client, "tiny-temperature", messages=innocents["tiny-temperature"],
               max_tokens=MAX_TOKENS, temperature=1e-300, seed=3)
        for name, fields in ODD.items():
            submit(client, name, max_tokens=MAX_TOKENS, **fields)
        got = wait_terminal(client, [*innocents, *HOSTILE, *ODD], timeout=120)
        wait_for(lambda: group_pending(client) == 0, what="every entry acked")
        assert w.thread.is_alive(), "the worker died"
        assert w.stop() == 0
    elapsed = time.monotonic() - started
    for name, ids in want.items():
        assert isinstance(got[name], DoneEvent), (name, got[name])
        check_stream(client, name)
        assert token_ids(client, name) == ids, name
    for name in ODD:
        assert check_stream(client, name).completion_tokens == MAX_TOKENS, (name, got[name])
    dead = {f[b"source_id"].decode(): f for _, f in client.xrange(KEYS.dead)}
    entry_of = {f[b"id"].decode(): sid for sid, f in dead.items() if b"id" in f}
    for name, (_, code, says) in HOSTILE.items():
        event = got[name]
        assert isinstance(event, ErrorEvent) and event.code == code, (name, event)
        assert says in event.message, (name, event.message)
        if code != "internal":  # refused at the door: a dead letter; the fault is a job failure
            assert name in entry_of and dead[entry_of[name]][b"code"].decode() == code, name
    assert len(token_ids(client, "fault")) == FAULT_AFTER  # its tokens before the fault stay
    bound = (worker_engine.max_seq_len - 1) * 81
    assert max(encoded) <= bound  # no 1M-character text ever reached the tokenizer
    million = {k: v for k, v in prompt_seconds.items() if "-1m" in k}
    assert len(million) == 5 and max(million.values()) < 0.05, million  # refused in milliseconds
    assert worker_engine.blocks.num_free == worker_engine.blocks.num_blocks
    assert group_pending(client) == 0
    print(f"\nhostile suite: {len(HOSTILE) + len(innocents) + len(ODD)} entries "
          f"({len(HOSTILE)} hostile, {len(ODD)} odd but valid), "
          f"0 lost, 0 worker exits, {elapsed:.1f}s; 1M-character prompts refused in at most "
          f"{max(million.values()) * 1000:.1f} ms")
