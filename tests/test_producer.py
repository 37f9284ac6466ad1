"""The synchronous producer against a real redis-server, with a fake worker writing events."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid

import pytest
import redis

from qworker_client import (
    ClientOptions,
    DoneEvent,
    JobError,
    JobTimeoutError,
    JobValidationError,
    Producer,
    TokenEvent,
)
from qworker_client.fields import job_fields
from qworker_client.protocol import ErrorEvent, Job, is_valid_id, parse_job_fields
from qworker_client.retry import Backoff
from tests.conftest import RedisServer, free_port
from tests.producer_fakes import (
    FakeWorker,
    blocked_readers,
    completion,
    done_event,
    token_events,
    wait_for,
)

TEXTS = ["Hel", "lo", "", ",", " wor", "ld", "!", " é", "\n", "end"]


@pytest.fixture
def client(redis_url: str) -> redis.Redis:
    c = redis.Redis.from_url(redis_url, decode_responses=True)
    yield c
    c.close()


@pytest.fixture
def prod(redis_url: str) -> Producer:
    p = Producer(redis_url)
    yield p
    p.close()


def spy_on_backoff(monkeypatch: pytest.MonkeyPatch) -> list[BaseException]:
    """Record every failure the producer's own reconnect loop handles."""
    failures: list[BaseException] = []
    original = Backoff.failed

    def failed(self: Backoff, exc: BaseException) -> float:
        failures.append(exc)
        return original(self, exc)

    monkeypatch.setattr(Backoff, "failed", failed)
    return failures


def only_entry(client: redis.Redis, key: str = "qw:jobs") -> tuple[str, dict[str, str]]:
    entries = client.xrange(key)
    assert len(entries) == 1, entries
    return entries[0]


# ----------------------------------------------------------------------------- submit


def test_submit_writes_exactly_the_wire_fields(prod: Producer, client: redis.Redis) -> None:
    job = prod.submit(
        "Hello", max_tokens=5, temperature=0.5, stop=["\n", "END"], ignore_eos=True,
        seed=7, top_k=None,
    )
    entry_id, fields = only_entry(client)
    assert fields == {
        "id": job.id, "prompt": "Hello", "max_tokens": "5", "temperature": "0.5",
        "stop": '["\\n","END"]', "ignore_eos": "true", "seed": "7",
    }
    assert job.entry_id == entry_id
    assert is_valid_id(job.id) and len(job.id) == 32
    assert parse_job_fields(fields, entry_id) == Job(
        id=job.id, prompt="Hello", max_tokens=5, temperature=0.5, stop=["\n", "END"],
        ignore_eos=True, seed=7,
    )


def test_submit_messages_token_ids_and_own_id(prod: Producer, client: redis.Redis) -> None:
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi ☃"}]
    a = prod.submit(messages=chat, id="job-a")
    b = prod.submit(prompt_token_ids=(1, 2, 3), stop_token_ids=[2], id="job:b")
    (_, fa), (_, fb) = [fields for fields in client.xrange("qw:jobs")]
    assert (a.id, b.id) == ("job-a", "job:b")
    assert fa == {"id": "job-a", "messages": json.dumps(chat, ensure_ascii=False,
                                                        separators=(",", ":"))}
    assert fb == {"id": "job:b", "prompt_token_ids": "[1,2,3]", "stop_token_ids": "[2]"}


def test_submit_under_another_prefix(redis_url: str, client: redis.Redis) -> None:
    with Producer(redis_url, prefix="team1") as prod:
        prod.submit("x")
    assert client.xlen("team1:jobs") == 1
    assert client.xlen("qw:jobs") == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompt": "x", "max_tokenz": 5}, "unknown field 'max_tokenz'"),
        ({}, "exactly one of prompt, messages, prompt_token_ids is required (got none)"),
        ({"prompt": "x", "prompt_token_ids": [1]}, "(got prompt, prompt_token_ids)"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "temperature": -1.0}, "temperature"),
        ({"prompt": "x", "max_tokens": True}, "field 'max_tokens': expected a decimal integer"),
        ({"prompt": "x", "max_tokens": 2.5}, "field 'max_tokens': expected a decimal integer"),
        ({"prompt": "x", "id": "has space"}, "id"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ({"prompt": "x", "min_tokens": 9, "max_tokens": 3}, "min_tokens must be <= max_tokens"),
    ],
)
def test_invalid_jobs_are_rejected_before_sending(
    prod: Producer, client: redis.Redis, kwargs: dict, message: str
) -> None:
    with pytest.raises(JobValidationError) as info:
        prod.submit(**kwargs)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)
    assert client.exists("qw:jobs") == 0


