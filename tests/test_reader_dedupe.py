"""Readers never see a token index twice, nor a second terminal event: what a stream looks like
after Redis lost its last writes (AOF everysec, a failover) and the job ran again from what was
left. Written by hand here, and produced for real by restarting Redis from an older AOF copy."""

from __future__ import annotations

import asyncio
import shutil
import threading
from pathlib import Path

import redis

from qworker_client import AsyncProducer, Producer
from qworker_client.batch import run_batch
from qworker_client.protocol import DoneEvent, TokenEvent, event_to_fields
from tests.conftest import RedisServer
from tests.producer_fakes import blocked_readers, done_event, wait_for

TEXTS = ["a", "b", "c", "d", "e"]


def rolled_back_stream(client: redis.Redis, key: str) -> None:
    """i = 0 1 2, then 1 2 again (the job ran again from i = 1), 3, done, then 3 and a second
    done that differs: a reader passes on 0 1 2 3 and the first done only."""
    order = [0, 1, 2, 1, 2, 3]
    for i in order:
        client.xadd(key, event_to_fields(TokenEvent(i=i, token_id=100 + i, text=TEXTS[i])))
    client.xadd(key, event_to_fields(done_event(TEXTS[:4])))
    client.xadd(key, event_to_fields(TokenEvent(i=3, token_id=103, text="d")))
    client.xadd(key, event_to_fields(done_event(["x"], "stop")))


def check(events: list[TokenEvent | DoneEvent]) -> None:
    assert [e.i for e in events if isinstance(e, TokenEvent)] == [0, 1, 2, 3]
    assert [e for e in events if isinstance(e, DoneEvent)] == [done_event(TEXTS[:4])]
    assert isinstance(events[-1], DoneEvent)


def test_sync_reader_skips_seen_indices_and_a_second_done(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    rolled_back_stream(client, "qw:out:rb")
    with Producer(redis_url) as prod:
        job = prod.job("rb")
        check(list(job.stream(timeout=5)))
        assert list(job.stream(timeout=5)) == []  # finished: nothing more, even from Redis
        assert job.result().text == "abcd"
        assert "".join(prod.job("rb").text_stream(timeout=5)) == "abcd"


def test_async_reader_skips_seen_indices_and_a_second_done(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    rolled_back_stream(client, "qw:out:rb")

    async def scenario() -> list[TokenEvent | DoneEvent]:
        async with AsyncProducer(redis_url) as prod:
            return [e async for e in prod.job("rb").stream(timeout=5)]

    check(asyncio.run(scenario()))


def test_reader_skips_indices_repeated_in_a_later_read(redis_url: str) -> None:
    """The repeat arrives in a read of its own, after the reader has blocked."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    key = "qw:out:later"
    for i in range(3):
        client.xadd(key, event_to_fields(TokenEvent(i=i, token_id=100 + i, text=TEXTS[i])))
    with Producer(redis_url) as prod:
        job = prod.job("later")
        stream = job.stream(timeout=10)
        first = [next(stream) for _ in range(3)]
        for i in (1, 2, 3):
            client.xadd(key, event_to_fields(TokenEvent(i=i, token_id=100 + i, text=TEXTS[i])))
        client.xadd(key, event_to_fields(done_event(TEXTS[:4])))
        check(first + list(stream))


def test_batch_counts_each_token_once(redis_url: str, tmp_path: Path) -> None:
    """The batch runner ends a line at its first terminal event and counts repeats once."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    source = tmp_path / "in.jsonl"
    source.write_text('{"custom_id": "one", "prompt": "hi"}\n')
    output = tmp_path / "out.jsonl"
    done = threading.Event()

    def fake_worker() -> None:
        entry = wait_for_entry(client)
        rolled_back_stream(client, f"qw:out:{entry['id']}")
        done.set()

    thread = threading.Thread(target=fake_worker, daemon=True)
    thread.start()
    summary = run_batch(source, output, client=client)
    thread.join(10)
    assert done.is_set()
    assert (summary.succeeded, summary.tokens) == (1, 4)
    assert '"text": "abcd"' in output.read_text()


def wait_for_entry(client: redis.Redis) -> dict[str, str]:
    found: list[dict[str, str]] = []

    def entry() -> bool:
        entries = client.xrange("qw:jobs")
        found.extend(fields for _, fields in entries[:1])
        return bool(found)

    wait_for(entry, what="the batch's job")
    return found[0]


# ---------------------------------------------------------------------- a real rollback


def test_restart_from_an_older_aof_copy_mid_job(tmp_path: Path) -> None:
    """Redis is restarted from a copy of its AOF taken mid-job; the job runs again from what the
    stream holds (a hand-driven writer, as a resuming worker does), re-appending indices the
    reader has already seen. The reader, resuming from its last entry id as protocol.md says,
    sees each index once and one terminal event."""
    data = tmp_path / "redis"
    data.mkdir()
    server = RedisServer(data)  # appendfsync always: every reply is on disk
    server.start()
    try:
        run_rollback(server, tmp_path / "aof-copy")
    finally:
        server.stop()


def run_rollback(server: RedisServer, copy: Path) -> None:
    writer = redis.Redis.from_url(server.url, decode_responses=True)
    key, texts = "qw:out:aof", [f"t{i} " for i in range(15)]

    def token(i: int) -> None:
        writer.xadd(key, event_to_fields(TokenEvent(i=i, token_id=100 + i, text=texts[i])))

    for i in range(5):
        token(i)
    shutil.copytree(server.workdir / "appendonlydir", copy)  # the "older AOF": tokens 0-4
    for i in range(5, 10):
        token(i)
    prod = Producer(server.url)
    job = prod.job("aof")
    seen: list[TokenEvent | DoneEvent] = []
    reader = threading.Thread(target=lambda: seen.extend(job.stream(timeout=60)), daemon=True)
    reader.start()
    wait_for(lambda: len(seen) == 10 and blocked_readers(writer) == 1,
             what="the reader to take tokens 0-9 and block")
    writer.close()
    server.stop()
    shutil.rmtree(server.workdir / "appendonlydir")
    shutil.copytree(copy, server.workdir / "appendonlydir")
    server.start()
    writer = redis.Redis.from_url(server.url, decode_responses=True)
    assert writer.xlen(key) == 5, "Redis came back from the older copy"
    for i in range(5, 15):  # the job runs again from what the stream holds
        token(i)
    writer.xadd(key, event_to_fields(done_event(texts)))
    writer.xadd(key, event_to_fields(done_event(texts[:3], "stop")))  # a stray second end
    reader.join(60)
    prod.close()
    writer.close()
    assert not reader.is_alive()
    assert [e.i for e in seen if isinstance(e, TokenEvent)] == list(range(15))
    assert [e for e in seen if isinstance(e, DoneEvent)] == [done_event(texts)]
    assert "".join(e.text for e in seen if isinstance(e, TokenEvent)) == "".join(texts)
