"""The asyncio producer: same behaviour as the sync one, over redis.asyncio."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from qworker_client import (
    AsyncProducer,
    ClientOptions,
    JobError,
    JobTimeoutError,
    JobValidationError,
)
from qworker_client.protocol import ErrorEvent
from qworker_client.retry import Backoff
from tests.producer_fakes import (
    FakeWorker,
    blocked_readers,
    completion,
    token_events,
    wait_for,
)

TEXTS = ["a", "b", "", "c d", " é"]


def test_submit_stream_and_result(redis_url: str) -> None:
    async def scenario() -> tuple[list, str, dict, str]:
        async with AsyncProducer(redis_url) as prod:
            job = await prod.submit("hi", max_tokens=5, stop=["x"])
            worker = FakeWorker(redis_url, job.id, completion(TEXTS))
            worker.start()
            events = [e async for e in job.stream(timeout=30)]
            worker.finish()
            result = await job.result()
            fields = (await prod.redis.xrange("qw:jobs"))[0][1]
            return events, result.text, fields, job.id

    events, text, fields, job_id = asyncio.run(scenario())
    assert events == completion(TEXTS)
    assert text == "".join(TEXTS)
    assert fields == {"id": job_id, "prompt": "hi", "max_tokens": "5", "stop": '["x"]'}


def test_text_stream_and_early_stop(redis_url: str) -> None:
    async def scenario() -> tuple[list, list]:
        async with AsyncProducer(redis_url) as prod:
            job = await prod.submit("hi")
            FakeWorker(redis_url, job.id, completion(TEXTS), delay_s=0).run()
            first = []
            async for event in job.stream(timeout=5):
                first.append(event)
                if len(first) == 2:
                    break
            rest = [e async for e in job.stream(timeout=5)]
            texts = [t async for t in prod.job(job.id).text_stream(timeout=5)]
            return first + rest, texts

    events, texts = asyncio.run(scenario())
    assert events == completion(TEXTS)
    assert texts == [t for t in TEXTS if t]


def test_result_raises_job_error_and_timeout(redis_url: str) -> None:
    async def scenario() -> None:
        async with AsyncProducer(redis_url) as prod:
            job = await prod.submit("hi")
            events = [*token_events(["a"]), ErrorEvent(code="expired", message="deadline passed")]
            FakeWorker(redis_url, job.id, events, delay_s=0).run()
            with pytest.raises(JobError) as info:
                await job.result(timeout=5)
            assert (info.value.code, info.value.message) == ("expired", "deadline passed")
            silent = await prod.submit("nobody")
            start = time.monotonic()
            with pytest.raises(JobTimeoutError):
                await silent.result(timeout=0.3)
            assert time.monotonic() - start < 3

    asyncio.run(scenario())


def test_validation_submit_many_and_cancel(redis_url: str) -> None:
    async def scenario() -> None:
        async with AsyncProducer(redis_url, prefix="p2") as prod:
            with pytest.raises(JobValidationError, match="unknown field 'bogus'"):
                await prod.submit("x", bogus=1)
            assert await prod.redis.exists("p2:jobs") == 0
            jobs = await prod.submit_many([{"prompt": str(i)} for i in range(20)])
            entries = await prod.redis.xrange("p2:jobs")
            assert [j.id for j in jobs] == [f["id"] for _, f in entries]
            assert [j.entry_id for j in jobs] == [e for e, _ in entries]
            await jobs[3].cancel(ttl_s=60)
            assert 0 < await prod.redis.ttl(f"p2:cancel:{jobs[3].id}") <= 60

    asyncio.run(scenario())


@pytest.mark.parametrize("library_retries", [True, False], ids=["redis-py-retries", "no-retries"])
def test_stream_resumes_after_client_kill(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, library_retries: bool
) -> None:
    failures: list[BaseException] = []
    original = Backoff.failed

    def failed(self: Backoff, exc: BaseException) -> float:
        failures.append(exc)
        return original(self, exc)

    monkeypatch.setattr(Backoff, "failed", failed)
    admin = redis.Redis.from_url(redis_url, decode_responses=True)
    texts = [f"t{i}" for i in range(20)]

    def drop_everyone() -> None:
        wait_for(lambda: blocked_readers(admin) == 1, what="the reader to block in XREAD")
        admin.client_kill_filter(_type="normal", skipme=True)

    async def scenario() -> list:
        client = None
        if not library_retries:
            client = redis.asyncio.Redis.from_url(
                redis_url, decode_responses=True, socket_timeout=15,
                retry=redis.asyncio.retry.Retry(redis.backoff.NoBackoff(), 0),
            )
        async with AsyncProducer(redis_url, client=client,
                                 options=ClientOptions(block_ms=2_000)) as prod:
            job = await prod.submit("hi")
            worker = FakeWorker(redis_url, job.id, completion(texts), pause_at=10,
                                pause=drop_everyone)
            worker.start()
            events = [e async for e in job.stream(timeout=30)]
            await asyncio.to_thread(worker.finish)
            return events

    events = asyncio.run(scenario())
    admin.close()
    assert events == completion(texts)
    if not library_retries:
        assert failures, "the producer's own resume path did not run"


def test_stats(redis_url: str) -> None:
    async def scenario() -> tuple:
        async with AsyncProducer(redis_url) as prod:
            empty = await prod.stats()
            await prod.submit_many([{"prompt": "x"}] * 3)
            await prod.redis.xgroup_create("qw:jobs", "workers", id="0")
            await prod.redis.xreadgroup("workers", "w1", {"qw:jobs": ">"}, count=1)
            await prod.redis.xadd("qw:dead", {"reason": "r"})
            await prod.redis.set("qw:worker:w1", "{}", ex=30)
            return empty, await prod.stats()

    empty, stats = asyncio.run(scenario())
    assert (empty.jobs.length, empty.dead_letters, empty.live_workers) == (0, 0, 0)
    assert (stats.jobs.length, stats.jobs.lag, stats.jobs.pending, stats.jobs.consumers) == (
        3, 2, 1, 1)
    assert not stats.requeue.group_exists
    assert (stats.dead_letters, stats.workers) == (1, [{"name": "w1"}])
