"""The server-side scripts against a real Redis: a worker that lost a job cannot write to it, a
retried write is not doubled, requeue and dead-letter happen once."""

from __future__ import annotations

import fakeredis
import pytest
import redis

from qworker.service import publisher as pub
from qworker.service.config import ServiceConfig
from qworker.service.event_fields import event_fields
from qworker.service.intake import Intake, Reject
from qworker.service.job import ActiveJob
from qworker.service.publisher import Publisher
from qworker.service.scripts import Scripts
from qworker_client.protocol import (
    LOST_STATE,
    DoneEvent,
    ErrorEvent,
    Job,
    Keys,
    TokenEvent,
    TopLogprob,
    parse_event,
)

KEYS = Keys()


@pytest.fixture
def client(redis_url: str) -> redis.Redis:
    c = redis.Redis.from_url(redis_url)
    c.xgroup_create(KEYS.jobs, "workers", id="0", mkstream=True)
    c.xgroup_create(KEYS.requeue, "workers", id="0", mkstream=True)
    return c


def _take(client: redis.Redis, name: str) -> tuple[Intake, Publisher]:
    config = ServiceConfig(redis_url="-", name=name)
    token = f"{name}/1"
    return (Intake(client, KEYS, config, Scripts(), token),
            Publisher(client, KEYS, config, Scripts(), token))


def _job(client: redis.Redis, intake: Intake) -> ActiveJob:
    entry = intake.read(1, None)[0]
    taken = intake.take([(entry, Job(id="j", prompt="p"))])[0][0]
    return ActiveJob(taken.job, entry, log=None, t0_ms=taken.t0_ms, started_ms=taken.started_ms,
                     next_index=len(taken.readback.token_ids), text=taken.readback.text)


def _tokens(client: redis.Redis) -> list[int]:
    return [e.i for _, f in client.xrange(KEYS.out("j"))
            if isinstance(e := parse_event(f), TokenEvent)]


def test_zombie_cannot_write_and_retries_are_not_doubled(client: redis.Redis) -> None:
    Scripts.load(client)
    client.xadd(KEYS.jobs, {"id": "j", "prompt": "p"})
    zombie_intake, zombie = _take(client, "zombie")
    zjob = _job(client, zombie_intake)
    zjob.add_tokens(0, [65, 66], "AB")
    assert zombie.flush([zjob], []).status == {"j": pub.OK}
    assert zombie.flush([zjob], []).status == {"j": pub.OK}  # a retry: skipped, not doubled
    assert _tokens(client) == [0, 1]

    # another worker takes the job over (as after XAUTOCLAIM) and continues after token 1
    client.xclaim(KEYS.jobs, "workers", "heir", 0, [zjob.entry.entry_id])
    heir_intake, heir = _take(client, "heir")
    taken = heir_intake.take([(zjob.entry, zjob.job)])[0][0]
    assert taken.readback.token_ids == [65, 66] and taken.readback.text == "AB"
    hjob = ActiveJob(taken.job, zjob.entry, None, 0, 0, next_index=2, text="AB")

    zjob.outbox.clear()
    zjob.add_tokens(2, [67], "C")
    assert zombie.flush([zjob], []).status == {"j": pub.FENCED}
    hjob.add_tokens(3, [68], "D")
    assert heir.flush([hjob], []).status == {"j": pub.GAP}  # index 2 is missing
    hjob = ActiveJob(taken.job, zjob.entry, None, 0, 0, next_index=2, text="AB")  # as retaken
    hjob.add_tokens(2, [67, 68], "CD")
    hjob.finish("length", 4)
    assert heir.flush([hjob], []).status == {"j": pub.DONE}
    assert heir.flush([hjob], []).status == {"j": pub.TERMINAL}
    assert _tokens(client) == [0, 1, 2, 3]
    last = parse_event(client.xrange(KEYS.out("j"))[-1][1])
    assert isinstance(last, DoneEvent) and last.text == "ABCD"
    assert client.xpending(KEYS.jobs, "workers")["pending"] == 0
    assert not client.exists(KEYS.owner("j")) and client.xlen(KEYS.jobs) == 0
    assert client.ttl(KEYS.out("j")) > 0


