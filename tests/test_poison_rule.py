"""Who is charged for a worker's death, against a real redis-server: the job the dead worker ran
alone (its alone key names it) gets a crash, the other jobs it held are excused; a worker names
the job it runs alone before each such step, and nothing during shared steps; `poisoned` turns
the counts into a dead letter. The end-to-end case (SIGKILLed workers) is in test_service_chaos."""

from __future__ import annotations

import time

import redis

from qworker.engine.sequence import Sequence
from qworker.service.config import ServiceConfig
from qworker.service.intake import Intake, Taken
from qworker.service.job import Entry, Readback
from qworker.service.scripts import Scripts, alone_key
from qworker_client.protocol import Job, Keys
from tests.service_harness import (
    KEYS,
    check_stream,
    group_pending,
    sim_engine,
    submit,
    thread_worker,
    wait_for,
    wait_terminal,
)


def _intake(url: str, token: str = "heir/1", **config: int) -> Intake:
    client = redis.Redis.from_url(url)
    Scripts.load(client)
    cfg = ServiceConfig(redis_url=url, name="heir", **config)  # type: ignore[arg-type]
    return Intake(client, KEYS, cfg, Scripts(), token)


def _take(intake: Intake, *job_ids: str, deliveries: int = 2) -> dict[str, Taken]:
    items = [(Entry(KEYS.jobs, f"1-{k}", {}, deliveries=deliveries), Job(id=j, prompt="x"))
             for k, j in enumerate(job_ids)]
    taken, rejects = intake.take(items)
    assert rejects == []
    return {t.job.id or "": t for t in taken}


