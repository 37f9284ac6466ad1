"""The ACL users of docs/operating.md, word for word, on a Redis with `requirepass`: a worker, a
producer (and `qworker batch`), a gateway and `qworker stats` do their work as them with no
command refused, each user is refused every command that could hurt (and nothing changes), and
what a producer may still write never takes a worker down."""

from __future__ import annotations

import json
import os
import re
import shlex
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
import pytest
import redis
import uvicorn

from qworker_client import JobError, Producer
from qworker_client.acl import ROLES, main, roles
from qworker_client.batch import run_batch
from qworker_client.cli import main as cli_main
from qworker_client.dashboard.app import create_dashboard
from qworker_client.local_redis import RedisProcess, free_port
from qworker_client.protocol import Keys
from tests.gateway_harness import gateway
from tests.service_harness import sim_engine, thread_worker, wait_for
from tests.test_gateway_batch import chat_line, jsonl

OPERATING = Path(__file__).resolve().parents[1] / "docs" / "operating.md"
KEYS = Keys("qw")
USERS = {role: f"qworker-{role}" for role in ROLES}


def acl_rules() -> dict[str, list[str]]:
    """The `ACL SETUSER` lines of operating.md, by role, as command words; they are what
    `python -m qworker_client.acl` prints for the prefix `qw`."""
    lines = re.findall(r"^ACL SETUSER .+$", OPERATING.read_text(), re.M)
    expected = [role.setuser(f"{name.upper()}_PASSWORD") for name, role in roles("qw").items()]
    assert lines == expected, "docs/operating.md: run `python -m qworker_client.acl`"
    return {name: shlex.split(line) for name, line in zip(ROLES, lines, strict=True)}


