"""Fair preemption (qworker/service/fair_jump.py) on a real redis-server: a full worker is handed
the head of the fair order only while the rule holds after the swap (weights counted), never for
a tenant alone; end to end, a late tenant starts before the flood's jobs end, and every
preempted job still ends once with its whole output."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from qworker.service.fair_jump import Jumps, offer
from qworker.service.intake import capped_entries
from qworker.service.job import ActiveJob, Entry
from qworker_client.protocol import DoneEvent, Job, Keys
from tests.fair_harness import field, finish, intake, submit
from tests.service_harness import (
    KEYS,
    check_stream,
    events,
    sim_engine,
    thread_worker,
    wait_for,
    wait_terminal,
)
from tests.service_harness import submit as submit_job

_RUNS = itertools.count()


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url)
    c.flushall()
    yield c
    c.close()


def jump_read(client: redis.Redis, running: dict[str, int]) -> list[Entry]:
    """One fair read by a full worker (every cap 0) offering to preempt, as the round trip makes
    it."""
    it = intake(client, KEYS, "full")
    caps = it.caps(0)
    positions = tuple(k for k, (stream, _) in enumerate(caps, start=1) if stream == KEYS.jobs)
    reply = it.scripts.read(client, group=it.config.group, consumer=it.consumer, caps=caps,
                            fair=KEYS, jumps=Jumps(positions, running))
    return capped_entries(reply, KEYS)


def park(client: redis.Redis) -> None:
    """Parks what is queued (a read with room for nothing hands nothing over)."""
    jump_read(client, {})


def test_a_full_worker_is_handed_a_tenant_below_its_share(client: redis.Redis) -> None:
    for k in range(6):
        submit(client, KEYS, "A", f"a{k}")
    park(client)
    client.zpopmin(KEYS.ready_of(KEYS.jobs), 4)  # A's first four run, on the full worker
    submit(client, KEYS, "B", "b0")
    submit(client, KEYS, "B", "b1")
    got = jump_read(client, {"A": 4})
    # A's last two come first in the fair order, and wait (A is over its share); B's two are
    # handed over: 0+1 <= 4-1, then 1+1 <= 3-1 (a third would be 2+1 > 2-1)
    assert [(field(e, "id"), e.displaces) for e in got] == [("b0", "A"), ("b1", "A")]
    assert [m.split()[1] for m in client.zrange(KEYS.ready_of(KEYS.jobs), 0, -1)] == [b"A"] * 2
    submit(client, KEYS, "B", "b2")
    assert jump_read(client, {"A": 2, "B": 2}) == []


def test_a_tenant_alone_preempts_nothing(client: redis.Redis) -> None:
    for k in range(6):
        submit(client, KEYS, "A", f"a{k}")
    assert jump_read(client, {"A": 4}) == []
    assert client.zcard(KEYS.ready_of(KEYS.jobs)) == 6  # parked, waiting their turn


def test_the_rule_counts_weights_and_holds_after_the_swap(client: redis.Redis) -> None:
    client.hset(KEYS.tenants, mapping={"A": "3 0 0", "B": "1 0 0"})
    for k in range(3):
        submit(client, KEYS, "B", f"b{k}")
    got = jump_read(client, {"A": 4})
    assert [field(e, "id") for e in got] == ["b0"]  # 1/1 <= 3/3; then 2/1 > 2/3
    assert got[0].displaces == "A"
    assert jump_read(client, {"A": 3, "B": 1}) == []  # nor back: 4/3 > 0/1
    assert jump_read(client, {"A": 2, "B": 2}) == []


def test_an_offer_that_hands_nothing_costs_redis_5_commands(client: redis.Redis) -> None:
    for k in range(20):
        submit(client, KEYS, "A", f"a{k}")
    park(client)
    it = intake(client, KEYS, "full")
    jumps = Jumps(tuple(k for k, (s, _) in enumerate(it.caps(0), start=1) if s == KEYS.jobs),
                  {"A": 4})
    client.config_resetstat()
    for _ in range(10):
        assert it.jump(jumps) == []
    stats = client.info("commandstats")
    calls = sum(int(v["calls"]) for k, v in stats.items()
                if k not in ("cmdstat_info", "cmdstat_config|resetstat"))
    # EVALSHA, the quota flag's HEXISTS, the parking XREADGROUP, a ZRANGE of the first 16, one
    # HMGET of the weights
    assert calls <= 10 * 5, stats


def test_no_offer_where_no_preemption_could_make_one() -> None:
    def running(tenant: str, stream: str) -> ActiveJob:
        job = Job(id=f"{tenant}-{stream}", prompt="x", tenant=tenant)
        return ActiveJob(job, Entry(stream, "1-0", {}), log=None, t0_ms=0, started_ms=0)

    streams = KEYS.streams_for(None)
    assert offer([running("A", KEYS.jobs)], streams, KEYS) is None  # one job: nothing to give
    assert offer([running("A", KEYS.requeue), running("B", KEYS.jobs)], streams, KEYS) is None
    high = next(s for s in streams if KEYS.stream_band(s) == "high" and not KEYS.is_requeue(s))
    assert offer([running("A", high), running("A", high)], streams, KEYS) is None
    jumps = offer([running("A", KEYS.jobs), running("A", KEYS.requeue)], streams, KEYS)
    assert jumps is not None and jumps.running == {"A": 2}
    assert [streams[p - 1] for p in jumps.positions] == [KEYS.jobs]


def test_a_late_tenant_starts_before_the_floods_jobs_end(redis_url: str,
                                                         client: redis.Redis) -> None:
    flood = [submit_job(client, f"a{k}", tenant="A", prompt="flood", max_tokens=300,
                        ignore_eos=True) for k in range(8)]
    engine = sim_engine("sim:step_ms=5", max_num_seqs=4)
    with thread_worker(redis_url, "w1", engine) as w:
        wait_for(lambda: all(len(events(client, j)) > 5 for j in flood[:4]), what="A running")
        late = [submit_job(client, f"b{k}", tenant="B", prompt="late", max_tokens=4)
                for k in range(2)]
        ends = wait_terminal(client, late, timeout=30)
        # an A job takes 300 steps of 5 ms: none has ended when B's have
        assert not any(isinstance(e, DoneEvent) for j in flood for e in events(client, j)), ends
        wait_terminal(client, flood, timeout=120)
        assert w.stop() == 0
    for job_id in flood + late:
        done = check_stream(client, job_id)  # each index once, one done, whole text
        assert done.completion_tokens == (300 if job_id in flood else 4), job_id
    assert int(client.xlen(KEYS.requeue)) == 0


fleets = st.fixed_dictionaries({
    "weights": st.lists(st.integers(1, 3), min_size=2, max_size=3),
    "jobs": st.lists(st.integers(0, 2), min_size=4, max_size=30),  # each job's tenant (mod)
    "slots": st.integers(2, 5),
    "ops": st.lists(st.tuples(st.integers(0, 1), st.sampled_from(["read", "read", "finish"])),
                    min_size=5, max_size=60),
})


@settings(max_examples=25, deadline=None, phases=[Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fleet=fleets)
def test_random_fleets_preempt_only_by_the_rule_and_every_job_ends_once(
        redis_url: str, fleet: dict[str, Any]) -> None:
    client = redis.Redis.from_url(redis_url)
    keys = Keys(f"jump{next(_RUNS)}")
    weights = {f"t{k}": w for k, w in enumerate(fleet["weights"])}
    client.hset(keys.tenants, mapping={t: f"{w} 0 0" for t, w in weights.items()})
    tenants = list(weights)
    ids = [f"{tenants[t % len(tenants)]}-{k}" for k, t in enumerate(fleet["jobs"])]
    workers = [intake(client, keys, f"w{k}") for k in range(2)]
    held: dict[str, list[Entry]] = {w.consumer: [] for w in workers}
    ended: Counter[str] = Counter()
    queued = iter(ids)
    slots: int = fleet["slots"]

    def tenant(e: Entry) -> str:
        return field(e, "tenant") or ""

    def preempt(w: Any, victim: str) -> None:  # the newest of `victim`'s, requeued
        mine = held[w.consumer]
        e = next(e for e in reversed(mine) if tenant(e) == victim and e.stream == keys.jobs)
        mine.remove(e)
        client.xadd(keys.requeue, e.fields)
        finish(client, [e])

    drain = itertools.cycle([(0, "finish"), (1, "finish"), (0, "read"), (1, "read")])
    for turn, (k, action) in enumerate(itertools.chain(fleet["ops"], drain)):
        done = sum(ended.values()) == len(ids)
        if done:
            break
        assert turn < 5_000, (ended, held)
        nxt = next(queued, None)  # one arrival a turn
        if nxt is not None:
            submit(client, keys, nxt.split("-")[0], nxt)
        w = workers[k]
        mine = held[w.consumer]
        if action == "finish" and mine:
            e = mine.pop(0)
            finish(client, [e])
            ended[field(e, "id") or ""] += 1
            continue
        if len(mine) < slots:
            mine += w.read(slots - len(mine), block_ms=None)
            continue
        running = Counter(tenant(e) for e in mine if e.stream == keys.jobs)
        jumps = offer_of(w, keys, dict(running))
        got = capped_entries(w.scripts.read(client, group=w.config.group, consumer=w.consumer,
                                            caps=w.caps(0), fair=keys, jumps=jumps), keys)
        for e in got:
            t, u = tenant(e), e.displaces
            assert u is not None and u != t, (t, u)
            assert (running[t] + 1) / weights[t] <= (running[u] - 1) / weights[u], (running, t, u)
            running[t] += 1
            running[u] -= 1
            preempt(w, u)
            mine.append(e)
        assert len(mine) <= slots
    assert ended == Counter(ids)  # every job ended, each once
    assert client.xlen(keys.jobs) == 0 and client.xlen(keys.requeue) == 0
    client.close()


def offer_of(w: Any, keys: Keys, running: dict[str, int]) -> Jumps:
    positions = tuple(k for k, (stream, _) in enumerate(w.caps(0), start=1)
                      if stream == keys.jobs)
    return Jumps(positions, running)
