"""Prefix affinity, decided where workers pull (real redis-server, intakes without engines): a
session's job is offered to the worker that took the session's last job, that worker takes it
first; after the bound, or when that worker stopped reading, anyone takes it; a plain job is
read as before; bands, reclaim and the fair share hold."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from qworker.service.affinity import Affinity
from qworker.service.config import ServiceConfig
from qworker.service.groups import Groups
from qworker.service.intake import Intake
from qworker.service.logs import get_logger
from qworker.service.lua_affinity import MAX_OFFERS, OFFERED_CONSUMER
from qworker.service.scripts import Scripts
from qworker_client import Producer
from qworker_client.protocol import Job, JobValidationError, Keys, parse_job_fields
from qworker_client.stats import stream_stats
from tests.fair_harness import field, finish
from tests.service_harness import (
    commands_per_job,
    sim_engine,
    spy,
    thread_worker,
    wait_for,
    wait_terminal,
)

KEYS = Keys()
BOUND_MS = 40


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


def affine_intake(client: redis.Redis, name: str, bound_ms: int = BOUND_MS,
                  live_ms: int = 3000, **config: Any) -> Intake:
    cfg = ServiceConfig(redis_url="redis://unused", name=name, affinity_ms=bound_ms, **config)
    it = Intake(client, KEYS, cfg, Scripts(affinity=Affinity(KEYS, bound_ms, live_ms)),
                token=f"{name}/1")
    Groups(client, it.streams, cfg.group, get_logger()).ensure()
    Scripts.load(client)
    return it


def submit(client: redis.Redis, job_id: str, session: str | None = None,
           stream: str | None = None) -> str:
    fields = {"id": job_id, "prompt": "four", "max_tokens": "8"}
    if session is not None:
        fields["session"] = session
    return str(client.xadd(stream or KEYS.jobs, fields))  # type: ignore[arg-type]


def ids(it: Intake, room: int = 8) -> list[str]:
    got = it.read(room, block_ms=None)
    finish(it.client, got)
    return [field(e, "id") or "" for e in got]


@pytest.mark.parametrize("fair", [False, True])
def test_a_sessions_next_job_goes_to_the_worker_that_ran_its_last(client: redis.Redis,
                                                                  redis_url: str,
                                                                  fair: bool) -> None:
    w1, w2 = (affine_intake(client, n, fair_share=fair) for n in ("w1", "w2"))
    submit(client, "t1", "chat-a")
    assert ids(w1) == ["t1"]
    assert client.hget(KEYS.affinity_of(KEYS.jobs), "chat-a") == b"w1"
    submit(client, "t2", "chat-a")
    submit(client, "plain")
    assert ids(w2) == ["plain"]  # t2 was offered to w1: pending to the offered consumer
    pending = client.xpending_range(KEYS.jobs, "workers", "-", "+", 10)
    assert [r["consumer"].decode() for r in pending] == [OFFERED_CONSUMER]
    with redis.Redis.from_url(redis_url, decode_responses=True) as decoded:  # as stats reads
        shown = stream_stats(decoded, KEYS.jobs, "workers")  # an offer is waiting, not running
    assert (shown.pending, shown.parked) == (0, 1)
    assert ids(w1) == ["t2"]
    assert client.zcard(KEYS.offers) == 0


def test_an_offer_not_taken_within_the_bound_goes_to_anyone(client: redis.Redis) -> None:
    w1, w2 = affine_intake(client, "w1"), affine_intake(client, "w2")
    submit(client, "t1", "chat-a")
    assert ids(w1) == ["t1"]
    submit(client, "t2", "chat-a")
    got, wake_ms = w2._read_capped(w2.caps(8))
    assert got == [] and 0 < wake_ms <= BOUND_MS  # an idle w2 waits no longer than this
    time.sleep(2 * BOUND_MS / 1000)
    assert ids(w2) == ["t2"]  # w1 (saturated, say) did not take it in time
    assert client.hget(KEYS.affinity_of(KEYS.jobs), "chat-a") == b"w2"  # its cache has it now
    entry = client.xinfo_consumers(KEYS.jobs, "workers")
    assert {c["name"].decode(): c["pending"] for c in entry}[OFFERED_CONSUMER] == 0


def test_a_worker_that_left_or_stopped_reading_is_offered_nothing(client: redis.Redis) -> None:
    w1, w2 = affine_intake(client, "w1", live_ms=200), affine_intake(client, "w2", live_ms=200)
    submit(client, "t1", "a")
    submit(client, "u1", "b")
    assert ids(w1, 1) == ["t1"] and ids(w2, 1) == ["u1"]
    w1.leave()
    submit(client, "t2", "a")
    assert ids(w2) == ["t2"]  # at once: w1 left
    time.sleep(0.25)  # w2 has not read for longer than the live window (dead, or saturated)
    submit(client, "u2", "b")
    assert ids(w1) == ["u2"]


def test_a_dead_affine_workers_offers_are_taken_once_it_stops_being_live(
        client: redis.Redis) -> None:
    w1, w2 = affine_intake(client, "w1", live_ms=150), affine_intake(client, "w2", live_ms=150)
    submit(client, "t1", "a")
    assert ids(w1) == ["t1"]
    for k in range(3):
        submit(client, f"t{k + 2}", "a")
    assert ids(w2) == []  # offered to w1, which then dies
    time.sleep(0.2)
    assert sorted(ids(w2)) == ["t2", "t3", "t4"]


def test_plain_jobs_are_read_in_order_within_the_room_with_no_affinity_keys(
        client: redis.Redis) -> None:
    w1 = affine_intake(client, "w1")
    for k in range(5):
        submit(client, f"j{k}")
    assert ids(w1, 3) == ["j0", "j1", "j2"]
    assert ids(w1, 3) == ["j3", "j4"]
    assert client.exists(KEYS.offers, KEYS.affinity_of(KEYS.jobs)) == 0


def test_offers_keep_the_bands_order_and_refill_the_room(client: redis.Redis) -> None:
    w1, w2 = affine_intake(client, "w1"), affine_intake(client, "w2")
    submit(client, "t1", "a")
    assert ids(w1) == ["t1"]
    high = KEYS.jobs_of(None, "high")
    submit(client, "h-a", "a", stream=high)
    submit(client, "h-plain", stream=high)
    submit(client, "n-a", "a")
    submit(client, "n1")
    submit(client, "n2")
    assert ids(w2, 3) == ["h-plain", "n1", "n2"]  # the offered ones do not use its room
    assert ids(w1, 8) == ["h-a", "n-a"]  # high band first


def test_an_offered_entry_reclaimed_meanwhile_is_not_taken_twice(client: redis.Redis) -> None:
    w1 = affine_intake(client, "w1", claim_idle_ms=100)
    w2 = affine_intake(client, "w2", claim_idle_ms=100)
    submit(client, "t1", "a")
    assert ids(w1) == ["t1"]
    submit(client, "t2", "a")
    assert ids(w2) == []
    time.sleep(0.15)
    reclaimed = w2.reclaim(8, set())  # the last resort: idle past claim-idle
    assert [field(e, "id") for e in reclaimed] == ["t2"]
    assert ids(w1) == []  # its offer is gone with it
    assert client.zcard(KEYS.offers) == 0


def test_session_field_is_validated_like_a_tenant() -> None:
    job = parse_job_fields({"prompt": "x", "session": "conv-1.a:b_c"}, "1-0")
    assert isinstance(job, Job) and job.session == "conv-1.a:b_c"
    for bad in ("has space", "x" * 129, "brace{", ""):
        with pytest.raises(JobValidationError):
            parse_job_fields({"prompt": "x", "session": bad}, "1-0")


def test_affinity_keys_of_a_model_share_its_hash_slot() -> None:
    stream = KEYS.jobs_of("m", "low")
    assert KEYS.affinity_of(stream) == "qw:affinity:{m}"
    assert KEYS.affinity_seen_of(stream) == "qw:affinity_seen:{m}"
    assert KEYS.affinity_of(KEYS.requeue) == "qw:affinity"


def test_a_sessions_later_turns_run_on_the_worker_that_ran_its_first(redis_url: str,
                                                                     client: redis.Redis) -> None:
    """Two thread workers on the simulated engine: each turn is submitted when the last one
    ended (a chat); every later turn of a session runs where its first ran. The bound is longer
    than an idle worker's wait, so the test does not depend on who wakes first."""
    engines = {name: sim_engine() for name in ("w1", "w2")}
    ran = {name: spy(engine) for name, engine in engines.items()}
    with thread_worker(redis_url, "w1", engines["w1"], affinity_ms=2500), \
            thread_worker(redis_url, "w2", engines["w2"], affinity_ms=2500), \
            Producer(redis_url) as prod:
        for name in ("w1", "w2"):
            wait_for(lambda n=name: client.exists(KEYS.worker(n)), what=f"{name} live")
        history = {s: f"conversation {s}:" for s in range(6)}
        for turn in range(4):
            ids = [prod.submit(history[s] + f" turn {turn}", session=f"chat-{s}", max_tokens=4,
                               id=f"c{s}-t{turn}").id for s in history]
            wait_terminal(client, ids)
            for s in history:
                history[s] += f" turn {turn} answered."
    where = {job_id: name for name, jobs in ran.items() for job_id in jobs}
    for s in history:
        assert {where[f"c{s}-t{turn}"] for turn in range(4)} == {where[f"c{s}-t0"]}, where


