"""Cancel a running and a queued job; dead-letter a poison job past --max-deliveries."""

from __future__ import annotations

import redis

from qworker_client.protocol import DoneEvent, ErrorEvent, TokenEvent
from tests.service_harness import (
    KEYS,
    check_stream,
    events,
    group_pending,
    sim_engine,
    submit,
    terminal,
    thread_worker,
    wait_for,
    wait_terminal,
)


def test_cancel_running_and_queued_jobs(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    engine = sim_engine("sim:step_ms=5", max_num_seqs=1, num_blocks=64, block_size=64)
    with thread_worker(redis_url, "c", engine) as w:
        submit(client, "long", prompt="a long one", max_tokens=2000)
        wait_for(lambda: client.xlen(KEYS.out("long")) >= 3, what="first tokens of long")
        submit(client, "queued", prompt="waits for a slot", max_tokens=5)
        client.set(KEYS.cancel("queued"), 1, ex=60)
        client.set(KEYS.cancel("long"), 1, ex=60)
        got = wait_terminal(client, ["long", "queued"], timeout=10)
        assert w.stop() == 0
    for job_id in ("long", "queued"):
        assert isinstance(got[job_id], DoneEvent) and got[job_id].finish_reason == "cancelled"
        check_stream(client, job_id)
    assert 3 <= got["long"].completion_tokens < 2000
    assert not any(isinstance(e, TokenEvent) for e in events(client, "queued"))
    assert engine.blocks.num_free == 64 and not engine.has_unfinished()
    assert group_pending(client) == 0


def test_cancel_reaches_a_running_job_within_one_step(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    engine = sim_engine("sim:step_ms=20")
    with thread_worker(redis_url, "c1", engine) as w:
        submit(client, "j", prompt="p", max_tokens=500)
        wait_for(lambda: client.xlen(KEYS.out("j")) >= 2, what="tokens")
        client.set(KEYS.cancel("j"), 1)
        n_at_cancel = client.xlen(KEYS.out("j"))
        wait_terminal(client, ["j"], timeout=5)
        assert w.stop() == 0
    done = check_stream(client, "j")
    # the flag is read with the publish of the step in flight; at most that step and the next
    assert done.completion_tokens <= n_at_cancel + 2


def test_poison_job_past_max_deliveries_is_dead_lettered(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    client.xgroup_create(KEYS.jobs, "workers", id="0", mkstream=True)
    entry = client.xadd(KEYS.jobs, {"id": "poison", "prompt": "boom", "max_tokens": "3"})
    client.xreadgroup("workers", "ghost", {KEYS.jobs: ">"}, count=1)
    for _ in range(3):  # a worker that died three more times with it: delivered 4 times
        client.xclaim(KEYS.jobs, "workers", "ghost", 0, [entry])
    submit(client, "healthy", prompt="fine", max_tokens=3)
    with thread_worker(redis_url, "p", claim_idle_ms=300, max_deliveries=3) as w:
        got = wait_terminal(client, ["poison", "healthy"], timeout=15)
        assert w.stop() == 0
    assert isinstance(got["poison"], ErrorEvent) and got["poison"].code == "too_many_deliveries"
    check_stream(client, "healthy")
    dead = client.xrange(KEYS.dead)
    assert len(dead) == 1 and dead[0][1][b"code"] == b"too_many_deliveries"
    assert dead[0][1][b"id"] == b"poison" and dead[0][1][b"source_id"] == entry
    assert group_pending(client) == 0
    assert terminal(client, "poison") == got["poison"]


def test_job_at_max_deliveries_still_runs(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    client.xgroup_create(KEYS.jobs, "workers", id="0", mkstream=True)
    entry = client.xadd(KEYS.jobs, {"id": "survivor", "prompt": "ok", "max_tokens": "3"})
    client.xreadgroup("workers", "ghost", {KEYS.jobs: ">"}, count=1)
    client.xclaim(KEYS.jobs, "workers", "ghost", 0, [entry])  # 2 deliveries; the reclaim is #3
    with thread_worker(redis_url, "p2", claim_idle_ms=300, max_deliveries=3) as w:
        wait_terminal(client, ["survivor"], timeout=15)
        assert w.stop() == 0
    check_stream(client, "survivor")
    assert client.xlen(KEYS.dead) == 0