def test_requeue_happens_once_and_only_for_the_owner(client: redis.Redis) -> None:
    Scripts.load(client)
    client.xadd(KEYS.jobs, {"prompt": "p", "max_tokens": "3"})
    intake, publisher = _take(client, "w")
    entry = intake.read(1, None)[0]
    job_id = entry.entry_id
    intake.take([(entry, Job(id=job_id, prompt="p", max_tokens=3))])
    job = ActiveJob(Job(id=job_id, prompt="p"), entry, None, 0, 0, requeue=True)
    _, other = _take(client, "other")
    assert other.flush([job], []).status == {job_id: pub.FENCED}  # nothing written
    assert client.xlen(KEYS.requeue) == 0
    assert publisher.flush([job], []).status == {job_id: pub.REQUEUED}
    assert publisher.flush([job], []).status == {job_id: pub.REQUEUED}  # a retry
    requeued = client.xrange(KEYS.requeue)
    assert len(requeued) == 1
    assert requeued[0][1] == {b"prompt": b"p", b"max_tokens": b"3", b"id": job_id.encode()}
    assert client.xpending(KEYS.jobs, "workers")["pending"] == 0


def test_dead_letter_happens_once(client: redis.Redis) -> None:
    Scripts.load(client)
    client.xadd(KEYS.jobs, {"id": "j", "prompt": "p", "top_p": "7"})
    intake, _ = _take(client, "w")
    entry = intake.read(1, None)[0]
    reject = Reject(entry, "invalid_request", "top_p too big", "j")
    intake.dead_letter([reject])
    intake.dead_letter([reject])  # a retry after a lost reply
    assert client.xlen(KEYS.dead) == 1 and client.xlen(KEYS.out("j")) == 1
    event = parse_event(client.xrange(KEYS.out("j"))[0][1])
    assert isinstance(event, ErrorEvent) and event.message == "top_p too big"


def test_scripts_reload_after_the_cache_is_flushed(client: redis.Redis) -> None:
    client.xadd(KEYS.jobs, {"id": "j", "prompt": "p"})
    intake, publisher = _take(client, "w")
    job = _job(client, intake)
    client.script_flush()
    job.add_tokens(0, [70], "F")
    assert publisher.flush([job], []).status == {"j": pub.OK}


ODD_TEXTS = ['say "hi" \\ /', "\x00nul\ttab\r\n\x1f", "é 漢字 🙂", "\u2028\u2029", "", "\ufffd"]


@pytest.mark.parametrize("server", ["redis-server", "fakeredis"])
def test_events_reach_the_stream_byte_for_byte(server: str, redis_url: str) -> None:
    """The append script gets every job's events as one JSON argument: quotes, backslashes,
    control characters, NUL and 4-byte UTF-8 come out of it as they went in, field by field in
    order, on redis-server and on the embedded server (`qworker up --embedded`)."""
    c = redis.Redis.from_url(redis_url) if server == "redis-server" else fakeredis.FakeRedis()
    c.flushdb()
    c.xgroup_create(KEYS.jobs, "workers", id="0", mkstream=True)
    Scripts.load(c)
    c.xadd(KEYS.jobs, {"id": "j", "prompt": "p"})
    intake, publisher = _take(c, "w")
    job = _job(c, intake)
    for i, text in enumerate(ODD_TEXTS):
        top = [TopLogprob(token_id=7, logprob=-0.5, token=text)]
        job.outbox.append(TokenEvent(i=i, token_id=100 + i, text=text, logprob=-0.25,
                                     top_logprobs=top, token=text))
    job.finish("length", len(ODD_TEXTS))
    sent = list(job.outbox)
    assert publisher.flush([job], []).status == {"j": pub.DONE}
    stored = [list(fields.items()) for _, fields in c.xrange(KEYS.out("j"))]
    assert stored == [[(k.encode(), v.encode()) for k, v in event_fields(e).items()] for e in sent]
    tokens = [parse_event(fields) for _, fields in c.xrange(KEYS.out("j"))][:-1]
    assert [(t.text, t.token) for t in tokens] == [(x, x) for x in ODD_TEXTS]  # type: ignore


