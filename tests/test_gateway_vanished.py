"""Requests whose jobs vanished from Redis end (issue 34): after an XTRIM of the jobs stream, or a
Redis restarted empty, every open gateway request ends within 10 s with `lost_state`, streamed or
not; a job still there (its entry in another stream, or owned by a worker) keeps waiting."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import redis

from qworker_client.protocol import DoneEvent, event_to_fields
from tests.conftest import RedisServer
from tests.gateway_harness import OpenRequest, gateway
from tests.service_harness import KEYS, wait_for

ENDS_WITHIN_S = 10.0


def no_worker_serves(r: redis.Redis, *models: str) -> None:
    """Live worker keys for `models`, and no worker: their jobs wait in the queue."""
    for model in models:
        r.set(KEYS.worker(model), json.dumps({"name": model, "model": model}), ex=120)


def open_requests(url: str, model: str, count: int) -> list[OpenRequest]:
    """`count` requests for `model`, every other one streamed."""
    return [OpenRequest(f"{url}/v1/completions", {"model": model, "prompt": f"wait {k}",
                                                  "max_tokens": 4, "stream": k % 2 == 0})
            for k in range(count)]


def assert_lost(requests: list[OpenRequest], since: float) -> None:
    """Each ended within ENDS_WITHIN_S of `since`, with `lost_state` (503 when not streamed)."""
    for request in requests:
        request.join(since + ENDS_WITHIN_S + 1 - time.monotonic())
        assert request.ended_at is not None, request.body
        assert request.ended_at - since < ENDS_WITHIN_S, request.ended_at - since
        assert request.failure is None and request.error_codes() == ["lost_state"], request
        assert request.done if request.body["stream"] else request.status == 503


def finish(r: redis.Redis, job_id: str) -> None:
    r.xadd(KEYS.out(job_id), event_to_fields(DoneEvent(finish_reason="stop", text="",
                                                       prompt_tokens=1, completion_tokens=0)))


def test_an_xtrim_of_the_jobs_stream_ends_the_requests_of_its_jobs(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    no_worker_serves(r, "idle", "other")
    with gateway(redis_url) as url:
        trimmed = open_requests(url, "idle", 6)
        owned, untouched = open_requests(url, "idle", 1) + open_requests(url, "other", 1)
        wait_for(lambda: r.xlen(KEYS.jobs_of("idle")) == 7 and owned.status == 200,
                 what="the jobs queued")
        r.hset(KEYS.owner(owned.job_ids[0]), "worker", "w/busy-with-its-prefill")
        trimmed_at = time.monotonic()
        r.xtrim(KEYS.jobs_of("idle"), maxlen=0)
        assert_lost(trimmed, trimmed_at)
        time.sleep(1.5)  # a round of lookups more: the jobs still there are left alone
        assert not owned.ended and not untouched.ended
        for request in (owned, untouched):
            finish(r, request.job_ids[0])
            request.join(30)
            assert request.done and request.error_codes() == []


def test_a_redis_restarted_empty_ends_every_open_request(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        r = redis.Redis.from_url(server.url, decode_responses=True)
        no_worker_serves(r, "idle")
        with gateway(server.url) as url:
            requests = open_requests(url, "idle", 4)
            wait_for(lambda: r.xlen(KEYS.jobs_of("idle")) == 4, what="the jobs queued")
            restarted_at = time.monotonic()
            server.stop()
            shutil.rmtree(server.workdir)  # its AOF: it comes back empty
            server.start()
            assert_lost(requests, restarted_at)
    finally:
        server.stop()
