"""Logprobs through a worker on the simulated engine and a real redis-server: the token events
carry them (only for jobs that ask), one prompt_logprobs event comes before the first token, a
preempted and resumed job gives the same ones, and the clients expose them."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import redis

from qworker.engine.config import EngineConfig
from qworker.engine.request import Request, StepOutput
from qworker.engine.simulated import SimulatedEngine
from qworker.service.worker import sampling_params
from qworker_client import Producer
from qworker_client.aio import AsyncProducer
from qworker_client.protocol import (
    DoneEvent,
    PromptLogprobsEvent,
    TokenEvent,
    parse_event,
    parse_job_fields,
)
from tests.service_harness import KEYS, sim_engine, submit, thread_worker, wait_terminal

ASKING = {"prompt": "score this prompt", "max_tokens": 24, "seed": 7, "ignore_eos": True,
          "logprobs": 3, "prompt_logprobs": 2, "logprobs_text": True}


def offline(job_id: str, fields: dict[str, object]) -> list[StepOutput]:
    """The engine's own outputs for the job, run alone with a roomy cache."""
    engine = SimulatedEngine(EngineConfig(num_blocks=1000))
    job = parse_job_fields({k: str(v).lower() if isinstance(v, bool) else str(v)
                            for k, v in {"id": job_id, **fields}.items()}, "0-1")
    engine.add(Request(job_id, engine.tokenizer.encode(job.prompt or ""),
                       sampling_params(job, job_id)))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def text_of(token_id: int) -> str:
    """The byte tokenizer's text of one token (a lone byte >= 128 is U+FFFD)."""
    return bytes([token_id]).decode(errors="replace")


def raw_events(client: redis.Redis, job_id: str) -> list[dict[bytes, bytes]]:
    return [fields for _, fields in client.xrange(KEYS.out(job_id))]


def test_token_events_carry_logprobs_and_the_prompt_event_comes_first(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    with thread_worker(redis_url, "w1"):
        submit(client, "lp", **ASKING)
        submit(client, "plain", prompt="score this prompt", max_tokens=5)
        wait_terminal(client, ["lp", "plain"])
    plain = raw_events(client, "plain")
    assert all(set(f) == {b"type", b"i", b"token_id", b"text"} for f in plain[:-1]), plain[0]

    evs = [parse_event(f) for f in raw_events(client, "lp")]
    assert isinstance(evs[0], PromptLogprobsEvent)
    assert not any(isinstance(e, PromptLogprobsEvent) for e in evs[1:])
    tokens = [e for e in evs if isinstance(e, TokenEvent)]
    assert isinstance(evs[-1], DoneEvent) and len(tokens) == 24
    outs = offline("lp", ASKING)
    engine_lp = [e for o in outs for e in o.logprobs or []]
    assert [(t.token_id, t.logprob) for t in tokens] == [(e.token_id, e.logprob)
                                                         for e in engine_lp]
    for token, entry in zip(tokens, engine_lp, strict=True):
        assert token.top_logprobs is not None
        assert [(t.token_id, t.logprob) for t in token.top_logprobs] == list(entry.top)
        assert token.token == text_of(token.token_id)
        assert all(t.token == text_of(t.token_id) for t in token.top_logprobs)
    prompt = list(b"score this prompt")
    first = evs[0].prompt_logprobs
    assert [e.token_id for e in first] == prompt[1:]
    assert [e.logprob for e in first] == [e.logprob for e in outs[0].prompt_logprobs]
    assert all(e.top_logprobs is not None and len(e.top_logprobs) == 2 for e in first)


def test_a_preempted_job_resumes_with_the_same_logprobs(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    ids = [f"j{i}" for i in range(6)]
    fields = {**ASKING, "max_tokens": 40}
    # a pool of 12 blocks of 16 tokens: six jobs of 17 + 40 tokens preempt each other
    engine = sim_engine(num_blocks=12, block_size=16)
    with thread_worker(redis_url, "w1", engine=engine):
        for job_id in ids:
            submit(client, job_id, **fields)
        wait_terminal(client, ids)
    for job_id in ids:
        evs = [parse_event(f) for f in raw_events(client, job_id)]
        assert sum(isinstance(e, PromptLogprobsEvent) for e in evs) == 1, job_id
        tokens = [e for e in evs if isinstance(e, TokenEvent)]
        engine_lp = [e for o in offline(job_id, fields) for e in o.logprobs or []]
        assert [(t.i, t.logprob) for t in tokens] == [
            (i, e.logprob) for i, e in enumerate(engine_lp)], job_id
    assert engine.num_preemptions > 0, "the test needs a preemption"


def test_the_clients_return_the_logprobs(redis_url: str) -> None:
    with thread_worker(redis_url, "w1"), Producer(redis_url) as producer:
        job = producer.submit("score this prompt", max_tokens=6, logprobs=2, prompt_logprobs=0)
        result = job.result(timeout=30)
        assert result.logprobs is not None and len(result.logprobs) == 6
        assert all(e.top_logprobs is not None and len(e.top_logprobs) == 2
                   for e in result.logprobs)
        assert result.prompt_logprobs is not None and len(result.prompt_logprobs) == 16
        assert all(e.top_logprobs is None for e in result.prompt_logprobs)
        plain = producer.submit("score this prompt", max_tokens=3).result(timeout=30)
        assert plain.logprobs is None and plain.prompt_logprobs is None

        async def read_async() -> None:
            async with AsyncProducer(redis_url) as aio:
                again = await aio.job(job.id).result(timeout=30)
                assert again.logprobs == result.logprobs
                assert again.prompt_logprobs == result.prompt_logprobs

        asyncio.run(read_async())


def test_submit_and_tail_show_the_logprobs(redis_url: str) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "qworker_client", *args, "--redis-url",
                               redis_url], capture_output=True, text=True, timeout=60)

    with thread_worker(redis_url, "w1"):
        submitted = cli("submit", "score this", "--raw", "--id", "c1", "--max-tokens", "4",
                        "--logprobs", "2", "--prompt-logprobs", "1", "--json")
    assert submitted.returncode == 0, submitted.stderr
    result = json.loads(submitted.stdout)
    assert len(result["logprobs"]) == 4 and len(result["prompt_logprobs"]) == 9
    assert all(len(e["top_logprobs"]) == 2 for e in result["logprobs"])
    lines = [json.loads(line) for line in cli("tail", "c1", "--json").stdout.splitlines()]
    assert [line["type"] for line in lines] == ["prompt_logprobs"] + ["token"] * 4 + ["done"]
    assert lines[0]["prompt_logprobs"] == result["prompt_logprobs"]
    assert [line["logprob"] for line in lines[1:5]] == [e["logprob"] for e in result["logprobs"]]
    rows = cli("tail", "c1", "--logprobs").stdout.splitlines()
    assert [row.split("\t")[:3] for row in rows] == [
        [str(i), str(e["token_id"]), f"{e['logprob']:.4f}"]
        for i, e in enumerate(result["logprobs"])]
