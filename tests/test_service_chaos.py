"""Chaos against a real redis-server, workers on the simulated engine: a live worker keeps its jobs
however long its steps and whatever cancels arrive; a stalled one loses them to a peer; a killed
one's jobs are finished by another, each token index once; a poison job that kills its worker
process in every step it is in is dead-lettered after the crashes it caused alone, and the jobs
that shared its batches and workers finish.

A watcher samples `XPENDING` all along: an entry of a live worker delivered twice (its delivery
count above 1, or a second consumer) is a double delivery.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, TypeVar

import redis

from qworker.service.lua_fair import PARKED_CONSUMER
from qworker_client.protocol import DoneEvent, ErrorEvent
from tests.service_harness import (
    KEYS,
    ROOT,
    check_stream,
    checkout_env,
    expected,
    group_pending,
    sim_engine,
    spawn_worker,
    spy,
    stop_process,
    terminal,
    thread_worker,
    wait_for,
    wait_terminal,
)
from tests.worker_process import stop_gracefully

W = TypeVar("W", bound="PendingWatch")


class PendingWatch:
    """Samples the group's pending entries (`XPENDING`) in a thread, every `interval` s, handing
    each sample's rows to `sample`."""

    def __init__(self, url: str, interval: float = 0.02) -> None:
        self.client = redis.Redis.from_url(url)
        self.interval = interval
        self.deliveries: dict[str, int] = defaultdict(int)
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self: W) -> W:
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
            # entries parked by the fair read wait their turn in Redis: delivered to no worker
            rows = [row for row in rows if row["consumer"].decode() != PARKED_CONSUMER]
            for row in rows:
                entry = row["message_id"].decode()
                self.deliveries[entry] = max(self.deliveries[entry], row["times_delivered"])
            self.sample(rows)
            self.samples += 1
            self._stop.wait(self.interval)

    def sample(self, rows: list[dict[str, Any]]) -> None:
        raise NotImplementedError


