"""The ACL users of docs/operating.md, word for word, on a Redis with `requirepass`: a worker and a
producer run jobs as them with no command refused, and each is kept to its prefix and its part."""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from qworker_client import JobError, Producer
from qworker_client.batch import run_batch
from qworker_client.local_redis import RedisProcess
from qworker_client.protocol import Keys
from tests.service_harness import thread_worker, wait_for

OPERATING = Path(__file__).resolve().parents[1] / "docs" / "operating.md"
KEYS = Keys("qw")
USERS = ("qworker-worker", "qworker-producer", "qworker-keda")


def acl_rules() -> dict[str, list[str]]:
    """The `ACL SETUSER` lines of operating.md, by user, as command words."""
    lines = re.findall(r"^ACL SETUSER .+$", OPERATING.read_text(), re.M)
    rules = {shlex.split(line)[2]: shlex.split(line) for line in lines}
    assert set(rules) == set(USERS), sorted(rules)
    return rules


@dataclass
class AclRedis:
    port: int
    admin: redis.Redis
    passwords: dict[str, str]

    def url(self, user: str) -> str:
        return f"redis://{user}:{self.passwords[user]}@127.0.0.1:{self.port}/0"

    def client(self, user: str) -> redis.Redis:
        return redis.Redis.from_url(self.url(user), decode_responses=True)


@pytest.fixture
def acl_redis(tmp_path: Path) -> Iterator[AclRedis]:
    server = RedisProcess(tmp_path, ("--save", ""), password=os.urandom(8).hex())
    server.start()
    admin = redis.Redis.from_url(server.url, decode_responses=True)
    try:
        passwords = {user: os.urandom(8).hex() for user in USERS}
        setinfo = tuple(int(v) for v in admin.info("server")["redis_version"].split(".")[:2])
        for user, words in acl_rules().items():
            words = [f">{passwords[user]}" if w.startswith(">") else w for w in words]
            if setinfo >= (7, 2):  # as the doc says for Redis 7.2 and later
                words.append("+client|setinfo")
            admin.execute_command(*words)
        admin.acl_log_reset()
        yield AclRedis(server.port, admin, passwords)
    finally:
        admin.close()
        server.stop()


def test_worker_and_producer_run_jobs_as_their_acl_users(acl_redis: AclRedis,
                                                         tmp_path: Path) -> None:
    acl_redis.admin.xgroup_create(KEYS.jobs, "workers", id="0", mkstream=True)
    acl_redis.admin.xgroup_createconsumer(KEYS.jobs, "workers", "ghost")  # a long-dead worker
    with thread_worker(acl_redis.url("qworker-worker"), "acl-1", claim_idle_ms=300,
                       drain_timeout=0.0) as worker, \
            Producer(acl_redis.url("qworker-producer")) as prod:
        result = prod.submit("hello acl", id="acl-job", max_tokens=8).result(timeout=30)
        assert (result.finish_reason, result.usage.completion_tokens) == ("length", 8)
        assert not prod.submit("hello acl", id="acl-job", max_tokens=8).new
        prod.redis.xadd(KEYS.jobs, {"id": "bad-acl", "prompt": "x", "colour": "blue"})
        with pytest.raises(JobError, match="invalid_request"):  # dead-lettered by the worker
            prod.job("bad-acl").result(timeout=30)
        cancelled = prod.submit("long", max_tokens=20000, ignore_eos=True)
        wait_for(lambda: acl_redis.admin.xlen(KEYS.out(cancelled.id)) >= 2, what="tokens")
        assert cancelled.cancel()
        assert cancelled.result(timeout=30).finish_reason == "cancelled"
        source = tmp_path / "in.jsonl"
        source.write_text('{"custom_id": "a", "prompt": "batch", "max_tokens": 4}\n')
        summary = run_batch(source, tmp_path / "out.jsonl",
                            redis_url=acl_redis.url("qworker-producer"))
        assert summary.succeeded == 1
        wait_for(lambda: "ghost" not in _consumers(acl_redis.admin), 20,
                 what="the worker to remove the dead consumer")
        kept = prod.submit("requeued at stop", max_tokens=20000, ignore_eos=True)
        wait_for(lambda: acl_redis.admin.xlen(KEYS.out(kept.id)) >= 2, what="tokens")
        assert worker.stop() == 0
    assert acl_redis.admin.xlen(KEYS.requeue) == 1, "drained: its running job was requeued"
    stats = Producer(acl_redis.url("qworker-keda")).stats()
    assert stats.requeue.length == 1 and stats.dead_letters == 1
    refused = acl_redis.admin.acl_log()
    assert refused == [], refused


def _consumers(admin: redis.Redis) -> set[str]:
    return {c["name"] for c in admin.xinfo_consumers(KEYS.jobs, "workers")}


def test_each_user_is_kept_to_its_part(acl_redis: AclRedis) -> None:
    worker, producer, keda = (acl_redis.client(user) for user in USERS)
    worker.xadd(KEYS.out("j"), {"type": "token"})
    for client, command in [
        (worker, ("SET", "other:key", "1")),  # outside the prefix
        (worker, ("FLUSHALL",)),
        (worker, ("KEYS", "*")),
        (producer, ("XDEL", KEYS.jobs, "1-1")),
        (producer, ("XREADGROUP", "GROUP", "workers", "p", "STREAMS", KEYS.jobs, ">")),
        (producer, ("DEL", KEYS.out("j"))),
        (producer, ("GET", "other:key")),
        (keda, ("XADD", KEYS.jobs, "*", "prompt", "x")),
        (keda, ("SET", KEYS.cancel("j"), "1")),
        (producer, ("SUBSCRIBE", "qw:any")),
    ]:
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.execute_command(*command)