def _commands_per_job(url: str, affinity_ms: int, sessions: bool, jobs: int = 240) -> float:
    """One worker of 8 slots through a backlog (tests/test_fair_share.py's measure)."""
    fields = [{"id": f"j{k}", "prompt": "count me", "max_tokens": "4"} for k in range(jobs)]
    if sessions:
        for k, job in enumerate(fields):
            job["session"] = f"chat-{k % 40}"
    return commands_per_job(url, fields, affinity_ms=affinity_ms)


def test_what_affinity_costs_in_redis_commands_a_job(redis_url: str) -> None:
    off = _commands_per_job(redis_url, 0, sessions=False)
    plain = _commands_per_job(redis_url, 50, sessions=False)
    sessions = _commands_per_job(redis_url, 50, sessions=True)
    print(f"FIGURES redis commands per job: affinity off={off:.2f} on, plain jobs={plain:.2f} "
          f"on, session jobs={sessions:.2f}")
    assert plain - off <= 2.0, (off, plain)  # a few a read call, none a job
    assert sessions - off <= 5.0, (off, sessions)  # HGET, HSET, ZADD a job


def test_past_the_offers_bound_a_sessions_entry_is_taken_as_it_comes(client: redis.Redis) -> None:
    w1, w2 = affine_intake(client, "w1"), affine_intake(client, "w2")
    submit(client, "t1", "a")
    assert ids(w1) == ["t1"]
    far = 2 * 10**13  # a pile of w1's offers that do not expire (as under a deep backlog)
    client.zadd(KEYS.offers, {f"w1 {KEYS.jobs} 0-{k + 1}": far for k in range(MAX_OFFERS)})
    submit(client, "t2", "a")
    assert ids(w2) == ["t2"]  # not offered: every read would have to scan more than it may
    assert client.zcard(KEYS.offers) == MAX_OFFERS