def test_unencodable_value_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="field 'seed': cannot send a object"):
        job_fields({"prompt": "x", "seed": object()})


def test_job_fields_from_a_protocol_job() -> None:
    job_id, fields = job_fields(Job(prompt="x", max_tokens=3))
    assert fields == {"prompt": "x", "max_tokens": "3", "id": job_id}
    assert job_fields(Job(prompt="x", id="mine"))[0] == "mine"


def test_submit_many_pipelines_in_order(prod: Producer, client: redis.Redis) -> None:
    specs = [{"prompt": f"p{i}", "max_tokens": i + 1} for i in range(50)]
    jobs = prod.submit_many(specs)
    entries = client.xrange("qw:jobs")
    assert [j.id for j in jobs] == [f["id"] for _, f in entries]
    assert [j.entry_id for j in jobs] == [e for e, _ in entries]
    assert [f["prompt"] for _, f in entries] == [s["prompt"] for s in specs]
    assert len({j.id for j in jobs}) == 50
    assert prod.submit_many([]) == []


def test_submit_many_sends_nothing_when_one_job_is_invalid(
    prod: Producer, client: redis.Redis
) -> None:
    with pytest.raises(JobValidationError, match="top_p"):
        prod.submit_many([{"prompt": "ok"}, {"prompt": "bad", "top_p": 0.0}])
    assert client.exists("qw:jobs") == 0


def test_submit_never_trims_the_jobs_stream(prod: Producer, client: redis.Redis) -> None:
    prod.submit_many([{"prompt": "x"}] * 300)
    prod.submit("last")
    assert client.xlen("qw:jobs") == 301


# ----------------------------------------------------------------------------- reading


def test_stream_yields_token_events_then_done(prod: Producer, redis_url: str) -> None:
    job = prod.submit("hi")
    worker = FakeWorker(redis_url, job.id, completion(TEXTS))
    worker.start()
    events = list(job.stream(timeout=30))
    worker.finish()
    assert events == completion(TEXTS)
    assert isinstance(events[-1], DoneEvent)
    assert "".join(e.text for e in events[:-1]) == events[-1].text
    assert list(job.stream()) == []  # finished: nothing more
    assert job.result().text == "".join(TEXTS)


def test_text_stream_yields_non_empty_deltas(prod: Producer, redis_url: str) -> None:
    job = prod.submit("hi")
    FakeWorker(redis_url, job.id, completion(TEXTS), delay_s=0).run()
    assert list(job.text_stream(timeout=10)) == [t for t in TEXTS if t]


def test_stopping_early_then_streaming_again_continues(prod: Producer, redis_url: str) -> None:
    job = prod.submit("hi")
    FakeWorker(redis_url, job.id, completion(TEXTS), delay_s=0).run()
    first = []
    for event in job.stream(timeout=10):
        first.append(event)
        if len(first) == 4:
            break
    rest = list(job.stream(timeout=10))
    assert first + rest == completion(TEXTS)


def test_result_returns_text_reason_usage_timings(prod: Producer, redis_url: str) -> None:
    job = prod.submit("hi")
    worker = FakeWorker(redis_url, job.id, completion(TEXTS, "stop"))
    worker.start()
    result = job.result(timeout=30)
    worker.finish()
    assert result.job_id == job.id
    assert result.text == "".join(TEXTS)
    assert result.finish_reason == "stop"
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (3, len(TEXTS))
    assert (result.timings.queue_ms, result.timings.ttft_ms, result.timings.total_ms) == (1, 2, 3)


def test_result_raises_the_jobs_error(prod: Producer, redis_url: str) -> None:
    job = prod.submit("hi")
    events = [*token_events(["a", "b"]), ErrorEvent(code="prompt_too_long", message="too long")]
    FakeWorker(redis_url, job.id, events, delay_s=0).run()
    streamed = []
    with pytest.raises(JobError) as info:
        for event in job.stream(timeout=10):
            streamed.append(event)
    assert streamed == token_events(["a", "b"])
    assert (info.value.job_id, info.value.code, info.value.message) == (
        job.id, "prompt_too_long", "too long")
    with pytest.raises(JobError, match="prompt_too_long: too long"):
        job.result(timeout=1)
    with pytest.raises(JobError):
        next(iter(job.stream()))


