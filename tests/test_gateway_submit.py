"""A request's job metas and its jobs go to Redis in one round trip (the submit script by its
sha); when the server has lost the script, the request still gets queued (the producer's submit
loads it again), each job once."""

from __future__ import annotations

from typing import Any

import httpx2
import pytest
import redis

from qworker_client.aio import AsyncProducer
from tests.gateway_harness import gateway, live_worker
from tests.service_harness import KEYS, check_stream, sim_engine


def test_requests_are_queued_before_and_after_the_script_is_flushed(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow_path: list[int] = []  # the requests that went through the producer's own submit
    own_submit = AsyncProducer.submit_prepared

    async def counted(self: AsyncProducer, prepared: Any) -> Any:
        slow_path.append(len(replies))
        return await own_submit(self, prepared)

    monkeypatch.setattr(AsyncProducer, "submit_prepared", counted)
    r = redis.Redis.from_url(redis_url)
    r.script_flush()  # the server is the session's: other tests may have loaded it
    body = {"model": "sim", "prompt": "once", "max_tokens": 8, "n": 2, "seed": 1}
    replies: list[httpx2.Response] = []
    with live_worker(redis_url, "gw-submit", sim_engine()), gateway(redis_url) as url:
        for flush in [False, False, True, False]:
            if flush:
                r.script_flush()
            replies.append(httpx2.post(f"{url}/v1/completions", json=body, timeout=60))
    assert slow_path == [0, 2]  # the first loads the script, and the first after the flush
    for reply in replies:
        assert reply.status_code == 200, reply.text
        job_ids = reply.headers["x-qworker-job-id"].split(",")
        texts = [c["text"] for c in reply.json()["choices"]]
        assert texts == [check_stream(r, j).text for j in job_ids]  # each token once, one end
        for job_id in job_ids:
            assert r.exists(f"{KEYS.prefix}:gw:{job_id}")  # its meta, for a resume
