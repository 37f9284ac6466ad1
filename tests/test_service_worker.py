"""The worker against a real redis-server, in threads, on the simulated engine."""

from __future__ import annotations

import threading
import time

import redis

from qworker_client.protocol import WorkerInfo
from tests.service_harness import (
    KEYS,
    check_stream,
    expected,
    group_pending,
    sim_engine,
    submit,
    terminal,
    thread_worker,
    wait_for,
    wait_terminal,
)


def _jobs(n: int, max_tokens: int = 24) -> dict[str, dict[str, object]]:
    return {f"job-{k}": {"prompt": f"prompt number {k}", "max_tokens": max_tokens + k % 5}
            for k in range(n)}


def test_one_worker_runs_jobs_to_the_expected_text(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    jobs = _jobs(12)
    want = expected(jobs)
    with thread_worker(redis_url, "w1", claim_idle_ms=2000) as w:
        for job_id, fields in jobs.items():
            submit(client, job_id, **fields)
        wait_terminal(client, jobs)
        info = WorkerInfo.model_validate_json(client.get(KEYS.worker("w1")))
        assert info.name == "w1" and info.group == "workers" and not info.draining
        assert 0 < client.pttl(KEYS.worker("w1")) <= 2000
        assert w.stop() == 0
    assert not client.exists(KEYS.worker("w1"))  # a clean exit removes it at once
    for job_id in jobs:
        done = check_stream(client, job_id)
        assert (done.text, done.finish_reason) == want[job_id]
        assert done.prompt_tokens == len(jobs[job_id]["prompt"])
        assert done.total_ms >= done.ttft_ms >= done.queue_ms >= 0
    assert group_pending(client) == 0
    assert not client.exists(*[KEYS.owner(j) for j in jobs])
    assert 0 < client.ttl(KEYS.out("job-0")) <= 3600


def test_two_workers_share_the_work_and_none_runs_twice(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    jobs = _jobs(24, max_tokens=30)
    want = expected(jobs)
    with thread_worker(redis_url, "a", sim_engine(max_num_seqs=4)) as a, \
            thread_worker(redis_url, "b", sim_engine(max_num_seqs=4)) as b:
        for job_id, fields in jobs.items():
            submit(client, job_id, **fields)
        wait_terminal(client, jobs)
        started = {name: w.worker.metrics.jobs_started.labels("jobs")._value.get()
                   for name, w in (("a", a), ("b", b))}
        assert a.stop() == 0 and b.stop() == 0
    assert started["a"] > 0 and started["b"] > 0, started
    assert started["a"] + started["b"] == len(jobs), started
    for job_id in jobs:
        assert check_stream(client, job_id).text == want[job_id][0]
    assert group_pending(client) == 0


def test_tiny_kv_cache_preempts_and_requeues_without_changing_texts(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    jobs = _jobs(10, max_tokens=40)
    want = expected(jobs)
    engine = sim_engine("sim:step_ms=1", num_blocks=36, block_size=4, max_num_seqs=8)
    with thread_worker(redis_url, "tiny", engine) as w:
        for job_id, fields in jobs.items():
            submit(client, job_id, **fields)
        wait_terminal(client, jobs)
        requeued = w.worker.metrics.requeues.labels("preempted")._value.get()
        assert w.stop() == 0
    assert engine.num_preemptions > 0 and requeued == engine.num_preemptions
    assert client.xinfo_stream(KEYS.requeue)["entries-added"] == requeued
    assert client.xlen(KEYS.requeue) == 0  # every requeue entry was taken, finished and deleted
    for job_id in jobs:
        done = check_stream(client, job_id)
        assert (done.text, done.finish_reason) == want[job_id], job_id
    assert engine.blocks.num_free == 36
    assert group_pending(client) == 0


def _pending_by_consumer(client: redis.Redis) -> dict[str, int]:
    try:
        consumers = client.xinfo_consumers(KEYS.jobs, "workers")
    except redis.ResponseError as exc:  # NOGROUP: no worker has made the group yet
        assert "NOGROUP" in str(exc), exc
        return {}
    return {c["name"].decode(): c["pending"] for c in consumers}


def test_a_busy_worker_never_holds_more_jobs_than_it_can_start(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    jobs = _jobs(12, max_tokens=40)
    held: dict[str, int] = {}
    with thread_worker(redis_url, "small", sim_engine(max_num_seqs=2)) as a, \
            thread_worker(redis_url, "big", sim_engine(max_num_seqs=3)) as b:
        for job_id, fields in jobs.items():
            submit(client, job_id, **fields)
        while any(terminal(client, j) is None for j in jobs):
            for name, pending in _pending_by_consumer(client).items():
                held[name] = max(held.get(name, 0), pending)
            time.sleep(0.005)
        assert a.stop() == 0 and b.stop() == 0
    assert 1 <= held["small"] <= 2 and 1 <= held["big"] <= 3, held


def test_heartbeat_keeps_long_jobs_owned_while_the_worker_lives(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    jobs = {f"long-{k}": {"prompt": f"long {k}", "max_tokens": 300} for k in range(2)}
    holder = sim_engine("sim:step_ms=5", max_num_seqs=2)  # full: it never reclaims its own
    with thread_worker(redis_url, "holder", holder, claim_idle_ms=400) as a:
        for job_id, fields in jobs.items():
            submit(client, job_id, **fields)
        wait_for(lambda: all(client.xlen(KEYS.out(j)) for j in jobs), what="holder started")
        with thread_worker(redis_url, "thief", claim_idle_ms=400) as b:
            wait_terminal(client, jobs, timeout=30)  # > 1.5 s: several claim_idle periods
            assert b.worker.metrics.reclaimed._value.get() == 0
            assert b.stop() == 0
        assert a.worker.metrics.fenced._value.get() == 0
        assert a.stop() == 0
    for job_id in jobs:
        assert check_stream(client, job_id).completion_tokens == 300


def test_a_steps_round_trip_runs_beside_the_next_step(redis_url: str) -> None:
    """The events of one step go to Redis while the next step computes: each round trip waits
    (up to 0.5 s) to meet a step under way, and that step waits for it. A loop that waited for
    its round trip between steps would never have one meet a step. A job submitted meanwhile is
    read by such a round trip (it carries the engine's room), not by a read of its own."""
    client = redis.Redis.from_url(redis_url)
    engine = sim_engine("sim:step_ms=5")
    met: list[bool] = []
    reads: list[str] = []  # job ids of the entries each round trip read
    stepping, seen = [False], [False]
    changed = threading.Condition()
    real_step = engine.step

    def step() -> object:
        with changed:
            stepping[0], seen[0] = True, False
            changed.notify_all()
            changed.wait_for(lambda: seen[0], timeout=0.5)
            stepping[0] = False
        return real_step()

    engine.step = step  # type: ignore[method-assign]
    with thread_worker(redis_url, "beside", engine) as w:
        real_flush = w.worker.publisher.flush

        def flush(*args: object) -> object:
            with changed:
                met.append(changed.wait_for(lambda: stepping[0], timeout=0.5))
                seen[0] = met[-1]
                changed.notify_all()
            result = real_flush(*args)  # type: ignore[arg-type]
            reads.extend(e.fields[b"id"].decode() for e in result.entries)
            return result

        w.worker.publisher.flush = flush  # type: ignore[method-assign]
        submit(client, "side", prompt="a few steps", max_tokens=64)
        wait_for(lambda: client.xlen(KEYS.out("side")) >= 3, what="the first job's tokens")
        submit(client, "later", prompt="while it runs", max_tokens=4)
        wait_terminal(client, ["side", "later"])
        assert w.stop() == 0
    check_stream(client, "side")
    check_stream(client, "later")
    assert len(met) >= 64 and met.count(False) <= 3, met  # the last ones have no next step
    assert reads == ["later"]
