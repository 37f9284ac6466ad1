"""Fencing once a step (lua.py `append`, service/lease.py) against a real Redis: while the
worker's lease holds and no job changed hands, a step's append only writes; anything that could
have moved a job (a takeover, a lease Redis lost or never confirmed, a resend) makes the next
append check every job again, so the guarantees of the per-job check stay."""

from __future__ import annotations

import pytest
import redis

from qworker.service import publisher as pub
from qworker.service.config import ServiceConfig
from qworker.service.intake import Intake
from qworker.service.job import ActiveJob
from qworker.service.lease import REFRESH_S
from qworker.service.publisher import Publisher
from qworker.service.scripts import Scripts
from qworker_client.protocol import (
    LOST_STATE,
    DoneEvent,
    ErrorEvent,
    Job,
    Keys,
    TokenEvent,
    parse_event,
)

KEYS = Keys()
CONFIG = ServiceConfig(redis_url="-", name="w")


@pytest.fixture
def client(redis_url: str) -> redis.Redis:
    c = redis.Redis.from_url(redis_url)
    c.xgroup_create(KEYS.jobs, "workers", id="0", mkstream=True)
    Scripts.load(c)
    return c


def _worker(client: redis.Redis, name: str) -> tuple[Intake, Publisher]:
    config = ServiceConfig(redis_url="-", name=name)
    return (Intake(client, KEYS, config, Scripts(), f"{name}/1"),
            Publisher(client, KEYS, config, Scripts(), f"{name}/1"))


def _running(client: redis.Redis, intake: Intake, ids: str) -> dict[str, ActiveJob]:
    for job_id in ids:
        client.xadd(KEYS.jobs, {"id": job_id, "prompt": "p"})
    entries = intake.read(len(ids), None)
    taken, _ = intake.take([(e, Job(id=i, prompt="p")) for e, i in zip(entries, ids, strict=True)])
    return {t.job.id: ActiveJob(t.job, t.entry, None, 0, 0) for t in taken}


def _step(publisher: Publisher, jobs: dict[str, ActiveJob], *ids: str) -> dict[str, str]:
    """One token more for each of `ids` (all jobs when none), flushed as the worker does: the
    outbox emptied of what was written."""
    stepping = [jobs[i] for i in ids or jobs]
    for job in stepping:
        job.add_tokens(job.next_index, [65], "A")
    status = publisher.flush(stepping, []).status
    for job in stepping:
        if status[job.job_id] in (pub.OK, pub.DONE):
            job.outbox.clear()
    return status


def _counts(client: redis.Redis) -> dict[str, int]:
    return {name.removeprefix("cmdstat_"): stat["calls"]
            for name, stat in client.info("commandstats").items()}


def _indices(client: redis.Redis, job_id: str) -> list[int]:
    return [e.i for _, f in client.xrange(KEYS.out(job_id))
            if isinstance(e := parse_event(f), TokenEvent)]


def test_a_trusted_step_writes_without_reading_any_job(client: redis.Redis) -> None:
    intake, publisher = _worker(client, "w")
    jobs = _running(client, intake, "abcdefgh")
    assert set(_step(publisher, jobs).values()) == {pub.OK}  # checked: owner and index read
    client.config_resetstat()
    for _ in range(5):
        assert set(_step(publisher, jobs).values()) == {pub.OK}
    calls = _counts(client)
    calls.pop("config|resetstat", None)
    assert calls["xadd"] == 5 * 8
    assert "hget" not in calls and "xrevrange" not in calls and "expire" not in calls
    assert calls["evalsha"] == 5
    # the script's own reads and writes of the lease: 2 a step, whatever the number of jobs
    assert sum(calls.values()) - calls["xadd"] - calls["evalsha"] == 2 * 5
    for job_id in jobs:
        assert _indices(client, job_id) == list(range(6))


