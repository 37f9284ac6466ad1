"""Hostile entries and Redis faults against a real redis-server and the worker: an entry costs
exactly itself, never the worker nor the jobs beside it.

- dead letters of a 5,000-field entry and of 40 MiB values: written, bounded, `qw:dead` small;
- a foreign key of the wrong type on one job's output stream or owner hash (before it starts, and
  while it runs in a batch with others), and an ACL that denies one job's keys: that job fails
  alone, with a dead letter; the worker and the innocent jobs go on;
- an ACL that denies the job stream: `qworker serve` exits 2 with one clear line;
- reclaim finds a dead worker's entries behind 1,000 live pending ones in a few calls, claims only
  what fits, and bumps no other delivery count; dead consumers that own nothing are removed;
- a job past its deadline expires only if it never started.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from qworker.commands import serve
from qworker.service.config import ServiceConfig
from qworker.service.errors import CannotWork
from qworker.service.intake import MAX_DEAD_FIELDS, MAX_DEAD_VALUE_BYTES, Intake
from qworker.service.scripts import Scripts
from qworker_client.protocol import DoneEvent, ErrorEvent, Keys
from tests.service_harness import (
    KEYS,
    check_stream,
    events,
    expected,
    group_pending,
    sim_engine,
    spawn_worker,
    stop_process,
    terminal,
    thread_worker,
    wait_for,
    wait_terminal,
)

MiB = 1 << 20


def _dead_by_source(client: redis.Redis) -> dict[str, dict[bytes, bytes]]:
    return {f[b"source_id"].decode(): f for _, f in client.xrange(KEYS.dead)}


def test_huge_entries_are_dead_lettered_bounded_and_the_worker_goes_on(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    wide = {b"id": b"wide", b"prompt": b"x", **{f"f{k}".encode(): b"v" for k in range(5_000)}}
    hostile = [("wide", client.xadd(KEYS.jobs, wide).decode())]
    for k in range(3):
        entry = {b"id": f"big{k}".encode(), b"prompt": b"p" * (40 * MiB)}
        hostile.append((f"big{k}", client.xadd(KEYS.jobs, entry).decode()))
    nameless = client.xadd(KEYS.jobs, {f"g{k}".encode(): b"w" * 100 for k in range(5_000)})
    innocent = {f"ok{k}": {"prompt": f"fine {k}", "max_tokens": 5} for k in range(4)}
    for job_id, fields in innocent.items():
        client.xadd(KEYS.jobs, {"id": job_id, **{k: str(v) for k, v in fields.items()}})
    with thread_worker(redis_url, "hostile", sim_engine("sim:step_ms=1")) as w:
        wait_terminal(client, [*innocent, *(name for name, _ in hostile)])
        wait_for(lambda: client.xlen(KEYS.dead) == 5, what="5 dead letters")
        assert w.thread.is_alive()
        assert w.stop() == 0
    want = expected(innocent)
    for job_id in innocent:
        assert (check_stream(client, job_id).text, "length") == want[job_id]
    dead = _dead_by_source(client)
    for name, _ in hostile:
        event = terminal(client, name)
        assert isinstance(event, ErrorEvent) and event.code == "invalid_request", name
    wide_dead = dead[hostile[0][1]]
    assert int(wide_dead[b"dropped_fields"]) == len(wide) - MAX_DEAD_FIELDS
    assert len(wide_dead) <= MAX_DEAD_FIELDS + 10
    for _, entry_id in hostile[1:]:
        big = dead[entry_id]
        assert big[b"prompt"] == b"p" * MAX_DEAD_VALUE_BYTES
        assert big[b"prompt_truncated_bytes"] == str(40 * MiB).encode()
    assert int(dead[nameless.decode()][b"dropped_fields"]) == 5_000 - MAX_DEAD_FIELDS
    assert group_pending(client) == 0 and client.xlen(KEYS.jobs) == 0
    assert client.memory_usage(KEYS.dead) < 512 * 1024  # 3 x 40 MiB in, a few KiB each kept
    print(f"FIGURES huge: entries={len(hostile) + 1 + len(innocent)} lost=0 exits=0")


def test_dead_stream_is_trimmed_to_about_its_maxlen(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    for k in range(400):
        client.xadd(KEYS.jobs, {"id": f"bad{k}", "prompt": "x", "top_p": "7"})
    with thread_worker(redis_url, "trim", sim_engine("sim:step_ms=1"), dead_maxlen=100) as w:
        wait_for(lambda: group_pending(client) == 0 and client.xlen(KEYS.jobs) == 0,
                 what="all bad entries handled")
        assert w.stop() == 0
    assert 100 <= client.xlen(KEYS.dead) < 250  # `MAXLEN ~`: whole nodes go, so a bit more
    assert all(isinstance(terminal(client, f"bad{k}"), ErrorEvent) for k in range(400))


def test_a_foreign_key_fails_only_its_job(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    client.set(KEYS.out("clash-out"), "not a stream")
    client.set(KEYS.owner("clash-owner"), "not a hash")
    innocent = {f"ok{k}": {"prompt": f"innocent {k}", "max_tokens": 40} for k in range(4)}
    with thread_worker(redis_url, "clash", sim_engine("sim:step_ms=5")) as w:
        client.xadd(KEYS.jobs, {"id": "clash-out", "prompt": "a"})
        client.xadd(KEYS.jobs, {"id": "clash-owner", "prompt": "b"})
        client.xadd(KEYS.jobs, {"id": "midway", "prompt": "c", "max_tokens": "200"})
        for job_id, fields in innocent.items():
            client.xadd(KEYS.jobs, {"id": job_id, **{k: str(v) for k, v in fields.items()}})
        # while "midway" runs in one batch (one append call) with the innocent ones, its
        # stream is replaced by a foreign key of the wrong type
        wait_for(lambda: client.xlen(KEYS.out("midway")) >= 3, what="midway streams")
        client.set(KEYS.out("midway"), "hijacked")  # replaces the stream in one step
        wait_terminal(client, innocent)
        wait_for(lambda: client.xlen(KEYS.dead) >= 3, what="3 dead letters")
        assert w.thread.is_alive()
        assert w.worker.metrics.redis_job_errors._value.get() == 3
        assert w.stop() == 0
    want = expected(innocent)
    for job_id in innocent:
        assert (check_stream(client, job_id).text, "length") == want[job_id]
    assert client.get(KEYS.out("clash-out")) == b"not a stream"  # never overwritten
    assert client.get(KEYS.out("midway")) == b"hijacked"
    owner_event = terminal(client, "clash-owner")  # its stream was fine: it has the error
    assert isinstance(owner_event, ErrorEvent) and owner_event.code == "internal"
    assert "WRONGTYPE" in owner_event.message
    dead = [f[b"id"] for _, f in client.xrange(KEYS.dead)]
    assert sorted(dead) == [b"clash-out", b"clash-owner", b"midway"], dead
    reasons = {f[b"id"]: f[b"reason"] for _, f in client.xrange(KEYS.dead)}
    assert all(b"WRONGTYPE" in r for r in reasons.values())
    assert group_pending(client) == 0 and client.xlen(KEYS.jobs) == 0


@pytest.fixture
def acl(redis_url: str) -> Iterator[tuple[redis.Redis, str]]:
    client = redis.Redis.from_url(redis_url)
    yield client, redis_url
    for user in client.acl_users():
        if str(user).startswith("qwtest"):
            client.acl_deluser(user)


def _user_url(url: str, user: str) -> str:
    return url.replace("redis://", f"redis://{user}:pw@")


# every key a worker touches but the output streams (qw:*:*: its model's streams)
WORKER_KEYS = ["qw:jobs", "qw:requeue", "qw:jobs:*", "qw:requeue:*", "qw:dead", "qw:owner:*",
               "qw:worker:*", "qw:cancel:*",
               "qw:ready", "qw:ready:*", "qw:vtime", "qw:vtime:*", "qw:tenants",  # fair share
               "qw:held", "qw:held:*", "qw:tpm:*", "qw:running", "qw:usage:*",  # quotas, usage
               "qw:lease:*", "qw:takeovers",  # fencing once a step
               "qw:affinity", "qw:affinity:*", "qw:affinity_seen", "qw:affinity_seen:*",
               "qw:offers", "qw:readers"]  # prefix affinity


def test_an_acl_on_one_jobs_keys_fails_only_that_job(acl: tuple[redis.Redis, str]) -> None:
    client, url = acl
    keys = [*WORKER_KEYS, "qw:out:ok*"]  # not qw:out:*: the job "secret"'s stream is refused
    client.acl_setuser("qwtest-keys", enabled=True, passwords=["+pw"], commands=["+@all"],
                       keys=keys)
    innocent = {f"ok{k}": {"prompt": f"fine {k}", "max_tokens": 6} for k in range(3)}
    with thread_worker(_user_url(url, "qwtest-keys"), "acl", sim_engine("sim:step_ms=2")) as w:
        client.xadd(KEYS.jobs, {"id": "secret", "prompt": "x"})
        for job_id, fields in innocent.items():
            client.xadd(KEYS.jobs, {"id": job_id, **{k: str(v) for k, v in fields.items()}})
        wait_terminal(client, innocent)
        wait_for(lambda: client.xlen(KEYS.dead) == 1, what="a dead letter")
        assert w.thread.is_alive()
        assert w.stop() == 0
    for job_id in innocent:
        check_stream(client, job_id)
    dead = client.xrange(KEYS.dead)[0][1]
    assert dead[b"id"] == b"secret" and b"NoPermissionError" in dead[b"reason"]
    assert not client.exists(KEYS.out("secret"))
    assert group_pending(client) == 0


def _refused_at_start(url: str, name: str, tmp_path: Path) -> tuple[str, list[str]]:
    """A worker whose Redis user lacks a key it needs: exit 2, no traceback, one `cannot work`
    line naming Redis' NoPermissionError. Its log, and that line."""
    log = tmp_path / "worker.log"
    proc = spawn_worker(url, name, "--model", "sim", log_path=log)
    try:
        rc = proc.wait(60)
    finally:
        stop_process(proc)
    text = log.read_text()
    assert rc == 2 and "Traceback" not in text, text
    fatal = [line for line in text.splitlines() if "cannot work" in line]
    assert len(fatal) == 1 and "NoPermissionError" in fatal[0], text
    return text, fatal


