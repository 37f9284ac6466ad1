"""Priority across the fleet, on a real redis-server and simulated workers: jobs go to their band's
stream (high: priority < 0, normal: 0 and plain v1 entries to `qw:jobs`, low: > 0), workers with
room take the most urgent first, a full worker still takes an urgent job and displaces a worse
one, which goes back to its band's requeue stream and finishes with the same text."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from qworker.engine.request import Request
from qworker.engine.simulated import SimulatedEngine
from qworker.service.intake import Taken
from qworker.service.job import Entry, Readback
from qworker_client import Producer
from qworker_client.protocol import Job
from tests.service_harness import (
    KEYS,
    check_stream,
    expected,
    sim_engine,
    thread_worker,
    wait_for,
    wait_terminal,
)


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


def record_adds(engine: SimulatedEngine, log: list[tuple[float, str]],
                lock: threading.Lock) -> None:
    original = engine.add

    def add(request: Request) -> None:
        with lock:
            log.append((time.monotonic(), request.request_id))
        original(request)

    engine.add = add  # type: ignore[method-assign]


def test_two_workers_take_the_most_urgent_band_first(redis_url: str,
                                                     client: redis.Redis) -> None:
    jobs: dict[str, dict[str, object]] = {}
    with Producer(redis_url) as prod:
        for k in range(6):
            jobs[f"low{k}"] = dict(prompt=f"low {k}", max_tokens=8, priority=3)
            prod.submit(f"low {k}", id=f"low{k}", max_tokens=8, priority=3)
        for k in range(4):  # v1: plain entries to qw:jobs, no priority field
            jobs[f"v1n{k}"] = dict(prompt=f"normal {k}", max_tokens=8)
            client.xadd(KEYS.jobs, {"id": f"v1n{k}", "prompt": f"normal {k}", "max_tokens": "8"})
        for k in range(4):
            jobs[f"high{k}"] = dict(prompt=f"high {k}", max_tokens=8, priority=-2)
            prod.submit(f"high {k}", id=f"high{k}", max_tokens=8, priority=-2)
    assert client.xlen(KEYS.jobs_of(None, "high")) == 4 and client.xlen(KEYS.jobs) == 4
    assert client.xlen(KEYS.jobs_of(None, "low")) == 6
    log: list[tuple[float, str]] = []
    lock = threading.Lock()
    engines = [sim_engine("sim:step_ms=3", max_num_seqs=2) for _ in range(2)]
    for e in engines:
        record_adds(e, log, lock)
    with thread_worker(redis_url, "w1", engines[0]), thread_worker(redis_url, "w2", engines[1]):
        done = wait_terminal(client, jobs)
    order = [rid for _, rid in sorted(log)]
    assert sorted(order) == sorted(jobs)  # each taken once
    band = {rid: rid.rstrip("0123456789") for rid in jobs}
    ranks = [("high", "v1n", "low").index(band[rid]) for rid in order]
    assert ranks == sorted(ranks), order  # every high before every normal before every low
    want = expected({rid: {k: v for k, v in f.items() if k != "priority"}
                     for rid, f in jobs.items()})
    for rid in jobs:
        event = check_stream(client, rid)
        assert (event.text, event.finish_reason) == want[rid] and done[rid].type == "done"


def test_a_full_worker_displaces_a_low_job_for_an_urgent_one(redis_url: str,
                                                             client: redis.Redis) -> None:
    low = {f"long{k}": dict(prompt=f"long job {k}", max_tokens=150, priority=1)
           for k in range(2)}
    engine = sim_engine("sim:step_ms=4", max_num_seqs=2)
    with Producer(redis_url) as prod, thread_worker(redis_url, "w", engine):
        for rid, f in low.items():
            prod.submit(str(f["prompt"]), id=rid, max_tokens=150, priority=1)
        wait_for(lambda: all(client.xlen(KEYS.out(rid)) >= 5 for rid in low),
                 what="both long jobs to stream")
        assert engine.free_slots() == 0
        started = time.monotonic()
        prod.submit("urgent", id="urgent", max_tokens=5, priority=-1)
        done = wait_terminal(client, ["urgent"])
        urgent_s = time.monotonic() - started
        assert done["urgent"].type == "done"
        assert not any(client.exists(KEYS.out(rid)) and _finished(client, rid) for rid in low)
        wait_terminal(client, low)
    assert urgent_s < 2.0, urgent_s  # it did not wait for 150 tokens of 4 ms
    requeue_low = KEYS.requeue_of(None, "low")
    assert client.xinfo_stream(requeue_low)["entries-added"] >= 1  # the displaced one's band
    assert client.xlen(requeue_low) == 0
    want = expected({rid: {k: v for k, v in f.items() if k != "priority"}
                     for rid, f in low.items()})
    for rid in low:  # greedy or seeded alike: resumed exactly where it was displaced
        event = check_stream(client, rid)
        assert (event.text, event.finish_reason) == want[rid]


def _finished(client: redis.Redis, rid: str) -> bool:
    last: Any = client.xrevrange(KEYS.out(rid), count=1)
    return bool(last) and last[0][1].get(b"type") in (b"done", b"error")



def test_band_keys() -> None:
    from qworker_client.protocol import band_of, band_of_fields

    assert [band_of(p) for p in (-3, 0, 7)] == ["high", "", "low"]
    assert band_of_fields({"priority": "-1"}) == "high" and band_of_fields({}) == ""
    assert band_of_fields({"priority": "x"}) == ""  # refused by the worker wherever it is
    assert KEYS.jobs_of("m", "high") == "qw:jobs:high:{m}"
    assert KEYS.requeue_of(None, "low") == "qw:requeue:low"
    streams = KEYS.streams_for("m")
    assert len(streams) == 12 and streams[:4] == (
        "qw:requeue:high:{m}", "qw:requeue:high", "qw:jobs:high:{m}", "qw:jobs:high")
    for stream in streams:  # each names its model and band back
        assert KEYS.stream_model(stream) in ("m", None)
        assert (KEYS.jobs_of(KEYS.stream_model(stream), KEYS.stream_band(stream)) == stream
                or KEYS.requeue_of(KEYS.stream_model(stream), KEYS.stream_band(stream)) == stream)
    model_high = "qw:jobs:{high}"  # a model named high, normal band
    assert KEYS.stream_band(model_high) == "" and KEYS.stream_model(model_high) == "high"
    with pytest.raises(ValueError):
        KEYS.jobs_of(None, "urgent")


def test_an_idle_worker_woken_by_a_burst_takes_all_of_it(redis_url: str,
                                                         client: redis.Redis) -> None:
    from qworker.service.config import ServiceConfig
    from qworker.service.groups import Groups
    from qworker.service.intake import Intake
    from qworker.service.logs import get_logger
    from qworker.service.scripts import Scripts

    intake = Intake(client, KEYS, ServiceConfig(redis_url=redis_url, name="idle"), Scripts(), "t")
    Groups(client, intake.streams, "workers", get_logger()).ensure()
    got: list[list[str]] = []
    reader = threading.Thread(target=lambda: got.append(
        [e.entry_id for e in intake.read({"high": 8, "": 2, "low": 0}, block_ms=10_000)]))
    reader.start()
    time.sleep(0.3)  # it blocks now
    pipe = client.pipeline(transaction=True)  # one transaction: the reader wakes after all
    for k in range(3):
        pipe.xadd(KEYS.jobs, {"id": f"n{k}", "prompt": "x"})
    pipe.xadd(KEYS.jobs_of(None, "low"), {"id": "l0", "prompt": "x", "priority": "1"})
    ids = [i.decode() for i in pipe.execute()]
    reader.join(15)
    assert got == [ids[:2]]  # the normal band's room, and none of the low band (room 0)


def test_a_requeued_job_ages_only_by_its_waits() -> None:
    """queued_s for aging: a new job waited since first queued; a requeued one until it first
    started and since its requeue entry, not while it ran in between."""
    t0, started, requeued_at, now = 1_000_000, 1_004_000, 1_060_000, 1_061_500
    fresh = Taken(Entry("qw:jobs:low", f"{t0}-0", {}), Job(prompt="p"), Readback(), False,
                  t0_ms=t0, started_ms=now)
    assert fresh.waited_ms(now) == now - t0
    back = Taken(Entry(KEYS.requeue_of(None, "low"), f"{requeued_at}-0", {}), Job(prompt="p"),
                 Readback(), False, t0_ms=t0, started_ms=started, requeued=True)
    assert back.waited_ms(now) == 4_000 + 1_500  # not the 56 s it ran