def test_a_takeover_fences_a_trusted_job_at_the_next_step(client: redis.Redis) -> None:
    """A peer takes job `a` over (its entry claimed, as a reclaim does, then taken): the old
    owner's next append checks again and is fenced out; its other job goes on."""
    intake, publisher = _worker(client, "old")
    jobs = _running(client, intake, "ab")
    _step(publisher, jobs)
    _step(publisher, jobs)
    client.xclaim(KEYS.jobs, "workers", "peer", 0, [jobs["a"].entry.entry_id])
    peer, _ = _worker(client, "peer")
    assert len(peer.take([(jobs["a"].entry, Job(id="a", prompt="p"))])[0]) == 1
    assert _step(publisher, jobs) == {"a": pub.FENCED, "b": pub.OK}
    assert _indices(client, "a") == [0, 1] and _indices(client, "b") == [0, 1, 2]


@pytest.mark.parametrize("lost", ["deleted", "older copy"])
def test_a_lease_redis_no_longer_holds_checks_every_job(client: redis.Redis, lost: str) -> None:
    """Redis lost the lease (expired, flushed) or holds another value (restarted from an older
    copy, a failover that dropped writes): a job whose owner hash vanished meanwhile ends with
    lost_state, as it would have without the lease."""
    intake, publisher = _worker(client, "w")
    jobs = _running(client, intake, "ab")
    _step(publisher, jobs)
    _step(publisher, jobs)
    client.delete(KEYS.owner("a"))
    if lost == "deleted":
        client.delete(KEYS.lease("w/1"))
    else:
        client.set(KEYS.lease("w/1"), "0")
    assert _step(publisher, jobs) == {"a": pub.LOST_STATE, "b": pub.OK}
    last = parse_event(client.xrange(KEYS.out("a"))[-1][1])
    assert isinstance(last, ErrorEvent) and last.code == LOST_STATE
    assert _step(publisher, jobs, "b") == {"b": pub.OK}
    assert _indices(client, "b") == [0, 1, 2, 3]


def test_an_unchanged_lease_trusts_even_a_vanished_owner_hash(client: redis.Redis) -> None:
    """The limit of the lease, stated: what only a hand-run DEL of one job's keys changes (the
    lease and every other key kept) is seen at the job's end, not at its next step."""
    intake, publisher = _worker(client, "w")
    jobs = _running(client, intake, "a")
    _step(publisher, jobs)
    client.delete(KEYS.owner("a"))
    assert _step(publisher, jobs) == {"a": pub.OK}


def test_a_resend_is_checked_and_written_once(client: redis.Redis) -> None:
    """A reply lost on the way back: the worker resends what it had (token 1) with what came
    since (token 2). The resend is not trusted: the script skips token 1 and writes token 2."""
    intake, publisher = _worker(client, "w")
    jobs = _running(client, intake, "a")
    _step(publisher, jobs)
    _step(publisher, jobs)
    job = jobs["a"]
    job.add_tokens(2, [66], "B")
    assert publisher.flush([job], []).status == {"a": pub.OK}
    job.add_tokens(3, [67], "C")  # the outbox still holds token 2: its reply was "lost"
    assert publisher.flush([job], []).status == {"a": pub.OK}
    assert _indices(client, "a") == [0, 1, 2, 3]


def test_the_output_ttl_is_renewed_at_most_every_refresh_s_and_set_at_the_end(
        client: redis.Redis) -> None:
    intake, publisher = _worker(client, "w")
    jobs = _running(client, intake, "a")
    ttl = CONFIG.result_ttl_of(jobs["a"].job)
    _step(publisher, jobs)
    assert ttl < client.ttl(KEYS.out("a")) <= ttl + REFRESH_S  # outlives its last event by ttl
    client.config_resetstat()
    for _ in range(3):
        _step(publisher, jobs)
    assert "expire" not in _counts(client)
    jobs["a"].outbox.append(DoneEvent(finish_reason="stop", text="AAAA", prompt_tokens=1,
                                      completion_tokens=4))
    assert publisher.flush([jobs["a"]], []).status == {"a": pub.DONE}
    assert 0 < client.ttl(KEYS.out("a")) <= ttl
    assert not client.exists(KEYS.owner("a"))
    assert client.xpending(KEYS.jobs, "workers")["pending"] == 0
