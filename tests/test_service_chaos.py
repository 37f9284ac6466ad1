"""Chaos against a real redis-server, workers on the simulated engine: a live worker keeps its jobs
however long its steps and whatever cancels arrive; a stalled one loses them to a peer; a killed
one's jobs are finished by another, each token index once.

A watcher samples `XPENDING` all along: an entry of a live worker delivered twice (its delivery
count above 1, or a second consumer) is a double delivery.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from pathlib import Path

import redis

from qworker_client.protocol import DoneEvent
from tests.service_harness import (
    KEYS,
    check_stream,
    expected,
    group_pending,
    sim_engine,
    spawn_worker,
    stop_process,
    thread_worker,
    wait_for,
    wait_terminal,
)


class DeliveryWatch:
    """Samples the group's pending entries: their delivery counts and consumers."""

    def __init__(self, url: str, interval: float = 0.02) -> None:
        self.client = redis.Redis.from_url(url)
        self.interval = interval
        self.deliveries: dict[str, int] = defaultdict(int)
        self.consumers: dict[str, set[str]] = defaultdict(set)
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> DeliveryWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                rows = self.client.xpending_range(KEYS.jobs, "workers", "-", "+", 10_000)
            except redis.ResponseError:  # NOGROUP: no worker has started yet
                rows = []
            for row in rows:
                entry = row["message_id"].decode()
                self.deliveries[entry] = max(self.deliveries[entry], row["times_delivered"])
                self.consumers[entry].add(row["consumer"].decode())
            self.samples += 1
            self._stop.wait(self.interval)

    def doubled(self) -> list[str]:
        return [e for e, n in self.deliveries.items() if n > 1 or len(self.consumers[e]) > 1]


def _submit(client: redis.Redis, jobs: dict[str, dict[str, object]]) -> None:
    for job_id, fields in jobs.items():
        client.xadd(KEYS.jobs, {"id": job_id, **{k: str(v) for k, v in fields.items()}})


