"""The fair-share rule under random fleets (hypothesis, on a real redis-server): random tenants,
weights, job sizes and arrival orders, workers that take random rooms, finish, requeue and crash.
While tenants are backlogged their weighted service stays within start-time fair queueing's
bound (|S_a/w_a - S_b/w_b| <= l_a/w_a + l_b/w_b, l the largest job); every job ends exactly
once, none is held by two live workers at once, and nothing is left behind (no starvation)."""

from __future__ import annotations

import itertools
import time
from collections import Counter

import redis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from qworker.service.intake import Intake
from qworker.service.job import Entry
from qworker_client.protocol import Keys
from tests.fair_harness import cost, field, finish, intake, submit

PROMPT = "tenant work"
_RUNS = itertools.count()

fleets = st.fixed_dictionaries({
    "weights": st.lists(st.integers(1, 4), min_size=2, max_size=4),
    "sizes": st.lists(st.integers(1, 40), min_size=3, max_size=20),
    "order": st.randoms(use_true_random=False),
    "workers": st.integers(1, 3),
    "ops": st.lists(st.tuples(st.integers(0, 2), st.integers(1, 6),
                              st.sampled_from(["finish", "finish", "finish", "requeue",
                                               "crash"])), min_size=5, max_size=40),
})


class Fleet:
    def __init__(self, client: redis.Redis, keys: Keys, workers: int) -> None:
        self.client = client
        self.keys = keys
        self.workers = [intake(client, keys, f"w{k}", claim_idle_ms=100) for k in range(workers)]
        self.held: dict[str, list[Entry]] = {w.consumer: [] for w in self.workers}
        self.holder: dict[str, str] = {}
        self.ended: Counter[str] = Counter()
        self.crashed = 0

    def read(self, w: Intake, room: int) -> list[Entry]:
        got = w.read(room, block_ms=None)
        assert len(got) <= room  # never more than admitted
        self._hold(w, got)
        return got

    def _hold(self, w: Intake, got: list[Entry]) -> None:
        for e in got:
            job_id = field(e, "id") or ""
            assert job_id not in self.holder, f"{job_id} held by {self.holder[job_id]} too"
            self.holder[job_id] = w.consumer
        self.held[w.consumer] += got

    def finish(self, w: Intake) -> None:
        entries, self.held[w.consumer] = self.held[w.consumer], []
        finish(self.client, entries)
        for e in entries:
            job_id = field(e, "id") or ""
            self.ended[job_id] += 1
            del self.holder[job_id]

    def requeue(self, w: Intake) -> None:
        """A started job given back (preempted): to the requeue stream, with its fields."""
        if not self.held[w.consumer]:
            return
        e = self.held[w.consumer].pop()
        self.client.xadd(self.keys.requeue, e.fields)
        finish(self.client, [e])
        del self.holder[field(e, "id") or ""]

    def crash(self, w: Intake) -> None:
        """The worker dies holding its jobs; a live one reclaims them (the others beat)."""
        heirs = [h for h in self.workers if h is not w]
        if not heirs or self.crashed >= 1:
            return self.finish(w)
        self.crashed += 1
        time.sleep(0.12)  # past claim-idle
        for h in heirs:  # their heartbeats: idle times reset
            ids = [e.entry_id for e in self.held[h.consumer]]
            for stream in {e.stream for e in self.held[h.consumer]}:
                self.client.xclaim(stream, "workers", h.consumer, 0,
                                   [i for i in ids if i], justid=True)
        dead, self.held[w.consumer] = self.held[w.consumer], []
        for e in dead:
            del self.holder[field(e, "id") or ""]
        got = heirs[0].reclaim(1000, set())
        assert sorted(e.entry_id for e in got) == sorted(e.entry_id for e in dead)
        self._hold(heirs[0], got)
        self.workers.remove(w)


@settings(max_examples=25, deadline=None, phases=[Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fleet=fleets)
def test_shares_stay_within_bounds_and_every_job_ends_once(redis_url: str,
                                                          fleet: dict[str, object]) -> None:
    client = redis.Redis.from_url(redis_url)
    keys = Keys(f"hyp{next(_RUNS)}")
    weights: list[int] = fleet["weights"]  # type: ignore[assignment]
    sizes: list[int] = fleet["sizes"]  # type: ignore[assignment]
    tenants = [f"t{k}" for k in range(len(weights))]
    client.hset(keys.tenants, mapping={t: f"{w} 0 0"
                                       for t, w in zip(tenants, weights, strict=True)})
    jobs = [(t, f"{t}-{k}", size) for t in tenants for k, size in enumerate(sizes)]
    fleet["order"].shuffle(jobs)  # type: ignore[attr-defined]
    for tenant, job_id, size in jobs:
        submit(client, keys, tenant, job_id, max_tokens=size, prompt=PROMPT)
    largest = cost(PROMPT, max(sizes))
    left = Counter(t for t, _, _ in jobs)  # not yet taken from the fair queue
    served: Counter[str] = Counter()
    f = Fleet(client, keys, fleet["workers"])  # type: ignore[arg-type]
    drain = itertools.cycle([(k, 6, "finish") for k in range(3)])  # every worker finishes
    ops = itertools.chain(fleet["ops"], drain)  # type: ignore[call-overload]
    for turn in itertools.count():
        if not (f.holder or any(left.values()) or client.xlen(keys.requeue)):
            break
        assert turn < 10_000, (left, f.holder, client.xlen(keys.requeue))
        k, room, action = next(ops)
        w = f.workers[k % len(f.workers)]
        for e in f.read(w, room):
            if e.stream == keys.jobs:
                tenant = field(e, "tenant") or ""
                left[tenant] -= 1
                served[tenant] += cost(PROMPT, int(field(e, "max_tokens") or 0))
        backlogged = [t for t in tenants if left[t] > 0]
        for a, b in itertools.combinations(backlogged, 2):
            wa, wb = weights[tenants.index(a)], weights[tenants.index(b)]
            assert abs(served[a] / wa - served[b] / wb) <= largest / wa + largest / wb, (
                a, b, served)
        getattr(f, action)(w)
    assert f.ended == Counter(job_id for _, job_id, _ in jobs)  # each once
    assert client.zcard(keys.ready_of(keys.jobs)) == 0
    assert client.xlen(keys.jobs) == 0
    assert client.xpending(keys.jobs, "workers")["pending"] == 0
    client.close()