def test_the_lines_follow_the_prefix(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--prefix", "fleet2"])
    printed = capsys.readouterr().out.splitlines()
    assert [line.split()[2] for line in printed] == list(USERS.values())
    assert "qw:" not in "".join(printed) and "~fleet2:jobs " in printed[2]
    assert printed == [role.setuser(f"{name.upper()}_PASSWORD")
                       for name, role in roles("fleet2").items()]


@dataclass
class AclRedis:
    port: int
    admin_url: str
    admin: redis.Redis
    passwords: dict[str, str]

    def url(self, role: str) -> str:
        return f"redis://{USERS[role]}:{self.passwords[role]}@127.0.0.1:{self.port}/0"

    def client(self, role: str) -> redis.Redis:
        return redis.Redis.from_url(self.url(role), decode_responses=True)

    def refused(self) -> list[dict[str, object]]:
        return self.admin.acl_log()  # type: ignore[no-any-return]


@pytest.fixture
def acl_redis(tmp_path: Path) -> Iterator[AclRedis]:
    server = RedisProcess(tmp_path, ("--save", ""), password=os.urandom(8).hex())
    server.start()
    admin = redis.Redis.from_url(server.url, decode_responses=True)
    try:
        passwords = {role: os.urandom(8).hex() for role in ROLES}
        setinfo = tuple(int(v) for v in admin.info("server")["redis_version"].split(".")[:2])
        for role, words in acl_rules().items():
            words = [f">{passwords[role]}" if w.startswith(">") else w for w in words]
            if setinfo >= (7, 2):  # as the doc says for Redis 7.2 and later
                words.append("+client|setinfo")
            admin.execute_command(*words)
        admin.acl_log_reset()
        yield AclRedis(server.port, server.url, admin, passwords)
    finally:
        admin.close()
        server.stop()


def test_worker_and_producer_run_jobs_as_their_acl_users(acl_redis: AclRedis,
                                                         tmp_path: Path) -> None:
    acl_redis.admin.xgroup_create(KEYS.jobs, "workers", id="0", mkstream=True)
    acl_redis.admin.xgroup_createconsumer(KEYS.jobs, "workers", "ghost")  # a long-dead worker
    _died_with_a_job(acl_redis.admin, "orphan")  # to reclaim
    with thread_worker(acl_redis.url("worker"), "acl-1", claim_idle_ms=300,
                       drain_timeout=0.0, kv_events=True) as worker, \
            Producer(acl_redis.url("producer")) as prod:
        assert prod.job("orphan").result(timeout=30).usage.completion_tokens == 3
        result = prod.submit("hello acl", id="acl-job", max_tokens=8).result(timeout=30)
        assert (result.finish_reason, result.usage.completion_tokens) == ("length", 8)
        assert not prod.submit("hello acl", id="acl-job", max_tokens=8).new
        assert prod.status("acl-job").status == "done"
        prod.redis.xadd(KEYS.jobs, {"id": "bad-acl", "prompt": "x", "colour": "blue"})
        with pytest.raises(JobError, match="invalid_request"):  # dead-lettered by the worker
            prod.job("bad-acl").result(timeout=30)
        model_job = prod.submit("for sim", model="sim", priority=-1, max_tokens=4)
        assert model_job.result(timeout=30).usage.completion_tokens == 4
        cancelled = prod.submit("long", max_tokens=20000, ignore_eos=True)
        wait_for(lambda: acl_redis.admin.xlen(KEYS.out(cancelled.id)) >= 2, what="tokens")
        assert prod.status(cancelled.id).status == "running"
        assert cancelled.cancel()
        assert cancelled.result(timeout=30).finish_reason == "cancelled"
        source = tmp_path / "in.jsonl"
        source.write_text('{"custom_id": "a", "prompt": "batch", "max_tokens": 4}\n')
        summary = run_batch(source, tmp_path / "out.jsonl", redis_url=acl_redis.url("producer"))
        assert summary.succeeded == 1
        assert run_batch(source, tmp_path / "out.jsonl",  # a rerun: already answered
                         redis_url=acl_redis.url("producer")).skipped == 1
        wait_for(lambda: "ghost" not in _consumers(acl_redis.admin), 20,
                 what="the worker to remove the dead consumer")
        kept = prod.submit("requeued at stop", max_tokens=20000, ignore_eos=True)
        wait_for(lambda: acl_redis.admin.xlen(KEYS.out(kept.id)) >= 2, what="tokens")
        assert worker.stop() == 0
    assert acl_redis.admin.xlen(KEYS.requeue) == 1, "drained: its running job was requeued"
    assert acl_redis.admin.xlen(KEYS.kv_events) >= 2  # its first events and its exit's
    stats = Producer(acl_redis.url("keda")).stats()
    assert stats.requeue.length == 1 and stats.dead_letters == 1
    assert KEYS.jobs_of("sim", "high") in [s.key for s in stats.models]
    assert acl_redis.refused() == []


def _died_with_a_job(admin: redis.Redis, job_id: str) -> None:
    """A worker that took `job_id`, ran it alone and died."""
    admin.xadd(KEYS.jobs, {"id": job_id, "prompt": "left behind", "max_tokens": "3"})
    admin.xreadgroup("workers", "dead-1", {KEYS.jobs: ">"}, count=1)
    admin.hset(KEYS.owner(job_id), mapping={"worker": "dead-1/tok", "t0": "1"})
    admin.set(KEYS.alone("dead-1/tok"), job_id)


def _consumers(admin: redis.Redis) -> set[str]:
    return {c["name"] for c in admin.xinfo_consumers(KEYS.jobs, "workers")}


def test_a_gateway_serves_as_its_acl_user(acl_redis: AclRedis, tmp_path: Path) -> None:
    headers = {"authorization": "Bearer key-a"}
    chat = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}
    with thread_worker(acl_redis.url("worker"), "acl-gw", sim_engine("sim:step_ms=2")), \
            gateway(acl_redis.url("gateway"), api_keys=("key-a",), max_queued=100,
                    files_dir=str(tmp_path / "files")) as url, \
            httpx2.Client(base_url=url, headers=headers, timeout=30) as http:
        wait_for(lambda: http.get("/v1/models").json()["data"], what="the worker's model")
        reply = http.post("/v1/chat/completions", json=chat)
        assert reply.status_code == 200, reply.text
        with http.stream("POST", "/v1/completions", json={
                "model": "sim", "prompt": "go", "max_tokens": 8, "stream": True,
                "detach": True}) as streamed:
            job_id = streamed.headers["x-qworker-job-id"]
            assert "data: [DONE]" in streamed.read().decode()
        resumed = http.get(f"/v1/jobs/{job_id}/stream")
        assert resumed.status_code == 200 and resumed.text.endswith("data: [DONE]\n\n")
        assert http.get(f"/v1/jobs/{job_id}").json()["status"] == "done"
        assert http.get("/metrics").status_code == 200
        upload = http.post("/v1/files", data={"purpose": "batch"},
                           files={"file": ("in.jsonl", jsonl([chat_line("b1", "x")]))}).json()
        batch = http.post("/v1/batches", json={"input_file_id": upload["id"],
                                               "endpoint": "/v1/chat/completions"}).json()
        done = wait_for(lambda: _ended(http.get(f"/v1/batches/{batch['id']}").json()),
                        what="the batch")
        assert done["status"] == "completed" and done["request_counts"]["completed"] == 1
        response = http.post("/v1/responses", json={"model": "sim", "input": "hi",
                                                    "max_output_tokens": 4}).json()
        assert http.get(f"/v1/responses/{response['id']}").json()["status"] == "incomplete"
        assert http.delete(f"/v1/responses/{response['id']}").status_code == 200
    assert acl_redis.refused() == []