class DeliveryWatch(PendingWatch):
    """The pending entries' delivery counts and consumers."""

    def __init__(self, url: str, interval: float = 0.02) -> None:
        super().__init__(url, interval)
        self.consumers: dict[str, set[str]] = defaultdict(set)

    def sample(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            self.consumers[row["message_id"].decode()].add(row["consumer"].decode())

    def doubled(self) -> list[str]:
        return [e for e, n in self.deliveries.items() if n > 1 or len(self.consumers[e]) > 1]


TENANTS = ("acme", "globex", "default")  # the last one's jobs name no tenant: it is the default


def _submit(client: redis.Redis, jobs: dict[str, dict[str, object]]) -> None:
    """Plain XADDs, of three tenants in turn."""
    for k, (job_id, fields) in enumerate(jobs.items()):
        tenant = TENANTS[k % len(TENANTS)]
        named = {"tenant": tenant} if tenant != "default" else {}
        client.xadd(KEYS.jobs, {"id": job_id, **named, **{k: str(v) for k, v in fields.items()}})


def _check_tenants(client: redis.Redis, jobs: dict[str, dict[str, object]]) -> None:
    """Each job ended as its tenant's (the recent-jobs stream, written with its end)."""
    ended = {f[b"id"].decode(): f[b"tenant"].decode() for _, f in client.xrange(KEYS.recent)}
    assert {j: ended.get(j) for j in jobs} == {
        j: TENANTS[k % len(TENANTS)] for k, j in enumerate(jobs)}


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
        assert w.worker.metrics.fenced._value.get() == 0
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
    _check_tenants(client, jobs)
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


class MoveWatch(PendingWatch):
    """Which consumer holds each pending entry; a move from a consumer that was still alive then
    is a double delivery from a live worker."""

    def __init__(self, url: str, dead: dict[str, float], interval: float = 0.02) -> None:
        super().__init__(url, interval)
        self.dead = dead  # consumer -> when its process was seen gone (time.monotonic())
        self.holder: dict[str, str] = {}
        self.moves = 0
        self.live_moves: list[tuple[str, str, str]] = []  # (entry, from, to)

    def sample(self, rows: list[dict[str, Any]]) -> None:
        now = time.monotonic()
        for row in rows:
            entry, consumer = row["message_id"].decode(), row["consumer"].decode()
            before = self.holder.setdefault(entry, consumer)
            if before != consumer:
                self.moves += 1
                if self.dead.get(before, now + 1) > now:
                    self.live_moves.append((entry, before, consumer))
                self.holder[entry] = consumer


def _spawn_poison_worker(url: str, name: str, crash_log: Path, log_dir: Path
                         ) -> subprocess.Popen[bytes]:
    out = open(log_dir / f"{name}.log", "wb")  # noqa: SIM115
    cmd = [sys.executable, "-m", "tests.poison_worker", url, name, str(crash_log)]
    return subprocess.Popen(cmd, stdout=out, stderr=out, cwd=ROOT, env=checkout_env())


def test_poison_jobs_that_kill_their_worker_are_dead_lettered_and_their_batch_mates_finish(
        redis_url: str, tmp_path: Path) -> None:
    """Two jobs whose steps SIGKILL the process, among innocent ones, on two workers restarted
    when they die (tests/poison_worker.py: --max-crashes 3, --max-deliveries 2). Each poison job
    is charged only the crashes it caused alone and is dead-lettered after 3 of them; every
    innocent job finishes with its whole text, though it was reclaimed more often than
    --max-deliveries allows: the deaths were another job's."""
    client = redis.Redis.from_url(redis_url)
    innocents = {f"inno{k}": {"prompt": f"innocent {k}", "max_tokens": 40} for k in range(6)}
    poison = {p: {"prompt": f"a POISON pill {p}", "max_tokens": 40} for p in ("pA", "pB")}
    order = ["inno0", "inno1", "pA", "inno2", "inno3", "pB", "inno4", "inno5"]
    jobs = {**innocents, **poison}
    entry_of = {j: client.xadd(KEYS.jobs, {"id": j, **{k: str(v) for k, v in jobs[j].items()}}
                               ).decode() for j in order}
    crash_log = tmp_path / "crashes.log"
    dead: dict[str, float] = {}
    exits: list[tuple[str, int]] = []
    procs: dict[str, subprocess.Popen[bytes]] = {}
    spawned = 0

    def spawn() -> None:
        nonlocal spawned
        name = f"pw{spawned}"
        spawned += 1
        procs[name] = _spawn_poison_worker(redis_url, name, crash_log, tmp_path)

    def reap() -> bool:
        """Notes the workers that exited, restarts them (as a supervisor would); True always,
        so that wait_for's conditions can call it first."""
        for name, proc in list(procs.items()):
            if proc.poll() is not None:
                dead[name] = time.monotonic()
                exits.append((name, proc.returncode))
                del procs[name]
                spawn()
        return True

    try:
        with MoveWatch(redis_url, dead) as watch:
            spawn()  # the first worker takes every job: the poisons' first step is shared
            wait_for(lambda: reap() and (group_pending(client) == len(jobs) or exits),
                     timeout=60, what="all jobs taken by the first worker")
            spawn()
            wait_for(lambda: reap() and all(terminal(client, j) for j in jobs), timeout=240,
                     what="every job to end")
            for proc in procs.values():
                assert stop_gracefully(proc) == 0
    finally:
        for proc in procs.values():
            stop_process(proc)
    crashes = [line.split() for line in crash_log.read_text().splitlines()]
    # every exit was an induced crash: SIGKILL by a poison step, logged just before
    assert [rc for _, rc in exits] == [-signal.SIGKILL] * len(exits), exits
    assert sorted(name for name, _ in exits) == sorted(name for name, _ in crashes)
    sizes = [int(n) for _, n in crashes]
    assert len(sizes) == 7 and sizes[0] > 1 and sizes[1:] == [1] * 6, sizes  # 1 shared, 3+3 alone
    for p in poison:
        error = terminal(client, p)
        assert isinstance(error, ErrorEvent) and error.code == "too_many_deliveries", error
        assert "3 times while it ran this job alone" in error.message, error.message
    dead_letters = sorted((f[b"id"].decode(), f[b"code"].decode(), f[b"source_id"].decode())
                          for _, f in client.xrange(KEYS.dead))
    assert dead_letters == [(p, "too_many_deliveries", entry_of[p]) for p in sorted(poison)]
    want = expected(innocents)
    for job_id in innocents:
        done = check_stream(client, job_id)  # each index once, one `done`, text whole
        assert (done.text, done.finish_reason) == want[job_id], job_id
    assert group_pending(client) == 0 and client.xlen(KEYS.jobs) == 0
    assert watch.samples > 20 and watch.moves >= 7 and watch.live_moves == [], watch.live_moves
    most = max(watch.deliveries[entry_of[j]] for j in innocents)
    assert most > 2, dict(watch.deliveries)  # an innocent job went past --max-deliveries, excused
    print(f"FIGURES poison: entries={len(jobs)} (2 poison, {len(innocents)} innocent) "
          f"innocent_done={len(innocents)} lost=0 induced_crashes={len(crashes)} (first in a "
          f"step of {sizes[0]}, then alone) other_exits={len(exits) - len(crashes)} "
          f"reclaims_from_dead={watch.moves} double_deliveries_live={len(watch.live_moves)} "
          f"most_innocent_deliveries={most} workers_started={spawned}")


def test_entries_read_beside_a_long_step_stay_with_their_reader(redis_url: str) -> None:
    """A worker with room reads new entries with the round trip that runs beside its engine step,
    and admits them when the step ends: they are its own from the moment they are read. A peer
    that starts meanwhile, idle and reclaiming every claim-idle/2, does not take them however
    long the step is, and no job runs on two workers (the issue's repro: 2,000-token prefills
    of many seconds, ping-ponged between two live workers)."""
    client = redis.Redis.from_url(redis_url)
    first = {"first": {"prompt": "holds the engine", "max_tokens": 3}}
    later = {f"later{k}": {"prompt": f"read beside a step {k}", "max_tokens": 2} for k in range(4)}
    cfg = {"claim_idle_ms": 200}  # beats every 50 ms; each step takes 800 ms
    reader_engine = sim_engine("sim:step_ms=800", max_num_seqs=16)
    peer_engine = sim_engine("sim:step_ms=2")
    ran_on = {"reader": spy(reader_engine), "peer": spy(peer_engine)}
    with DeliveryWatch(redis_url) as watch, \
            thread_worker(redis_url, "reader", reader_engine, **cfg) as reader:
        _submit(client, first)
        wait_for(lambda: client.xlen(KEYS.out("first")) >= 1, what="the reader's first step")
        _submit(client, later)  # read by the round trip beside one of the next steps
        wait_for(lambda: _pending_to(client, "reader") == 1 + len(later), what="later read")
        # idle, it blocks in its read 100 ms at a time, so it reclaims every claim-idle/2
        with thread_worker(redis_url, "peer", peer_engine, block_ms=100, **cfg) as peer:
            got = wait_terminal(client, {**first, **later}, timeout=30)
            assert peer.stop() == 0
        assert reader.stop() == 0
    assert peer.worker.metrics.reclaimed._value.get() == 0
    assert ran_on == {"reader": [*first, *later], "peer": []}, ran_on
    assert reader.worker.metrics.fenced._value.get() == 0
    assert watch.doubled() == [], dict(watch.deliveries)
    want = expected({**first, **later})
    for job_id, event in got.items():
        assert isinstance(event, DoneEvent), (job_id, event)
        assert (check_stream(client, job_id).text, "length") == want[job_id], job_id
    assert group_pending(client) == 0


def _pending_to(client: redis.Redis, consumer: str) -> int:
    try:
        rows = client.xinfo_consumers(KEYS.jobs, "workers")
    except redis.ResponseError:  # NOGROUP: no worker has made the group yet
        return 0
    return sum(int(r["pending"]) for r in rows if r["name"].decode() == consumer)
