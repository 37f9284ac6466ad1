"""Fair share within a band, decided by the fair read where workers pull (real redis-server): the
tenants' weights hold, a late tenant does not wait behind a flood, a tenant alone gets all in
arrival order, bands stay strict, parked entries are nobody's to reclaim, and the Redis commands
a job costs stay within 3 of first come, first served."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from qworker.service.lua_fair import PARKED_CONSUMER
from qworker_client.protocol import Keys
from qworker_client.stats import stream_stats
from tests.fair_harness import field, finish, intake, submit
from tests.service_harness import KEYS, commands_per_job


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


def take(it: Any, room: int) -> list[Any]:
    got = it.read(room, block_ms=None)
    finish(it.client, got)
    return got


def test_weights_3_to_1_split_a_backlog_3_to_1(client: redis.Redis) -> None:
    client.hset(KEYS.tenants, mapping={"big": "3 0 0", "small": "1 0 0"})
    w = intake(client, KEYS, "w1")
    for k in range(120):  # arrival order: all of big's, then all of small's
        submit(client, KEYS, "big", f"b{k}")
    for k in range(120):
        submit(client, KEYS, "small", f"s{k}")
    taken: list[str] = []
    while len(taken) < 160:
        taken += [field(e, "tenant") or "" for e in take(w, 4)]
    assert Counter(taken[:160]) == {"big": 120, "small": 40}


def test_a_late_tenant_does_not_wait_behind_a_flood(client: redis.Redis) -> None:
    w = intake(client, KEYS, "w1")
    for k in range(200):
        submit(client, KEYS, "flood", f"f{k}")
    first = [field(e, "id") for e in take(w, 2) + take(w, 2)]
    assert first == ["f0", "f1", "f2", "f3"]  # one tenant alone: all of it, in arrival order
    for k in range(5):
        submit(client, KEYS, None, f"late{k}")  # no tenant: `default`
    nxt = [field(e, "id") for e in take(w, 5) + take(w, 5)]
    assert {f"late{k}" for k in range(5)} <= set(nxt), nxt  # interleaved 1:1, not after 196
    assert nxt[:2] in (["late0", "f4"], ["f4", "late0"])


def test_bands_stay_strict_and_parked_entries_are_nobodys(client: redis.Redis,
                                                          redis_url: str) -> None:
    w = intake(client, KEYS, "w1", claim_idle_ms=100)
    peer = intake(client, KEYS, "w2", claim_idle_ms=100)
    for k in range(6):
        submit(client, KEYS, "a", f"n{k}")
    assert [field(e, "id") for e in take(w, 1)] == ["n0"]  # the rest parked
    submit(client, KEYS, "b", "urgent", stream=KEYS.jobs_of(None, "high"))
    held = w.read(2, block_ms=None)  # the high band first, then the normal band's fair turn
    assert [field(e, "id") for e in held] == ["urgent", "n1"]
    pending = client.xpending_range(KEYS.jobs, "workers", "-", "+", 100)
    assert Counter(r["consumer"].decode() for r in pending) == {PARKED_CONSUMER: 4, "w1": 1}
    with redis.Redis.from_url(redis_url, decode_responses=True) as decoded:
        shown = stream_stats(decoded, KEYS.jobs, "workers")  # qworker stats, autoscalers
    assert (shown.pending, shown.parked, shown.waiting) == (1, 4, 4)
    time.sleep(0.15)
    reclaimed = peer.reclaim(10, set())  # idle past claim-idle: w1's held ones, not the parked
    assert sorted(field(e, "id") or "" for e in reclaimed) == ["n1", "urgent"]
    assert [field(e, "id") for e in take(peer, 10)] == ["n2", "n3", "n4", "n5"]
    assert client.zcard(KEYS.ready_of(KEYS.jobs)) == 0


def test_a_concurrency_quota_holds_a_tenant_and_frees_as_its_jobs_end(
        client: redis.Redis) -> None:
    client.hset(KEYS.tenants, mapping={"two": "1 0 2", ":quotas": "1"})
    w = intake(client, KEYS, "w1")
    for k in range(5):
        submit(client, KEYS, "two", f"c{k}")
    submit(client, KEYS, None, "free")
    first = w.read(8, block_ms=None)
    assert sorted(field(e, "id") or "" for e in first) == ["c0", "c1", "free"]
    assert all(e.charged for e in first)
    assert client.zcard(KEYS.held_of(KEYS.jobs)) == 3  # waiting, not lost
    assert w.read(8, block_ms=None) == []  # still two running
    finish(client, first[:1])  # one ends; its count is dropped by the next repair
    w.reclaim(8, set())
    assert [field(e, "id") for e in w.read(8, block_ms=None)] == ["c2"]
    assert client.zcard(KEYS.running) == 3  # c1, free, c2


def test_fair_share_off_is_first_come_first_served(client: redis.Redis) -> None:
    client.hset(KEYS.tenants, mapping={"big": "3 0 0"})
    w = intake(client, KEYS, "w1", fair_share=False)
    for k in range(4):
        submit(client, KEYS, "small", f"s{k}")
        submit(client, KEYS, "big", f"b{k}")
    assert [field(e, "id") for e in take(w, 8)] == [
        f"{t}{k}" for k in range(4) for t in ("s", "b")]
    assert not client.exists(KEYS.ready_of(KEYS.jobs))


def _commands_per_job(url: str, fair: bool, jobs: int) -> float:
    """(Fair preemption's offers cost by the time a worker is full, not by the job: counted in
    test_fair_preemption.py.)"""
    return commands_per_job(url, [{"id": f"j{k}", "tenant": f"t{k % 3}", "prompt": "count me",
                                   "max_tokens": "4"} for k in range(jobs)], fair_share=fair,
                            fair_preemption=False)


def test_the_fair_read_costs_at_most_3_more_commands_a_job(redis_url: str) -> None:
    fifo = _commands_per_job(redis_url, fair=False, jobs=240)
    fair = _commands_per_job(redis_url, fair=True, jobs=240)
    print(f"FIGURES redis commands per job: fifo={fifo:.2f} fair={fair:.2f} "
          f"more={fair - fifo:.2f}")
    assert fair - fifo <= 3.0, (fifo, fair)


def test_keys_of_one_models_fair_share_share_its_hash_slot() -> None:
    keys = Keys("qw")
    stream = keys.jobs_of("m1", "high")
    assert (keys.ready_of(stream), keys.vtime_of(stream)) == ("qw:ready:high:{m1}",
                                                             "qw:vtime:high:{m1}")
    with pytest.raises(ValueError, match="not a job stream"):
        keys.ready_of(keys.requeue)
