"""`--stream-interval-ms` on a real Redis: the tokens of the steps within the interval go out in
one round trip (fewer script calls for the same stream, entry by entry), while a job's first
token and its end are not held back."""

from __future__ import annotations

import redis

from tests.service_harness import (
    KEYS,
    check_stream,
    sim_engine,
    submit,
    thread_worker,
    wait_terminal,
)

TOKENS = 40


def _run(url: str, client: redis.Redis, interval_ms: int) -> int:
    """Four jobs of TOKENS tokens at 5 ms a step; how many append calls Redis ran."""
    client.flushall()
    ids = [f"j{k}" for k in range(4)]
    with thread_worker(url, f"w{interval_ms}", sim_engine("sim:step_ms=5"),
                       stream_interval_ms=interval_ms) as w:
        client.config_resetstat()
        for job_id in ids:
            submit(client, job_id, prompt="count", max_tokens=TOKENS, ignore_eos=True)
        wait_terminal(client, ids)
        calls = int(client.info("commandstats")["cmdstat_evalsha"]["calls"])
        assert w.stop() == 0
    for job_id in ids:
        assert check_stream(client, job_id).completion_tokens == TOKENS
    return calls


def _ms(entry_id: bytes) -> int:
    return int(entry_id.split(b"-")[0])


def test_an_interval_writes_the_same_streams_in_fewer_calls(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    every_step = _run(redis_url, client, 0)
    grouped = _run(redis_url, client, 100)
    assert grouped < every_step / 2, (grouped, every_step)


def test_the_first_token_and_the_end_are_not_held_back(redis_url: str) -> None:
    """An interval far longer than the job: token 0 goes out at once, in a round trip of its
    own; the tokens after it wait for the job's end and go with `done` in one call. Sent step by
    step, 39 steps of 5 ms would spread them over 195 ms or more; one script call writes them
    within a few ms (Redis 7.0 reads the clock at each XADD, so not always the same ms)."""
    client = redis.Redis.from_url(redis_url)
    with thread_worker(redis_url, "w", sim_engine("sim:step_ms=5"),
                       stream_interval_ms=60_000) as w:
        submit(client, "j", prompt="count", max_tokens=TOKENS, ignore_eos=True)
        wait_terminal(client, ["j"], timeout=30)
        assert w.stop() == 0
    check_stream(client, "j")
    times = [_ms(entry_id) for entry_id, _ in client.xrange(KEYS.out("j"))]
    assert len(times) == TOKENS + 1
    assert times[0] < times[1] and times[-1] - times[1] < 50, times