def test_steps_longer_than_claim_idle_with_cancels_keep_every_job_with_its_worker(
        redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    jobs = {f"long{k}": {"prompt": f"slow {k}", "max_tokens": 6} for k in range(10)}
    cancelled = ["long1", "long4", "long7"]
    cfg = {"claim_idle_ms": 200}  # heartbeat every 50 ms; each step takes 400 ms
    with DeliveryWatch(redis_url) as watch, \
            thread_worker(redis_url, "slow-a", sim_engine("sim:step_ms=400"), **cfg) as a, \
            thread_worker(redis_url, "slow-b", sim_engine("sim:step_ms=400"), **cfg) as b:
        _submit(client, jobs)
        wait_for(lambda: group_pending(client) == len(jobs), what="all jobs taken")
        for k, job_id in enumerate(cancelled):  # arrive during steps, at different moments
            time.sleep(0.15 + 0.1 * k)
            client.set(KEYS.cancel(job_id), "1", ex=60)
        got = wait_terminal(client, jobs, timeout=60)
        assert a.stop() == 0 and b.stop() == 0
    assert watch.samples > 20 and watch.doubled() == [], dict(watch.deliveries)
    for w in (a, b):
        assert w.worker.metrics.reclaimed._value.get() == 0
        assert w.worker.metrics.lost._value.get() == 0
    want = expected({k: v for k, v in jobs.items() if k not in cancelled})
    for job_id, event in got.items():
        assert isinstance(event, DoneEvent), (job_id, event)
        done = check_stream(client, job_id)
        if job_id in cancelled:
            assert done.finish_reason == "cancelled", job_id
        else:
            assert (done.text, done.finish_reason) == want[job_id], job_id
    assert group_pending(client) == 0
    print(f"FIGURES long-steps: entries={len(jobs)} cancels={len(cancelled)} lost=0 exits=0 "
          f"double_deliveries={len(watch.doubled())} samples={watch.samples}")


def test_a_stalled_loop_stops_beating_and_a_peer_finishes_its_job(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    jobs = {"stuck": {"prompt": "wedged", "max_tokens": 4}}
    cfg = {"claim_idle_ms": 200}
    with thread_worker(redis_url, "wedged", sim_engine("sim:step_ms=2500"),
                       stall_timeout_s=0.5, **cfg) as stalled:
        _submit(client, jobs)
        wait_for(lambda: group_pending(client) == 1, what="taken")
        wait_for(lambda: stalled.worker.heartbeat.stalled, timeout=5, what="heartbeat stopped")
        with thread_worker(redis_url, "heir", sim_engine("sim:step_ms=2"), **cfg) as heir:
            got = wait_terminal(client, jobs, timeout=30)
            assert heir.stop() == 0
        assert stalled.stop() == 0
    assert heir.worker.metrics.reclaimed._value.get() == 1
    # when its step ended, the stalled worker found the job finished (or owned by the heir) and
    # dropped it: fenced, it wrote nothing
    assert stalled.worker.active == {}
    assert isinstance(got["stuck"], DoneEvent)
    assert (check_stream(client, "stuck").text, "length") == expected(jobs)["stuck"]
    assert group_pending(client) == 0


def test_a_killed_worker_s_jobs_are_finished_by_another_each_index_once(
        redis_url: str, tmp_path: Path) -> None:
    client = redis.Redis.from_url(redis_url)
    jobs = {f"kill{k}": {"prompt": f"victim {k}", "max_tokens": 60} for k in range(3)}
    proc = spawn_worker(redis_url, "doomed", "--model", "sim:step_ms=30", "--claim-idle-ms",
                        "300", log_path=tmp_path / "doomed.log")
    try:
        _submit(client, jobs)
        wait_for(lambda: all(client.xlen(KEYS.out(j)) >= 5 for j in jobs), timeout=60,
                 what="tokens from the doomed worker")
    finally:
        stop_process(proc)  # SIGKILL, mid-job
    assert all(client.xlen(KEYS.out(j)) < 61 for j in jobs)  # none had finished
    with thread_worker(redis_url, "heir", sim_engine("sim:step_ms=2"), claim_idle_ms=300) as heir:
        wait_terminal(client, jobs, timeout=30)
        assert heir.stop() == 0
    assert heir.worker.metrics.reclaimed._value.get() == len(jobs)
    want = expected(jobs)
    for job_id in jobs:
        assert (check_stream(client, job_id).text, "length") == want[job_id], job_id
    assert group_pending(client) == 0
    print(f"FIGURES sigkill: entries={len(jobs)} lost=0 reclaimed={len(jobs)}")


def test_a_loop_whose_redis_round_trips_fail_keeps_its_jobs(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    jobs = {f"flaky{k}": {"prompt": f"hiccup {k}", "max_tokens": 40} for k in range(4)}
    cfg = {"claim_idle_ms": 200}
    with DeliveryWatch(redis_url) as watch, \
            thread_worker(redis_url, "flaky", sim_engine("sim:step_ms=20"), **cfg) as a:
        _submit(client, jobs)
        wait_for(lambda: all(client.xlen(KEYS.out(j)) >= 2 for j in jobs), what="tokens")
        real_flush = a.worker.publisher.flush
        fail_until = time.monotonic() + 1.0  # five times claim-idle of failed publishes

        def flaky_flush(*args: object) -> object:
            if time.monotonic() < fail_until:
                raise redis.ConnectionError("injected: connection reset")
            return real_flush(*args)  # type: ignore[arg-type]

        a.worker.publisher.flush = flaky_flush  # type: ignore[method-assign]
        with thread_worker(redis_url, "peer", sim_engine("sim:step_ms=2"), **cfg) as peer:
            got = wait_terminal(client, jobs, timeout=30)
            assert peer.stop() == 0
        assert a.stop() == 0
    assert a.worker.metrics.redis_errors._value.get() >= 1  # it did back off
    assert peer.worker.metrics.reclaimed._value.get() == 0
    assert watch.doubled() == []
    want = expected(jobs)
    for job_id, event in got.items():
        assert isinstance(event, DoneEvent)
        assert (check_stream(client, job_id).text, "length") == want[job_id]