def test_result_times_out(prod: Producer) -> None:
    job = prod.submit("nobody works")
    start = time.monotonic()
    with pytest.raises(JobTimeoutError, match=job.id) as info:
        job.result(timeout=0.3)
    assert isinstance(info.value, TimeoutError)
    assert 0.25 < time.monotonic() - start < 3


def test_timeout_counts_across_reads_of_a_slow_job(prod: Producer, redis_url: str) -> None:
    job = prod.submit("slow")
    worker = FakeWorker(redis_url, job.id, completion(["x"] * 40), delay_s=0.05)
    worker.start()
    with pytest.raises(JobTimeoutError):
        job.result(timeout=0.5)  # 40 tokens * 50 ms: each read returns, the total is too long
    worker.finish()
    assert job.result(timeout=10).text == "x" * 40


def test_job_handle_reads_from_the_start_or_after_an_entry(prod: Producer, redis_url: str) -> None:
    job = prod.submit("hi")
    FakeWorker(redis_url, job.id, completion(TEXTS), delay_s=0).run()
    assert list(prod.job(job.id).stream(timeout=5)) == completion(TEXTS)
    third = prod.redis.xrange(prod.keys.out(job.id))[2][0]
    assert list(prod.job(job.id, after=third).stream(timeout=5)) == completion(TEXTS)[3:]
    with pytest.raises(ValueError, match="invalid job id"):
        prod.job("no spaces allowed")


def test_blocking_reads_have_a_socket_timeout_longer_than_block(redis_url: str) -> None:
    options = ClientOptions(block_ms=7_000)
    with Producer(redis_url, options=options) as prod:
        kwargs = prod.redis.connection_pool.connection_kwargs
        assert kwargs["socket_timeout"] > 7.0
    with pytest.raises(ValueError, match="BLOCK 0"):
        ClientOptions(block_ms=0)