def test_an_operator_runs_its_verbs_as_its_acl_user(acl_redis: AclRedis,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """`qworker jobs | cancel | dead ...` as the operator user, nothing refused; a producer may
    not read, retry or purge dead letters (one line, exit 3)."""
    admin = acl_redis.admin
    admin.xgroup_create(KEYS.jobs, "workers", id="0", mkstream=True)
    entry = admin.xadd(KEYS.jobs, {"id": "unlucky", "prompt": "p", "max_tokens": "3"})
    admin.xreadgroup("workers", "ghost", {KEYS.jobs: ">"}, count=1)
    for _ in range(3):  # delivered 4 times: past --max-deliveries 3
        admin.xclaim(KEYS.jobs, "workers", "ghost", 0, [entry])
    admin.xadd(KEYS.dead, {"reason": "r", "code": "expired", "source": KEYS.jobs,
                           "source_id": "1-1", "worker": "w", "id": "old", "prompt": "p"})

    def run(role: str, *args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = cli_main([*args, "--redis-url", acl_redis.url(role)])
        out, err = capsys.readouterr()
        return code, out, err

    with thread_worker(acl_redis.url("worker"), "acl-op", claim_idle_ms=300,
                       max_deliveries=3) as worker:
        wait_for(lambda: admin.xlen(KEYS.dead) == 2, what="the poison job's dead letter")
        with Producer(acl_redis.url("producer")) as prod:
            long = prod.submit("long", max_tokens=20000, ignore_eos=True)
        wait_for(lambda: admin.xlen(KEYS.out(long.id)) >= 2, what="tokens")
        jobs = run("operator", "jobs", "--json")
        assert jobs[0] == 0 and f'"id": "{long.id}", "status": "running"' in jobs[1]
        assert run("operator", "dead", "list")[0] == 0
        assert "code: too_many_deliveries" in run("operator", "dead", "show", "unlucky")[1]
        assert run("operator", "dead", "retry", "unlucky")[0] == 0
        assert prod.job("unlucky").result(timeout=30).usage.completion_tokens == 3
        assert run("operator", "cancel", long.id)[0] == 0
        assert prod.job(long.id).result(timeout=30).finish_reason == "cancelled"
        assert worker.stop() == 0
    assert acl_redis.refused() == []
    for verb in (("dead", "list"), ("dead", "retry", "old"), ("dead", "purge", "--yes")):
        code, out, err = run("producer", *verb)
        assert (code, out) == (3, "") and err.count("\n") == 1 and "NoPermission" in err, verb
    acl_redis.admin.acl_log_reset()
    assert run("operator", "dead", "purge", "--yes")[1] == "purged 1 dead letter(s)\n"
    assert admin.xlen(KEYS.dead) == 0
    assert acl_redis.refused() == []


def test_the_dashboard_runs_as_the_operator_user(acl_redis: AclRedis) -> None:
    """`qworker dashboard` as the operator user: every page, a cancel and a retry, nothing
    refused."""
    admin = acl_redis.admin
    with thread_worker(acl_redis.url("worker"), "acl-dash", sim_engine("sim:step_ms=2")), \
            serve(create_dashboard(acl_redis.url("operator"))) as url, \
            httpx2.Client(base_url=url, timeout=30) as http:
        wait_for(lambda: admin.exists(KEYS.worker("acl-dash")), what="the worker's key")
        with Producer(acl_redis.url("producer")) as prod:
            long = prod.submit("long", max_tokens=20000, ignore_eos=True)
            admin.xadd(KEYS.jobs, {"id": "late", "prompt": "p", "deadline_ms": "1"})
            wait_for(lambda: admin.xlen(KEYS.dead) == 1, what="the late job's dead letter")
            wait_for(lambda: admin.xlen(KEYS.out(long.id)) >= 2, what="tokens")
            for path in ("/", "/workers", "/jobs", f"/jobs/{long.id}", "/jobs/late", "/dead"):
                assert http.get(path).status_code == 200, path
            token = re.search(r'name="csrf" value="([0-9a-f]+)"', http.get("/dead").text)
            assert token is not None
            entry = admin.xrange(KEYS.dead)[0][0]
            retried = http.post("/dead/retry", data={"entry": entry, "csrf": token.group(1)})
            assert "queued+again" in retried.headers["location"]
            assert http.post(f"/jobs/{long.id}/cancel", data={"csrf": token.group(1)}
                             ).status_code == 303
            assert prod.job(long.id).result(timeout=30).finish_reason == "cancelled"
    assert acl_redis.refused() == []


@contextmanager
def serve(app: Any) -> Iterator[str]:
    """`app` served by uvicorn in a thread on a free port: its base URL."""
    server = uvicorn.Server(uvicorn.Config(app, port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, what="the dashboard to start")
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(30)


def _ended(batch: dict[str, object]) -> dict[str, object] | None:
    return batch if batch["status"] in ("completed", "failed", "expired") else None


# ------------------------------------------------------------------------- what hurts

JOB = "victim"
FORGED_DONE = ("type", "done", "finish_reason", "stop", "text", "forged", "prompt_tokens", "1",
               "completion_tokens", "1")
WORKER_INFO = json.dumps({"name": "fake", "host": "h", "pid": 1, "model": "evil",
                          "group": "workers", "started_ms": 1})

# no role may do these
NOBODY = [
    ("FLUSHALL",), ("FLUSHDB",), ("CONFIG", "SET", "maxmemory", "1"), ("CONFIG", "GET", "*"),
    ("SCRIPT", "FLUSH"), ("SCRIPT", "KILL"), ("FUNCTION", "FLUSH"), ("KEYS", "*"),
    ("ACL", "SETUSER", "intruder", "on", "+@all", "~*"), ("ACL", "LIST"),
    ("CLIENT", "KILL", "TYPE", "normal"), ("SWAPDB", "0", "1"), ("SHUTDOWN", "NOSAVE"),
    ("SET", "other:key", "1"), ("GET", "other:key"), ("PUBLISH", "qw:c", "x"),
    ("SUBSCRIBE", "qw:c"),
    ("SET", KEYS.jobs, "x"), ("DEL", KEYS.jobs), ("UNLINK", KEYS.jobs),
    ("EXPIRE", KEYS.jobs, "0"), ("PEXPIRE", KEYS.jobs, "1"), ("RENAME", KEYS.jobs, "qw:x"),
    ("COPY", KEYS.jobs, "qw:x"), ("MOVE", KEYS.jobs, "1"), ("XTRIM", KEYS.jobs, "MAXLEN", "0"),
    ("XGROUP", "DESTROY", KEYS.jobs, "workers"), ("XGROUP", "SETID", KEYS.jobs, "workers", "$"),
    ("RESTORE", "qw:x", "0", "junk"), ("SET", KEYS.out(JOB), "x"),
    ("XTRIM", KEYS.out(JOB), "MAXLEN", "0"), ("DEL", KEYS.dead), ("XTRIM", KEYS.dead, "MAXLEN",
                                                                   "0"),
    ("SET", KEYS.requeue, "x"), ("DEL", KEYS.requeue),
]
# what workers do, and no other role
ONLY_WORKERS = [
    ("XADD", KEYS.out(JOB), "*", *FORGED_DONE), ("EXPIRE", KEYS.out(JOB), "0"),
    ("XADD", KEYS.requeue, "*", "id", JOB, "prompt", "x"), ("XADD", KEYS.dead, "*", "x", "y"),
    ("XDEL", KEYS.jobs, "1-1"), ("XACK", KEYS.jobs, "workers", "1-1"),
    ("XREADGROUP", "GROUP", "workers", "p", "STREAMS", KEYS.jobs, ">"),
    ("XCLAIM", KEYS.jobs, "workers", "p", "0", "1-1"),
    ("XGROUP", "CREATECONSUMER", KEYS.jobs, "workers", "p"),
    ("HSET", KEYS.owner(JOB), "worker", "forged"), ("DEL", KEYS.owner(JOB)),
    ("EXPIRE", KEYS.owner(JOB), "0"), ("SET", KEYS.worker("fake"), WORKER_INFO),
    ("DEL", KEYS.worker("w1")), ("SET", KEYS.alone("t"), JOB),
    ("ZADD", KEYS.delayed_of(None), "1", JOB), ("HSET", KEYS.delayed_jobs_of("sim"), JOB, "[]"),
]
# what producers do, and workers too: a worker queues delayed jobs again (the promoter)
ADD_JOBS = [("XADD", KEYS.jobs, "*", "id", "forged", "prompt", "x"),
            ("XADD", KEYS.jobs_of("sim"), "*", "prompt", "x")]
# what producers do, and workers may not
NOT_WORKERS = [
    ("SET", KEYS.cancel(JOB), "1"),
    ("SET", KEYS.submitted(JOB), "1-1"), ("HSET", KEYS.batch("b"), JOB, "1-1"),
    ("SET", KEYS.gateway_job(JOB), "{}"),
]
# what operators do (retry and purge dead letters), and no other role
ONLY_OPERATORS = [("DEL", KEYS.out(JOB)), ("XDEL", KEYS.dead, "1-1")]
# scripts bounded like the commands they run
SCRIPTS = [
    ("EVAL", "return redis.call('XADD', KEYS[1], '*', unpack(ARGV))", "1", KEYS.out(JOB),
     *FORGED_DONE),
    ("EVAL", "return redis.call('SET', KEYS[1], 'x')", "1", KEYS.jobs),
    ("EVAL", "return redis.call('EXPIRE', KEYS[1], 0)", "1", KEYS.jobs),
    ("EVAL", "return redis.call('DEL', KEYS[1])", "1", KEYS.out(JOB)),
    ("EVAL", "return redis.call('HSET', KEYS[1], 'worker', 'x')", "1", KEYS.owner(JOB)),
    ("EVAL", "return redis.call('SET', 'qw:worker:fake', 'x')", "0"),
    ("EVAL", "return redis.call('FLUSHALL')", "0"),
]
DELETES_OUTPUT = SCRIPTS[3]  # what the operator's retry script does, and only with it
assert DELETES_OUTPUT[1] == "return redis.call('DEL', KEYS[1])"
HARMFUL = {
    "worker": NOBODY + NOT_WORKERS + ONLY_OPERATORS + [("GET", KEYS.gateway_job(JOB)),
                                                       ("SCAN", "0")],
    "producer": NOBODY + ONLY_WORKERS + ONLY_OPERATORS + SCRIPTS + [
        ("SET", KEYS.gateway_job(JOB), "{}"), ("GET", KEYS.gateway_job(JOB)), ("SCAN", "0"),
        ("MGET", KEYS.worker("w1")), ("XRANGE", KEYS.dead, "-", "+"),
        ("XRANGE", KEYS.recent, "-", "+")],
    "gateway": NOBODY + ONLY_WORKERS + ONLY_OPERATORS + SCRIPTS + [
        ("XRANGE", KEYS.dead, "-", "+")],
    "keda": NOBODY + ONLY_WORKERS + NOT_WORKERS + ADD_JOBS + ONLY_OPERATORS + SCRIPTS + [
        ("XRANGE", KEYS.out(JOB), "-", "+"), ("XREAD", "STREAMS", KEYS.out(JOB), "0"),
        ("XRANGE", KEYS.jobs, "-", "+"), ("GET", KEYS.gateway_job(JOB)),
        ("EXISTS", KEYS.cancel(JOB))],
    "operator": NOBODY + ONLY_WORKERS + [s for s in SCRIPTS if s != DELETES_OUTPUT] + [
        ("SET", KEYS.gateway_job(JOB), "{}"), ("GET", KEYS.gateway_job(JOB)),
        ("DEL", KEYS.recent), ("XDEL", KEYS.jobs, "1-1"), ("DEL", KEYS.owner(JOB)),
        ("XADD", KEYS.recent, "*", "id", "forged", "status", "done")],
}


def _world(admin: redis.Redis) -> None:
    """A fleet's keys, each of its kind."""
    admin.xgroup_create(KEYS.jobs, "workers", id="0", mkstream=True)
    admin.xadd(KEYS.jobs, {"id": JOB, "prompt": "secret"})
    admin.xgroup_create(KEYS.requeue, "workers", id="0", mkstream=True)
    admin.xadd(KEYS.out(JOB), {"type": "token", "i": "0", "token_id": "5", "text": "a"})
    admin.hset(KEYS.owner(JOB), mapping={"worker": "w1/1", "t0": "1"})
    admin.set(KEYS.worker("w1"), WORKER_INFO.replace("fake", "w1"), ex=600)
    admin.xadd(KEYS.dead, {"reason": "r"})
    admin.set(KEYS.gateway_job(JOB), "{}")
    admin.set("other:key", "1")


def _snapshot(acl: AclRedis) -> dict[bytes, tuple[bytes, bool]]:
    """Every key's DUMP and whether it has a TTL."""
    with redis.Redis.from_url(acl.admin_url) as raw:
        return {key: (raw.dump(key), raw.pttl(key) > 0) for key in raw.keys("*")}


@pytest.mark.parametrize("role", ROLES)
def test_each_user_is_refused_what_could_hurt(acl_redis: AclRedis, role: str) -> None:
    _world(acl_redis.admin)
    before = _snapshot(acl_redis)
    client = acl_redis.client(role)
    allowed = []
    for command in HARMFUL[role]:
        try:
            client.execute_command(*command)
        except redis.ResponseError as exc:  # a NOPERM, or a script's command refused
            if not re.search(r"NOPERM|no permissions|can't access|can't run", str(exc)):
                allowed.append((command, str(exc)))
        else:
            allowed.append((command, "ran"))
    client.close()
    assert allowed == []
    assert _snapshot(acl_redis) == before
    assert len(acl_redis.refused()) >= 1


def test_what_a_producer_may_write_never_takes_a_worker_down(acl_redis: AclRedis) -> None:
    """The ACL cannot refuse an XADD its fields, its trimming or its id: workers screen entries."""
    hostile = [{"type": "done", "finish_reason": "stop", "text": "x", "prompt_tokens": "1",
                "completion_tokens": "1"},  # an event, not a job
               {"id": "h1", "prompt": "x", "max_tokens": "nan"},
               {"id": "h2", "messages": "[" * 100_000}, {"\xff": "\xfe"}]
    with thread_worker(acl_redis.url("worker"), "acl-h", sim_engine("sim:step_ms=2")) as worker, \
            Producer(acl_redis.url("producer")) as prod:
        wait_for(lambda: acl_redis.admin.exists(KEYS.worker("acl-h")), what="the worker")
        for fields in hostile:
            prod.redis.xadd(KEYS.jobs, fields)
        prod.redis.xadd(KEYS.jobs_of("sim"), {"id": "h3", "prompt": "x"}, maxlen=0)
        prod.redis.xadd(KEYS.jobs_of("sim", "low"), {"id": "h4", "prompt": "x", "priority": "1"},
                        id="18446744073709551615-18446744073709551615")
        wait_for(lambda: acl_redis.admin.xlen(KEYS.dead) == len(hostile), what="dead letters")
        assert prod.submit("still served", max_tokens=4).result(timeout=30).text
        assert worker.thread.is_alive()
        assert worker.stop() == 0
    assert acl_redis.admin.xrange(KEYS.out("h1"))[-1][1]["type"] == "error"
    assert acl_redis.refused() == []


def test_submit_as_a_producer_that_may_not_see_the_workers(acl_redis: AclRedis,
                                                          capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    """The producer role may not SCAN (it would show every key's name), so `qworker submit`
    cannot tell who is live: it submits as before, without a word, and the job runs."""
    with thread_worker(acl_redis.url("worker"), "acl-see"):
        code = cli_main(["submit", "hi", "--max-tokens", "3", "--json", "--redis-url",
                         acl_redis.url("producer")])
        out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    (result,) = [line for line in out.splitlines() if line.startswith('{"id"')]  # not the logs
    assert json.loads(result)["usage"]["completion_tokens"] == 3
    refused = {str(entry.get("object")) for entry in acl_redis.refused()}
    assert refused == {"scan"}  # its one look, refused; nothing else
