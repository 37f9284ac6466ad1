"""A job id runs once however often it is submitted while its output exists; cancel flags never
outlive the output; ids are checked whole; the batch submit reads the requeue stream once."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from qworker_client import AsyncProducer, ClientOptions, JobValidationError, Producer
from qworker_client.batch import BatchLine, Submitter, marker_key
from qworker_client.protocol import Keys, event_to_fields, is_valid_id, parse_job_fields
from qworker_client.scripts import CANCEL_SCRIPT, SUBMIT_SCRIPT
from tests.producer_fakes import completion, wait_for
from tests.service_harness import check_stream, thread_worker, wait_terminal

KEYS = Keys("qw")
PROTOCOL_DOC = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url, decode_responses=True)
    yield c
    c.close()


@pytest.fixture
def prod(redis_url: str) -> Iterator[Producer]:
    p = Producer(redis_url)
    yield p
    p.close()


# ---------------------------------------------------------------------- submit once


def test_a_second_submit_of_an_id_adds_nothing(prod: Producer, client: redis.Redis) -> None:
    first = prod.submit("hi", id="once")
    again = prod.submit("hi", id="once")
    assert (first.new, again.new) == (True, False)
    assert again.entry_id == first.entry_id
    assert client.xlen(KEYS.jobs) == 1
    assert client.get(KEYS.submitted("once")) == first.entry_id
    assert 0 < client.ttl(KEYS.submitted("once")) <= ClientOptions().result_ttl_s


def test_submit_many_queues_each_id_once(prod: Producer, client: redis.Redis) -> None:
    jobs = prod.submit_many([{"prompt": "a", "id": "x"}, {"prompt": "b"}, {"prompt": "c",
                                                                          "id": "x"}])
    assert [j.new for j in jobs] == [True, True, False]
    assert [f["prompt"] for _, f in client.xrange(KEYS.jobs)] == ["a", "b"]


def test_an_id_with_output_is_not_queued_again(prod: Producer, client: redis.Redis) -> None:
    client.xadd(KEYS.out("old"), {"type": "token", "i": "0", "token_id": "1", "text": "x"})
    job = prod.submit("hi", id="old")
    assert (job.new, job.entry_id) == (False, None)
    assert client.xlen(KEYS.jobs) == 0
    client.delete(KEYS.out("old"))  # output gone (expired), no marker: the id is free again
    assert prod.submit("hi", id="old").new
    assert client.xlen(KEYS.jobs) == 1


def test_a_submit_whose_reply_was_lost_is_retried_once(
        prod: Producer, client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """The script ran, the reply did not arrive: the retry finds the marker, adds nothing."""
    script = prod._submit
    calls: list[int] = []

    def lossy(**kwargs: Any) -> Any:
        calls.append(1)
        reply = script(**kwargs)
        if len(calls) == 1:
            raise redis.ConnectionError("reply lost")
        return reply

    monkeypatch.setattr(prod, "_submit", lossy)
    job = prod.submit("hi", id="lossy")
    assert len(calls) == 2 and client.xlen(KEYS.jobs) == 1
    assert job.entry_id == client.xrange(KEYS.jobs)[0][0]


def test_async_submit_is_once_per_id(redis_url: str, client: redis.Redis) -> None:
    async def scenario() -> list[bool]:
        async with AsyncProducer(redis_url) as prod:
            first = await prod.submit("hi", id="aio")
            again = await prod.submit("hi", id="aio")
            cancelled = await prod.cancel("aio", ttl_s=10**9)
            return [first.new, again.new, cancelled]

    assert asyncio.run(scenario()) == [True, False, True]
    assert client.xlen(KEYS.jobs) == 1
    assert 0 < client.ttl(KEYS.cancel("aio")) <= ClientOptions().result_ttl_s


def test_a_retried_submit_runs_the_job_once_without_a_dead_letter(redis_url: str) -> None:
    """Before: the second entry of a running job was dead-lettered as a duplicate (or ran
    again on another worker)."""
    raw = redis.Redis.from_url(redis_url)
    with thread_worker(redis_url, "once-1"), Producer(redis_url) as prod:
        job = prod.submit("retried", id="retried", max_tokens=40, temperature=0)
        wait_for(lambda: raw.xlen(KEYS.out("retried")) >= 2, what="the job to start")
        assert not prod.submit("retried", id="retried", max_tokens=40, temperature=0).new
        assert job.result(timeout=30).usage.completion_tokens == 40
        assert not prod.submit("retried", id="retried", max_tokens=40, temperature=0).new
        wait_terminal(raw, ["retried"])
    check_stream(raw, "retried")
    assert raw.xlen(KEYS.dead) == 0 and raw.xlen(KEYS.jobs) == 0


# ---------------------------------------------------------------------- cancel flags


def test_cancel_flag_lives_at_most_the_result_ttl(prod: Producer, client: redis.Redis) -> None:
    assert prod.cancel("a")
    assert 0 < client.ttl(KEYS.cancel("a")) <= 3600
    prod.cancel("b", ttl_s=24 * 3600)
    assert 0 < client.ttl(KEYS.cancel("b")) <= 3600
    prod.cancel("c", ttl_s=30)
    assert 0 < client.ttl(KEYS.cancel("c")) <= 30
    Producer(client=client, options=ClientOptions(result_ttl_s=20)).cancel("d")
    assert 0 < client.ttl(KEYS.cancel("d")) <= 20


def test_cancelling_a_finished_job_sets_no_flag(prod: Producer, client: redis.Redis) -> None:
    for event in completion(["a"]):
        client.xadd(KEYS.out("ended"), event_to_fields(event))
    assert prod.cancel("ended") is False
    assert client.exists(KEYS.cancel("ended")) == 0


def test_a_reused_id_is_not_cancelled_at_once(redis_url: str) -> None:
    """Cancel a job, let its output expire, submit the id again: it runs to its end."""
    raw = redis.Redis.from_url(redis_url)
    options = ClientOptions(result_ttl_s=2)
    with thread_worker(redis_url, "once-2", result_ttl=2), \
            Producer(redis_url, options=options) as prod:
        job = prod.submit("long", id="reused", max_tokens=5000, ignore_eos=True)
        wait_for(lambda: raw.xlen(KEYS.out("reused")) >= 3, what="tokens")
        assert job.cancel()
        assert job.result(timeout=30).finish_reason == "cancelled"
        wait_for(lambda: not raw.exists(KEYS.out("reused"), KEYS.submitted("reused")), 10,
                 what="the output and the marker to expire")
        again = prod.submit("short", id="reused", max_tokens=5)
        assert again.new
        assert again.result(timeout=30).finish_reason == "length"


# ---------------------------------------------------------------------- ids


@pytest.mark.parametrize("bad", ["job\n", "job\r\n", "\njob", "a b", "", "x" * 129])
def test_an_id_must_match_whole(bad: str, prod: Producer) -> None:
    assert not is_valid_id(bad)
    with pytest.raises(JobValidationError) as info:
        parse_job_fields({"id": bad, "prompt": "x"}, "1-1")
    assert info.value.job_id is None  # no error event to a key named after a bad id
    with pytest.raises(JobValidationError):
        prod.submit("x", id=bad)
    with pytest.raises(ValueError):
        prod.job(bad)
    assert is_valid_id("job-1.a:b_C")


# ---------------------------------------------------------------------- batch submit


def test_batch_submit_reads_the_requeue_stream_once_per_call(client: redis.Redis) -> None:
    """Every job marked by an earlier run but gone from the jobs stream and without output makes
    the script look in the requeue stream: once per call, not once per job."""
    for n in range(200):
        client.xadd(KEYS.requeue, {"id": f"other-{n}", "prompt": "x"})
    client.xadd(KEYS.requeue, {"id": "batch-7", "prompt": "x"})
    submitter = Submitter(client, KEYS, "b1")
    lines = [BatchLine(n, f"c{n}", f"batch-{n}", {"id": f"batch-{n}", "prompt": "x"})
             for n in range(50)]
    client.hset(marker_key(KEYS, "b1"), mapping={line.job_id: "1-1" for line in lines})
    client.config_resetstat()
    fresh = submitter.submit(lines)
    calls = int(client.info("commandstats")["cmdstat_xrange"]["calls"])
    assert calls <= 51, f"{calls} XRANGE calls for 50 jobs"  # 50 entry lookups + 1 requeue read
    assert fresh == [n != 7 for n in range(50)]  # batch-7 is alive in the requeue stream
    assert client.xlen(KEYS.jobs) == 49


# ---------------------------------------------------------------------- docs


def test_protocol_md_gives_the_scripts_word_for_word() -> None:
    blocks = re.findall(r"```lua\n(.*?)```", PROTOCOL_DOC.read_text(), re.S)
    assert SUBMIT_SCRIPT in blocks and CANCEL_SCRIPT in blocks
    text = PROTOCOL_DOC.read_text()
    assert f"`{KEYS.submitted('<id>')}`" in text