def test_block_longer_than_redis_py_default_socket_timeout(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A quiet job (no event for > 5 s, redis-py's default socket timeout) is waited for on one
    healthy connection, not by failing and reconnecting."""
    with Producer(redis_url, options=ClientOptions(block_ms=6_000)) as prod:
        job = prod.submit("quiet")
        worker = FakeWorker(redis_url, job.id, completion(["late"]), delay_s=0)
        worker.pause_at, worker.pause = 0, lambda: time.sleep(5.5)
        worker.start()
        failures = spy_on_backoff(monkeypatch)
        assert job.result(timeout=20).text == "late"
        worker.finish()
    assert failures == []


# ----------------------------------------------------------------------------- dropped connections


@pytest.mark.parametrize("library_retries", [True, False], ids=["redis-py-retries", "no-retries"])
def test_stream_resumes_after_client_kill_without_gap_or_duplicate(
    redis_url: str, client: redis.Redis, monkeypatch: pytest.MonkeyPatch, library_retries: bool
) -> None:
    failures = spy_on_backoff(monkeypatch)
    reader = None if library_retries else redis.Redis.from_url(
        redis_url, decode_responses=True, retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0),
        socket_timeout=15,
    )
    prod = Producer(redis_url, client=reader)
    job = prod.submit("hi")
    texts = [f"t{i} " for i in range(30)]

    def drop_everyone() -> None:
        wait_for(lambda: blocked_readers(client) == 1, what="the reader to block in XREAD")
        client.client_kill_filter(_type="normal", skipme=True)

    worker = FakeWorker(redis_url, job.id, completion(texts), pause_at=15, pause=drop_everyone)
    worker.start()
    events = list(job.stream(timeout=30))
    worker.finish()
    prod.close()
    assert events == completion(texts)
    assert [e.i for e in events[:-1]] == list(range(30))
    if not library_retries:
        assert failures, "the producer's own resume path did not run"


def test_stream_survives_a_redis_restart(
    redis_server: RedisServer, redis_url: str, client: redis.Redis
) -> None:
    prod = Producer(redis_url)
    job = prod.submit("hi")
    texts = [f"t{i} " for i in range(10)]

    def restart() -> None:
        wait_for(lambda: blocked_readers(client) == 1, what="the reader to block in XREAD")
        redis_server.restart()

    worker = FakeWorker(redis_url, job.id, completion(texts), pause_at=5, pause=restart)
    worker.start()
    events = list(job.stream(timeout=60))
    worker.finish()
    prod.close()
    assert events == completion(texts)


def test_reader_gives_up_when_redis_stays_away() -> None:
    options = ClientOptions(block_ms=100, connect_timeout_s=0.2, reconnect_give_up_s=0.5)
    prod = Producer(f"redis://127.0.0.1:{free_port()}/0", options=options)
    start = time.monotonic()
    with pytest.raises(redis.ConnectionError):
        list(prod.job("j").stream())
    assert time.monotonic() - start < 10


# ----------------------------------------------------------------------------- cancel


def test_cancel_sets_the_key_with_a_ttl(prod: Producer, client: redis.Redis) -> None:
    job = prod.submit("hi")
    job.cancel()
    assert client.get(f"qw:cancel:{job.id}") is not None
    assert 0 < client.ttl(f"qw:cancel:{job.id}") <= 24 * 3600
    prod.cancel("other", ttl_s=30)
    assert 0 < client.ttl("qw:cancel:other") <= 30


def test_cancelled_job_ends_with_done_cancelled(prod: Producer, redis_url: str) -> None:
    job = prod.submit("hi")
    events = [*token_events(["a"]), done_event(["a"], "cancelled")]
    FakeWorker(redis_url, job.id, events, delay_s=0).run()
    assert job.result(timeout=5).finish_reason == "cancelled"


# ----------------------------------------------------------------------------- misc


def test_authenticated_url(redis_url: str, client: redis.Redis) -> None:
    user, password = f"u{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    client.acl_setuser(user, enabled=True, passwords=[f"+{password}"], keys=["qw:*"],
                       commands=["+@all"])
    try:
        url = redis_url.replace("redis://", f"redis://{user}:{password}@")
        with Producer(url) as prod:
            prod.submit("authed")
        assert client.xlen("qw:jobs") == 1
        started = time.monotonic()
        with pytest.raises(redis.AuthenticationError), Producer(
            redis_url.replace("redis://", f"redis://{user}:wrong@")
        ) as bad:
            bad.submit("x")
        assert time.monotonic() - started < 5, "a wrong password is not retried"
    finally:
        client.acl_deluser(user)


def test_importing_the_client_imports_neither_torch_nor_the_worker() -> None:
    code = (
        "import sys, qworker_client, qworker_client.cli, qworker_client.schema, "
        "qworker_client.commands.submit, qworker_client.commands.tail, "
        "qworker_client.commands.stats, qworker_client.commands.batch\n"
        "heavy = sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('torch', 'numpy', 'qworker'))\n"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_events_are_typed(prod: Producer, redis_url: str) -> None:
    job = prod.submit("hi")
    FakeWorker(redis_url, job.id, completion(["a"]), delay_s=0).run()
    first, last = list(job.stream(timeout=5))
    assert isinstance(first, TokenEvent) and (first.i, first.token_id, first.text) == (0, 100, "a")
    assert isinstance(last, DoneEvent)


# ----------------------------------------------------------------------------- stats


def test_stats_of_an_empty_redis(prod: Producer) -> None:
    stats = prod.stats()
    assert (stats.jobs.length, stats.jobs.lag, stats.jobs.group_exists) == (0, 0, False)
    assert (stats.dead_letters, stats.live_workers, stats.backlog) == (0, 0, 0)


def test_stats_without_a_group_and_with_an_odd_worker_key(
    prod: Producer, client: redis.Redis
) -> None:
    prod.submit_many([{"prompt": "x"}] * 4)
    client.set("qw:worker:odd", "not json", ex=30)
    client.set("qw:worker:gone", "{}", px=1)
    time.sleep(0.01)
    stats = prod.stats()
    assert (stats.jobs.length, stats.jobs.lag, stats.jobs.pending) == (4, 4, 0)
    assert stats.backlog == 4
    assert stats.workers == [{"name": "odd"}]


def test_backoff_grows_and_gives_up() -> None:
    backoff = Backoff(base_s=0.1, cap_s=0.4, give_up_s=0.05)
    error = redis.ConnectionError("down")
    delays = [backoff.failed(error) for _ in range(5)]
    assert all(0 <= d <= 0.4 for d in delays)
    time.sleep(0.06)
    with pytest.raises(redis.ConnectionError, match="down"):
        backoff.failed(error)


@pytest.mark.parametrize("protocol", [2, 3])
def test_reads_over_resp2_and_resp3(redis_url: str, protocol: int) -> None:
    with Producer(f"{redis_url}?protocol={protocol}") as prod:
        job = prod.submit("hi")
        FakeWorker(redis_url, job.id, completion(TEXTS), delay_s=0).run()
        assert list(job.stream(timeout=5)) == completion(TEXTS)
        prod.redis.xgroup_create("qw:jobs", "workers", id="0")
        jobs = prod.stats().jobs
        assert (jobs.length, jobs.group_exists, jobs.lag, jobs.pending) == (1, True, 1, 0)