def test_a_worker_denied_the_job_stream_exits_2_with_one_line(acl: tuple[redis.Redis, str],
                                                               tmp_path: Path) -> None:
    client, url = acl
    client.acl_setuser("qwtest-nojobs", enabled=True, passwords=["+pw"], commands=["+@all"],
                       keys=["qw:out:*", "qw:owner:*", "qw:worker:*", "qw:cancel:*"])
    text, fatal = _refused_at_start(_user_url(url, "qwtest-nojobs"), "denied", tmp_path)
    errors = [line for line in text.splitlines() if '"level": "error"' in line]
    assert errors == fatal


def test_a_worker_set_up_before_the_append_lease_exits_2_with_one_line(
        acl: tuple[redis.Redis, str], tmp_path: Path) -> None:
    """An ACL user made before `qw:lease:*` and `qw:takeovers` existed: the worker says so at
    start (exit 2) rather than failing every job's append."""
    client, url = acl
    keys = [k for k in WORKER_KEYS if not k.startswith(("qw:lease", "qw:takeovers"))]
    keys.append("qw:out:*")
    client.acl_setuser("qwtest-nolease", enabled=True, passwords=["+pw"], commands=["+@all"],
                       keys=keys)
    client.xadd(KEYS.jobs, {"id": "kept", "prompt": "x"})
    _refused_at_start(_user_url(url, "qwtest-nolease"), "old-acl", tmp_path)
    assert client.xlen(KEYS.dead) == 0 and client.xlen(KEYS.jobs) == 1  # the job waits