def test_a_death_is_charged_to_the_job_run_alone_and_excused_for_the_others(
        redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    for job in ("culprit", "bystander"):
        client.hset(KEYS.owner(job), "worker", "dead/1")
    client.hset(KEYS.owner("requeued"), "worker", "")  # a drained worker let it go
    client.set(alone_key(Keys("qw"), "dead/1"), "culprit")  # it died stepping `culprit` alone
    taken = _take(_intake(redis_url), "culprit", "bystander", "requeued", "fresh")
    assert {j: (t.crashes, t.excused) for j, t in taken.items()} == {
        "culprit": (1, 0), "bystander": (0, 1), "requeued": (0, 0), "fresh": (0, 0)}
    # settled once: the next taker (a death of `heir/1` with no job alone) adds nothing to them
    again = _take(_intake(redis_url, token="heir/2"), "culprit", "bystander", deliveries=3)
    assert {j: (t.crashes, t.excused) for j, t in again.items()} == {
        "culprit": (1, 0), "bystander": (0, 1)}
    assert client.hget(KEYS.owner("culprit"), "worker") == b"heir/2"


def test_a_dead_worker_that_ran_nothing_alone_charges_and_excuses_nobody(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    client.hset(KEYS.owner("j"), mapping={"worker": "dead/2", "crashes": 2, "excused": 1})
    t = _take(_intake(redis_url), "j")["j"]  # dead/2 left no alone key
    assert (t.crashes, t.excused) == (2, 1)
    client.hset(KEYS.owner("j"), "worker", "dead/3")
    client.hset(alone_key(Keys("qw"), "dead/3"), "not", "a string")  # a foreign key is nobody
    t = _take(_intake(redis_url), "j")["j"]
    assert (t.crashes, t.excused) == (2, 1)


def _taken(deliveries: int, crashes: int = 0, excused: int = 0) -> Taken:
    entry = Entry(KEYS.jobs, "1-1", {}, deliveries=deliveries)
    return Taken(entry, Job(id="j", prompt="x"), Readback(), cancelled=False, t0_ms=0,
                 started_ms=0, crashes=crashes, excused=excused)


def test_poisoned_after_max_crashes_or_too_many_unexplained_deliveries(redis_url: str) -> None:
    intake = _intake(redis_url, max_crashes=3, max_deliveries=4)
    assert intake.poisoned(_taken(deliveries=4, crashes=2)) is None
    crashed = intake.poisoned(_taken(deliveries=4, crashes=3))
    assert crashed is not None and crashed.code == "too_many_deliveries"
    assert "died 3 times while it ran this job alone" in crashed.message
    # 9 deliveries: 1 + 1 own crash + 4 deaths of other jobs' + 3 with no job to blame
    assert intake.poisoned(_taken(deliveries=9, crashes=1, excused=4)) is None
    worn = intake.poisoned(_taken(deliveries=10, crashes=1, excused=4))
    assert worn is not None and worn.code == "too_many_deliveries" and worn.drop_owner
    assert "delivered 5 times (max_deliveries 4" in worn.message


def test_the_worker_names_the_job_it_steps_alone_before_each_such_step(redis_url: str) -> None:
    """Entries left by a dead worker (so isolated) beside fresh ones: in every step that holds
    one sequence alone the worker's alone key already names it, in shared steps it names none;
    at exit the key is gone."""
    client = redis.Redis.from_url(redis_url)
    client.xgroup_create(KEYS.jobs, "workers", id="0", mkstream=True)
    for k in range(3):
        submit(client, f"orphan{k}", prompt=f"left behind {k}", max_tokens=5)
    client.xreadgroup("workers", "dead-worker", {KEYS.jobs: ">"}, count=3)  # then it died
    engine = sim_engine("sim:step_ms=5")
    seen: list[tuple[list[str], bool, object]] = []
    real_run = engine.runner.run
    holder: list[str] = []

    def run(work: list[tuple[Sequence, int]]) -> dict[Sequence, int]:
        alone = client.get(alone_key(Keys("qw"), holder[0]))
        seen.append(([s.request_id for s, _ in work], any(s.isolate for s, _ in work), alone))
        return real_run(work)

    engine.runner.run = run  # type: ignore[method-assign]
    jobs = [f"orphan{k}" for k in range(3)] + ["fresh0", "fresh1"]
    with thread_worker(redis_url, "w", engine, claim_idle_ms=200) as w:
        holder.append(w.worker.token)
        for job in ("fresh0", "fresh1"):
            submit(client, job, prompt=f"new {job}", max_tokens=5)
        wait_terminal(client, jobs)
        wait_for(lambda: group_pending(client) == 0, what="acks")
        assert w.stop() == 0
    alone_steps = [(ids, key) for ids, isolated, key in seen if isolated]
    assert {ids[0] for ids, _ in alone_steps} == {"orphan0", "orphan1", "orphan2"}
    assert all(len(ids) == 1 and key == ids[0].encode() for ids, key in alone_steps), seen
    assert all(key is None for _, isolated, key in seen if not isolated), seen
    assert client.exists(alone_key(Keys("qw"), holder[0])) == 0
    for job in jobs:
        assert check_stream(client, job).completion_tokens == 5


def test_a_step_alone_waits_while_the_alone_key_cannot_be_written(redis_url: str) -> None:
    """Two suspects admitted (the alone key names the second last); then, for a second, Redis
    refuses the key's move back to the first (connection errors): no step runs meanwhile, as
    the next one would hold the first alone unrecorded; then both run and finish."""
    client = redis.Redis.from_url(redis_url)
    client.xgroup_create(KEYS.jobs, "workers", id="0", mkstream=True)
    for k in range(2):
        submit(client, f"orphan{k}", prompt=f"left behind {k}", max_tokens=5)
    client.xreadgroup("workers", "dead-worker", {KEYS.jobs: ">"}, count=2)  # then it died
    engine = sim_engine("sim:step_ms=5")
    steps: list[tuple[float, object]] = []
    real_run = engine.runner.run
    holder: list[str] = []

    def run(work: list[tuple[Sequence, int]]) -> dict[Sequence, int]:
        steps.append((time.monotonic(), client.get(alone_key(Keys("qw"), holder[0]))))
        return real_run(work)

    engine.runner.run = run  # type: ignore[method-assign]
    refused: list[float] = []
    values: list[object] = []
    with thread_worker(redis_url, "w", engine, claim_idle_ms=200) as w:
        holder.append(w.worker.token)
        real_set = w.worker.client.set

        def flaky_set(name: str, value: str, **kwargs: object) -> object:
            values.append(value)
            if value == "orphan0" and values.count(value) > 1 and (
                    not refused or time.monotonic() < refused[0] + 1.0):
                refused.append(time.monotonic())
                raise redis.ConnectionError("injected: connection reset")
            return real_set(name, value, **kwargs)  # type: ignore[arg-type]

        w.worker.client.set = flaky_set  # type: ignore[method-assign,assignment]
        wait_terminal(client, ["orphan0", "orphan1"], timeout=30)
        wait_for(lambda: group_pending(client) == 0, what="acks")
        assert w.stop() == 0
    assert values[:3] == ["orphan0", "orphan1", "orphan0"], values  # start, start, step alone
    assert len(refused) >= 2, refused  # retried with backoff
    assert steps and all(t >= refused[0] + 1.0 for t, _ in steps), (refused, steps[:3])
    assert steps[0][1] == b"orphan0", steps[:3]
    for job in ("orphan0", "orphan1"):
        assert check_stream(client, job).completion_tokens == 5
