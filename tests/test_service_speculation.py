"""Speculative decoding through a worker on the simulated engine and a real redis-server: steps
that give a job several tokens still publish one token event each (indices, texts, logprobs), the
texts are those of a worker without speculation, and a job with `speculate: false` is never
drafted."""

from __future__ import annotations

from typing import Any

import redis

from qworker.engine.config import EngineConfig
from qworker.engine.request import Request
from qworker.engine.sequence import Sequence
from qworker.engine.simulated import SimulatedEngine, run_offline
from qworker.service.worker import sampling_params
from qworker_client.protocol import TokenEvent, parse_job_fields
from tests.service_harness import (
    check_stream,
    events,
    sim_engine,
    submit,
    thread_worker,
    wait_terminal,
)

JOBS: dict[str, dict[str, Any]] = {
    "a": {"prompt": "copy: the cat sat on the mat", "max_tokens": 40, "seed": 1, "logprobs": 2},
    "b": {"prompt": "copy: abcabcabc", "max_tokens": 30, "seed": 2, "stop": '["q"]'},
    "out": {"prompt": "no drafts for me", "max_tokens": 30, "seed": 3, "speculate": "false"},
}


def offline_tokens() -> dict[str, list[int]]:
    """Each job's tokens on an engine without speculation."""
    engine = SimulatedEngine(EngineConfig(num_blocks=1000))
    requests = []
    for job_id, fields in JOBS.items():
        job = parse_job_fields({"id": job_id, **{k: str(v) for k, v in fields.items()}}, "0-1")
        requests.append(Request(job_id, engine.tokenizer.encode(job.prompt or ""),
                                sampling_params(job, job_id)))
    return {job_id: r.token_ids for job_id, r in run_offline(engine, requests).items()}


def test_a_speculating_worker_publishes_the_same_tokens_one_event_each(redis_url: str) -> None:
    want = offline_tokens()
    engine = sim_engine(num_speculative_tokens=4, speculate_max_batch=8,
                        speculate_min_acceptance=0.0, speculate_measured=False)
    assert engine.speculator is not None
    drafted: list[str] = []

    def propose(seq: Sequence, k: int) -> list[int]:  # right for 3 tokens, then wrong
        drafted.append(seq.request_id)
        draft = want[seq.request_id][seq.num_output_tokens : seq.num_output_tokens + k]
        return draft[:3] + [(t + 1) % 256 for t in draft[3:]]
    engine.speculator.proposer = propose
    client = redis.Redis.from_url(redis_url)
    try:
        with thread_worker(redis_url, "spec-1", engine):
            for job_id, fields in JOBS.items():
                submit(client, job_id, **fields)
            wait_terminal(client, list(JOBS))
        for job_id in JOBS:
            check_stream(client, job_id)
            tokens = [e for e in events(client, job_id) if isinstance(e, TokenEvent)]
            assert [e.token_id for e in tokens] == want[job_id], job_id
        lp = [e for e in events(client, "a") if isinstance(e, TokenEvent)]
        assert all(e.logprob is not None and len(e.top_logprobs or []) == 2 for e in lp)
    finally:
        client.close()
    assert "out" not in drafted and {"a", "b"} <= set(drafted)
    assert engine.speculator.accepted > 0
    stats = engine.stats()
    assert stats["spec_drafted"] > stats["spec_accepted"] > 0


def test_speculate_on_the_wire_the_cli_and_the_gateway() -> None:
    import argparse

    from qworker_client.commands.submit import add_param_args, add_prompt_args, job_spec
    from qworker_client.gateway.chat.translate import translate

    assert parse_job_fields({"prompt": "x"}, "1-0").speculate is True
    assert parse_job_fields({"prompt": "x", "speculate": "false"}, "1-0").speculate is False
    parser = argparse.ArgumentParser()
    parser.add_argument("prompt")
    add_prompt_args(parser)
    add_param_args(parser)
    assert job_spec(parser.parse_args(["hi", "--no-speculate"]))["speculate"] is False
    assert job_spec(parser.parse_args(["hi"]))["speculate"] is None  # the default: unsent
    body = {"model": "m", "prompt": "hi", "speculate": False}
    assert translate("completion", body, 4).choices[0].spec["speculate"] is False
