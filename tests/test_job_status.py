"""The status query of docs/protocol.md ("Asking a job's status") on each state a job's keys can
be in, through the sync and asyncio clients."""

from __future__ import annotations

import asyncio

import pytest
import redis

from qworker_client import AsyncProducer, Producer
from qworker_client.protocol import DoneEvent, ErrorEvent, Keys, TokenEvent, event_to_fields

KEYS = Keys()


def test_each_state(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    with Producer(redis_url) as producer:
        r.xadd(KEYS.jobs, {"id": "plain", "prompt": "x"})
        assert producer.status("plain").status == "unknown"  # a plain XADD leaves no marker
        job = producer.submit("x", id="marked")
        assert producer.status(job.id).to_dict() == {"id": "marked", "status": "queued"}
        r.hset(KEYS.owner("marked"), "worker", "w1")
        assert producer.status("marked").status == "running"
        r.xadd(KEYS.out("marked"), event_to_fields(TokenEvent(i=0, token_id=5, text="a")))
        r.delete(KEYS.owner("marked"))
        assert producer.status("marked").status == "running"
        r.xadd(KEYS.out("marked"), event_to_fields(DoneEvent(
            finish_reason="stop", text="a", prompt_tokens=1, completion_tokens=1)))
        done = producer.status("marked")
        assert done.status == "done" and done.result is not None and done.result.text == "a"
        assert done.to_dict()["result"]["usage"] == {"prompt_tokens": 1, "completion_tokens": 1}
        r.xadd(KEYS.out("bad"), event_to_fields(ErrorEvent(code="expired", message="late")))
        assert producer.status("bad").to_dict() == {
            "id": "bad", "status": "error", "error": {"code": "expired", "message": "late"}}
        with pytest.raises(ValueError, match="invalid job id"):
            producer.status("no spaces")


def test_the_asyncio_client_asks_the_same(redis_url: str) -> None:
    async def ask() -> list[str]:
        async with AsyncProducer(redis_url) as producer:
            job = await producer.submit("x")
            return [(await producer.status(job.id)).status,
                    (await producer.status("nobody")).status]

    assert asyncio.run(ask()) == ["queued", "unknown"]
