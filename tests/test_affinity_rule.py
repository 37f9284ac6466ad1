"""Prefix affinity under random fleets (hypothesis, on a real redis-server, intakes without
engines): random sessions (and plain jobs) in random bands, workers that read random rooms,
finish, wait and die, with the fair share on or off. Every job ends exactly once, none is held
by two workers at once, no read takes more than its room; after the bound, a worker with room
takes everything waiting but what it has just offered (so no job waits longer than the bound
while a worker is idle); a killed worker's jobs and offers are taken by the others."""

from __future__ import annotations

import itertools
import time
from collections import Counter
from typing import Any

import redis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from qworker.service.affinity import Affinity
from qworker.service.config import ServiceConfig
from qworker.service.groups import Groups
from qworker.service.intake import Intake
from qworker.service.job import Entry
from qworker.service.logs import get_logger
from qworker.service.lua_affinity import OFFERED_CONSUMER
from qworker.service.scripts import Scripts
from qworker_client.protocol import Keys
from tests.fair_harness import field, finish

BOUND_MS = 30
CLAIM_IDLE_MS = 150
_RUNS = itertools.count()

ops = st.lists(st.one_of(
    st.tuples(st.just("submit"), st.lists(st.tuples(st.sampled_from([None, "a", "b", "c", "d"]),
                                                    st.sampled_from(["", "high", "low"])),
                                          min_size=1, max_size=6)),
    st.tuples(st.just("read"), st.integers(0, 3), st.integers(1, 4)),
    st.tuples(st.just("finish"), st.integers(0, 3)),
    st.tuples(st.just("idle_read"), st.integers(0, 3)),
    st.tuples(st.just("kill"), st.integers(0, 3)),
), min_size=3, max_size=30)


def affine_intake(client: redis.Redis, keys: Keys, name: str, fair: bool) -> Intake:
    cfg = ServiceConfig(redis_url="redis://unused", prefix=keys.prefix, name=name,
                        fair_share=fair, claim_idle_ms=CLAIM_IDLE_MS, affinity_ms=BOUND_MS)
    it = Intake(client, keys, cfg, Scripts(affinity=Affinity(keys, BOUND_MS, 1000)),
                token=f"{name}/1")
    Groups(client, it.streams, cfg.group, get_logger()).ensure()
    return it


def redis_ms(client: redis.Redis) -> int:
    sec, usec = client.time()
    return sec * 1000 + usec // 1000


class Fleet:
    def __init__(self, client: redis.Redis, keys: Keys, workers: int, fair: bool) -> None:
        self.client = client
        self.keys = keys
        self.workers = [affine_intake(client, keys, f"w{k}", fair) for k in range(workers)]
        self.held: dict[str, list[Entry]] = {w.consumer: [] for w in self.workers}
        self.holder: dict[str, str] = {}
        self.ended: Counter[str] = Counter()
        self.submitted: list[str] = []
        self.killed = False

    def submit(self, jobs: list[tuple[str | None, str]]) -> None:
        for session, band in jobs:
            job_id = f"j{len(self.submitted)}"
            fields = {"id": job_id, "prompt": "chat", "max_tokens": "4"}
            if session is not None:
                fields["session"] = session
            self.client.xadd(self.keys.jobs_of(None, band), fields)  # type: ignore[arg-type]
            self.submitted.append(job_id)

    def worker(self, k: int) -> Intake:
        return self.workers[k % len(self.workers)]

    def read(self, w: Intake, room: int) -> list[Entry]:
        got = w.read(room, block_ms=None)
        assert len(got) <= room  # never more than admitted
        for e in got:
            job_id = field(e, "id") or ""
            assert job_id not in self.holder, f"{job_id} held by {self.holder[job_id]} too"
            self.holder[job_id] = w.consumer
        self.held[w.consumer] += got
        return got

    def finish(self, w: Intake) -> None:
        entries, self.held[w.consumer] = self.held[w.consumer], []
        finish(self.client, entries)
        for e in entries:
            job_id = field(e, "id") or ""
            self.ended[job_id] += 1
            del self.holder[job_id]

    def idle_read(self, w: Intake) -> None:
        """Past the bound, a worker with room takes all that waits, but what it offers now."""
        self.finish(w)
        time.sleep(BOUND_MS / 1000 + 0.005)
        t0 = redis_ms(self.client)
        self.read(w, 1000)
        offers = {m.decode().split(" ")[2]: score for m, score in
                  self.client.zrange(self.keys.offers, 0, -1, withscores=True)}
        for stream in w.streams:
            for entry_id, _ in self.client.xrange(stream):
                eid = entry_id.decode()
                pending = self.client.xpending_range(stream, "workers", eid, eid, 1)
                if pending and pending[0]["consumer"].decode() not in (OFFERED_CONSUMER,):
                    continue  # held by a worker
                assert eid in offers and offers[eid] >= t0 + BOUND_MS, (eid, offers, t0)

    def heartbeats(self) -> None:
        """The live workers' beats: their entries' idle times reset."""
        for h in self.workers:
            for e in self.held[h.consumer]:
                self.client.xclaim(e.stream, "workers", h.consumer, 0, [e.entry_id], justid=True)

    def kill(self, w: Intake) -> None:
        """The worker dies holding its jobs (and maybe offered some): the others take them, by
        reclaim (after claim-idle) and by the offers' expiry."""
        if self.killed or len(self.workers) < 2:
            return self.finish(w)
        self.killed = True
        self.workers.remove(w)
        dead, self.held[w.consumer] = self.held[w.consumer], []
        for e in dead:
            del self.holder[field(e, "id") or ""]
        time.sleep(CLAIM_IDLE_MS / 1000 + 0.03)
        self.heartbeats()
        got: list[Entry] = []
        for h in self.workers:
            got += h.reclaim(1000, set())
        dead_ids = {e.entry_id for e in dead}
        assert dead_ids <= {e.entry_id for e in got}  # the rest were offers, idle as long
        heir = self.workers[0]
        for e in got:
            self.holder[field(e, "id") or ""] = heir.consumer
        self.held[heir.consumer] += got

    def drain(self) -> None:
        for turn in itertools.count():
            if len(self.ended) == len(self.submitted) and not self.holder:
                return
            assert turn < 200, (len(self.ended), len(self.submitted), self.holder)
            for w in list(self.workers):
                self.read(w, 8)
                self.finish(w)
            time.sleep(BOUND_MS / 1000 + 0.005)


@settings(max_examples=20, deadline=None, phases=[Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(script=ops, workers=st.integers(2, 4), fair=st.booleans())
def test_every_job_ends_once_and_none_waits_past_the_bound_while_a_worker_is_idle(
        redis_url: str, script: list[Any], workers: int, fair: bool) -> None:
    client = redis.Redis.from_url(redis_url)
    keys = Keys(f"aff{next(_RUNS)}")
    f = Fleet(client, keys, workers, fair)
    for op in script:
        if op[0] == "submit":
            f.submit(op[1])
        elif op[0] == "read":
            f.read(f.worker(op[1]), op[2])
        else:
            getattr(f, op[0])(f.worker(op[1]))
    f.drain()
    assert f.ended == Counter(f.submitted)  # each once
    for stream in f.workers[0].streams:
        assert client.xlen(stream) == 0
        if client.exists(stream):
            assert client.xpending(stream, "workers")["pending"] == 0
    assert client.zcard(keys.offers) == 0
    client.close()