def test_a_worker_that_cannot_beat_exits_2(acl: tuple[redis.Redis, str]) -> None:
    client, url = acl
    # no qw:worker:*: its heartbeat is refused
    client.acl_setuser("qwtest-nobeat", enabled=True, passwords=["+pw"], commands=["+@all"],
                       keys=["qw:jobs", "qw:requeue", "qw:jobs:*", "qw:requeue:*", "qw:dead",
                             "qw:out:*", "qw:owner:*", "qw:cancel:*"])
    with thread_worker(_user_url(url, "qwtest-nobeat"), "nobeat", sim_engine()) as w:
        w.thread.join(15)
        assert not w.thread.is_alive() and w.result == [2]
    assert isinstance(w.worker.heartbeat.fatal, CannotWork)


def _seed_live_and_dead(client: redis.Redis, live: int, dead: int) -> tuple[list[str], list[str]]:
    for stream in KEYS.streams:  # every model-less band's (a worker creates them at start)
        client.xgroup_create(stream, "workers", id="0", mkstream=True)
    pipe = client.pipeline(transaction=False)
    for k in range(live):
        pipe.xadd(KEYS.jobs, {"id": f"live{k}", "prompt": "x"})
    for k in range(dead):
        pipe.xadd(KEYS.jobs, {"id": f"dead{k}", "prompt": "x"})
    ids = [i.decode() for i in pipe.execute()]
    for consumer, count in (("live-worker", live), ("dead-worker", dead)):
        if count:
            client.xreadgroup("workers", consumer, {KEYS.jobs: ">"}, count=count)
    return ids[:live], ids[live:]