def test_a_job_whose_owner_hash_vanished_ends_with_lost_state_once(client: redis.Redis) -> None:
    """`fenced` and `lost_state` are told apart: another worker's token in the owner hash fences
    us out and nothing is written; no owner hash at all (Redis forgot the job) ends the job with
    the lost_state event, once, for the append and the requeue script alike, and never after a
    terminal event."""
    Scripts.load(client)
    for job_id in ("a", "r", "t"):
        client.xadd(KEYS.jobs, {"id": job_id, "prompt": "p"})
    intake, publisher = _take(client, "w")
    entries = intake.read(3, None)
    items = [(e, Job(id=i, prompt="p")) for e, i in zip(entries, "art", strict=True)]
    taken, _ = intake.take(items)
    jobs = {t.job.id: ActiveJob(t.job, t.entry, None, 0, 0) for t in taken}
    for job in jobs.values():
        job.add_tokens(0, [65], "A")
    assert publisher.flush(list(jobs.values()), []).status == dict.fromkeys("art", pub.OK)
    client.hset(KEYS.owner("a"), "worker", "peer/1")
    jobs["a"].add_tokens(1, [66], "B")
    assert publisher.flush([jobs["a"]], []).status == {"a": pub.FENCED}
    assert client.xlen(KEYS.out("a")) == 1
    client.delete(KEYS.owner("a"), KEYS.owner("r"), KEYS.owner("t"))
    jobs["r"].outbox.clear()
    jobs["r"].requeue = True
    client.xadd(KEYS.out("t"), {"type": "done", "finish_reason": "stop", "text": "A",
                                "prompt_tokens": "1", "completion_tokens": "1"})
    jobs["t"].requeue = True
    ended = {"a": pub.LOST_STATE, "r": pub.LOST_STATE, "t": pub.TERMINAL}
    assert publisher.flush(list(jobs.values()), []).status == ended
    # a retry after a lost reply finds them ended: nothing more is written
    assert publisher.flush(list(jobs.values()), []).status == dict.fromkeys("art", pub.TERMINAL)
    for job_id in "ar":
        last = parse_event(client.xrange(KEYS.out(job_id))[-1][1])
        assert isinstance(last, ErrorEvent) and last.code == LOST_STATE, job_id
        assert client.xlen(KEYS.out(job_id)) == 2 and client.ttl(KEYS.out(job_id)) > 0
    assert isinstance(parse_event(client.xrange(KEYS.out("t"))[-1][1]), DoneEvent)
    assert client.xlen(KEYS.requeue) == 0 and client.xpending(KEYS.jobs, "workers")["pending"] == 0


def test_a_late_take_of_an_entry_a_peer_reclaimed_is_refused(client: redis.Redis) -> None:
    """A worker that reads an entry and takes it late (its heartbeat did not keep it, say) finds
    it pending to a peer that reclaimed it meanwhile: it does not become the owner, so the job
    never runs on both."""
    Scripts.load(client)
    client.xadd(KEYS.jobs, {"id": "j", "prompt": "p"})
    late, _ = _take(client, "late")
    entry = late.read(1, None)[0]
    client.xclaim(KEYS.jobs, "workers", "peer", 0, [entry.entry_id])
    peer, _ = _take(client, "peer")
    assert len(peer.take([(entry, Job(id="j", prompt="p"))])[0]) == 1
    assert late.take([(entry, Job(id="j", prompt="p"))]) == ([], [])
    assert client.hget(KEYS.owner("j"), "worker") == b"peer/1"