def test_reclaim_finds_dead_entries_behind_a_thousand_live_ones(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    live, dead = _seed_live_and_dead(client, 1_000, 5)
    config = ServiceConfig(redis_url=redis_url, name="heir", claim_idle_ms=200)
    intake = Intake(client, Keys(), config, Scripts(), token="heir/1")
    time.sleep(0.3)
    client.xclaim(KEYS.jobs, "workers", "live-worker", 0, live, justid=True)  # its heartbeat
    found: list[str] = []
    calls = 0
    while len(found) < len(dead) and calls < 10:
        got = intake.reclaim(2, set())  # 2 free slots: claims at most 2 a call
        assert len(got) <= 2 and all(e.deliveries == 2 and e.reclaimed for e in got)
        found += [e.entry_id for e in got]
        calls += 1
    assert sorted(found) == sorted(dead) and calls <= 4, calls
    pending = client.xpending_range(KEYS.jobs, "workers", "-", "+", 2_000)
    by_id = {r["message_id"].decode(): r for r in pending}
    assert all(by_id[i]["consumer"] == b"live-worker" and by_id[i]["times_delivered"] == 1
               for i in live)
    assert all(by_id[i]["consumer"] == b"heir" for i in dead)
    print(f"FIGURES reclaim: live_pending=1000 dead=5 calls={calls}")


def test_reclaim_leaves_what_does_not_fit_untouched(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    _, dead = _seed_live_and_dead(client, 0, 6)
    config = ServiceConfig(redis_url=redis_url, name="heir", claim_idle_ms=100)
    intake = Intake(client, Keys(), config, Scripts(), token="heir/1")
    time.sleep(0.15)
    assert [e.entry_id for e in intake.reclaim(1, set())] == dead[:1]
    rows = client.xpending_range(KEYS.jobs, "workers", "-", "+", 10)
    assert [(r["consumer"], r["times_delivered"]) for r in rows[1:]] == [(b"dead-worker", 1)] * 5
    assert [e.entry_id for e in intake.reclaim(2, set())] == dead[1:3]  # cursor moved on
    assert [e.entry_id for e in intake.reclaim(9, {dead[3]})] == dead[4:]  # skipped: ours


def test_dead_consumers_that_own_nothing_are_removed(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    _seed_live_and_dead(client, 0, 1)  # "dead-worker" holds one entry: kept
    for name in ("ghost", "alive-idle"):
        client.xgroup_createconsumer(KEYS.jobs, "workers", name)
    client.set(KEYS.worker("alive-idle"), "{}")
    config = ServiceConfig(redis_url=redis_url, name="janitor", claim_idle_ms=100)
    intake = Intake(client, Keys(), config, Scripts(), token="janitor/1")
    Scripts.load(client)
    assert intake.drop_dead_consumers() == 0  # not idle long enough yet
    time.sleep(config.consumer_idle_ms / 1000 + 0.1)
    assert intake.drop_dead_consumers() == 1
    names = {c["name"] for c in client.xinfo_consumers(KEYS.jobs, "workers")}
    assert names == {b"dead-worker", b"alive-idle"}


def test_only_jobs_that_never_started_expire(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    past = "1000"
    # drained from a stopping worker: in the requeue stream, two tokens already shown
    client.xadd(KEYS.out("drained"), {"type": "token", "i": "0", "token_id": "104", "text": "h"})
    client.xadd(KEYS.out("drained"), {"type": "token", "i": "1", "token_id": "105", "text": "i"})
    client.hset(KEYS.owner("drained"), mapping={"worker": "", "t0": "1", "started": "2"})
    client.xadd(KEYS.requeue, {"id": "drained", "prompt": "p", "max_tokens": "5",
                               "deadline_ms": past})
    # reclaimed from a dead worker that had started it but shown nothing yet
    client.hset(KEYS.owner("reclaimed"), mapping={"worker": "gone/1", "t0": "1", "started": "2"})
    client.xadd(KEYS.jobs, {"id": "reclaimed", "prompt": "p", "max_tokens": "4",
                            "deadline_ms": past})
    client.xadd(KEYS.jobs, {"id": "late", "prompt": "p", "deadline_ms": past})
    with thread_worker(redis_url, "deadline", sim_engine("sim:step_ms=1")) as w:
        got = wait_terminal(client, ["drained", "reclaimed", "late"])
        assert w.stop() == 0
    assert isinstance(got["drained"], DoneEvent) and got["drained"].completion_tokens == 5
    assert [e.i for e in events(client, "drained")[:-1]] == [0, 1, 2, 3, 4]
    assert isinstance(got["reclaimed"], DoneEvent)
    check_stream(client, "reclaimed")
    assert isinstance(got["late"], ErrorEvent) and got["late"].code == "expired"
    assert [f[b"id"] for _, f in client.xrange(KEYS.dead)] == [b"late"]


def test_serve_has_the_new_flags() -> None:
    parser = argparse.ArgumentParser()
    serve.add_flags(parser)
    args = parser.parse_args(["--redis-url", "redis://x", "--model", "sim", "--dead-maxlen", "50",
                              "--stall-timeout", "9"])
    assert (args.dead_maxlen, args.stall_timeout) == (50, 9.0)
    defaults = parser.parse_args(["--redis-url", "redis://x", "--model", "sim"])
    assert defaults.dead_maxlen == ServiceConfig.dead_maxlen == 10_000
    assert defaults.stall_timeout == ServiceConfig.stall_timeout_s


def test_error_replies_are_sorted_by_scope() -> None:
    from qworker.service.errors import job_error

    E = redis.exceptions  # noqa: N806
    assert job_error([b"ok", 3]) is None
    assert "WRONGTYPE" in str(job_error(E.ResponseError("WRONGTYPE Operation against a key")))
    assert "NoPermissionError" in str(job_error(E.NoPermissionError("no permissions to a key")))
    assert job_error(E.ResponseError("ERR Error running script: unpack")) is not None
    for fatal in (E.ResponseError("CROSSSLOT Keys in request don't hash to the same slot"),
                  E.ResponseError("ERR unknown command 'XAUTOCLAIM'"),
                  E.MovedError("3999 127.0.0.1:6381"), E.AskError("3999 127.0.0.1:6381")):
        with pytest.raises(CannotWork):
            job_error(fatal)
    for not_the_jobs in (E.NoScriptError("NOSCRIPT"), E.BusyLoadingError("LOADING"),
                         E.ResponseError("MISCONF no disk"), E.ResponseError("NOGROUP gone"),
                         E.ReadOnlyError("READONLY replica")):
        with pytest.raises(type(not_the_jobs)):
            job_error(not_the_jobs)


def test_hostile_mix_costs_exactly_the_hostile_entries(redis_url: str) -> None:
    """Hundreds of hostile entries of every kind, between innocent jobs, to one worker."""
    from tests.test_service_bad_jobs import BAD, BAD_IDS

    client = redis.Redis.from_url(redis_url)
    with_event: list[str] = []  # hostile jobs with a usable id: they get an error event
    hostile = 0

    def add(fields: dict[bytes, bytes], job_id: str | None) -> None:
        nonlocal hostile
        client.xadd(KEYS.jobs, fields)
        hostile += 1
        if job_id:
            with_event.append(job_id)

    innocent: dict[str, dict[str, object]] = {}
    for copy in range(5):
        for name, fields, _ in BAD:
            add({b"id": f"{name}.{copy}".encode(), **fields}, f"{name}.{copy}")
        for _, fields in BAD_IDS:
            add(fields, None)
        for k in range(4):
            add({b"id": f"nl{copy}-{k}\n".encode(), b"prompt": b"x"}, None)  # id with newline
            add({b"id": f"vocab{copy}-{k}".encode(), b"prompt_token_ids": b"[99999999]"},
                f"vocab{copy}-{k}")
            foreign = f"foreign{copy}-{k}"
            client.set(KEYS.out(foreign), "x")
            add({b"id": foreign.encode(), b"prompt": b"x"}, None)  # only a dead letter
            add({b"id": f"wide{copy}-{k}".encode(),
                 **{f"w{j}".encode(): b"1" for j in range(500)}}, f"wide{copy}-{k}")
        innocent.update({f"ok{copy}-{k}": {"prompt": f"innocent {copy} {k}", "max_tokens": 8}
                         for k in range(10)})
        _submit_jobs(client, {k: v for k, v in innocent.items() if k.startswith(f"ok{copy}-")})
    add({b"id": b"huge", b"prompt": b"h" * (40 * MiB)}, "huge")
    engine = sim_engine("sim:step_ms=1,max_model_len=256")  # as the table of bad jobs wants
    with thread_worker(redis_url, "mix", engine) as w:
        wait_terminal(client, [*innocent, *with_event], timeout=120)
        wait_for(lambda: client.xlen(KEYS.dead) >= hostile, what=f"{hostile} dead letters")
        assert w.thread.is_alive()
        assert w.stop() == 0
    want = expected(innocent)
    for job_id in innocent:
        assert (check_stream(client, job_id).text, "length") == want[job_id], job_id
    assert all(isinstance(terminal(client, j), ErrorEvent) for j in with_event)
    assert client.xlen(KEYS.dead) == hostile
    assert group_pending(client) == 0 and client.xlen(KEYS.jobs) == 0
    assert client.memory_usage(KEYS.dead) < 4 * MiB
    print(f"FIGURES hostile-mix: entries={hostile + len(innocent)} hostile={hostile} "
          f"innocent={len(innocent)} lost=0 exits=0 dead={client.xlen(KEYS.dead)}")


def _submit_jobs(client: redis.Redis, jobs: dict[str, dict[str, object]]) -> None:
    for job_id, fields in jobs.items():
        client.xadd(KEYS.jobs, {"id": job_id, **{k: str(v) for k, v in fields.items()}})
