"""Producers route a job that names its model to `qw:jobs:{<model>}` (sync, async, CLI, batch);
a job without one goes to `qw:jobs` as before; a model name unfit for a key is refused before
anything is sent."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from qworker_client import AsyncProducer, JobValidationError, Producer
from qworker_client.batch import BatchLine, Submitter
from qworker_client.protocol import INVALID_REQUEST, Keys, parse_job_fields

ROOT = Path(__file__).resolve().parents[1]
KEYS = Keys("qw")
BAD_NAMES = ["", "a b", "{a}", "a}", "m*", "m?", "[m]", "é", "a\n", "x" * 257]


@pytest.fixture
def client(redis_url: str) -> redis.Redis:
    c = redis.Redis.from_url(redis_url, decode_responses=True)
    yield c
    c.close()


def stream_ids(client: redis.Redis, stream: str) -> list[str]:
    return [fields["id"] for _, fields in client.xrange(stream)]


def test_keys_of_a_model() -> None:
    assert KEYS.jobs_of(None) == "qw:jobs" and KEYS.jobs_of("a") == "qw:jobs:{a}"
    assert KEYS.requeue_of("org/m-1.5") == "qw:requeue:{org/m-1.5}"
    assert KEYS.streams_for("a")[4:8] == ("qw:requeue:{a}", "qw:requeue", "qw:jobs:{a}",
                                          "qw:jobs")  # the normal band's: v1's streams
    assert KEYS.streams_for(None)[2:4] == ("qw:requeue", "qw:jobs")
    assert [KEYS.stream_model(s) for s in ("qw:jobs:{a}", "qw:requeue:{b=1,c}", "qw:jobs",
                                           "qw:requeue", "qw:jobs:{a}:hi")] == [
        "a", "b=1,c", None, None, "a"]
    with pytest.raises(ValueError, match="invalid model name"):
        KEYS.jobs_of("a}b")


def test_submit_routes_by_model(prod_url: str, client: redis.Redis) -> None:
    with Producer(prod_url) as prod:
        jobs = prod.submit_many([{"prompt": "1", "model": "a", "id": "j1"},
                                 {"prompt": "2", "id": "j2"},
                                 {"prompt": "3", "model": "b", "id": "j3"},
                                 {"prompt": "4", "model": "a", "id": "j4"}])
        single = prod.submit("5", model="sim:step_ms=2", id="j5")
    assert [j.id for j in jobs] == ["j1", "j2", "j3", "j4"] and all(j.new for j in jobs)
    assert stream_ids(client, "qw:jobs:{a}") == ["j1", "j4"]
    assert stream_ids(client, "qw:jobs:{b}") == ["j3"]
    assert stream_ids(client, "qw:jobs") == ["j2"]
    assert stream_ids(client, "qw:jobs:{sim:step_ms=2}") == ["j5"] and single.entry_id
    assert client.xrange("qw:jobs:{a}")[0][1]["model"] == "a"  # the entry says it too
    assert jobs[0].entry_id == client.get(KEYS.submitted("j1"))


@pytest.mark.parametrize("name", BAD_NAMES)
def test_a_model_name_unfit_for_a_key_is_refused(prod_url: str, client: redis.Redis,
                                                 name: str) -> None:
    with Producer(prod_url) as prod, pytest.raises(JobValidationError) as caught:
        prod.submit_many([{"prompt": "fine"}, {"prompt": "x", "model": name}])
    assert caught.value.code == INVALID_REQUEST and "model" in caught.value.message
    assert client.keys("qw:*") == []  # nothing sent, not even the valid job
    with pytest.raises(JobValidationError):  # the worker's parser is the same
        parse_job_fields({"prompt": "x", "model": name}, "1-0")


def test_async_submit_routes_by_model(prod_url: str, client: redis.Redis) -> None:
    async def scenario() -> list[bool]:
        async with AsyncProducer(prod_url) as prod:
            jobs = await prod.submit_many([{"prompt": "1", "model": "b", "id": "a1"},
                                           {"prompt": "2", "id": "a2"}])
            again = await prod.submit("1", model="b", id="a1")
            with pytest.raises(JobValidationError):
                await prod.submit("x", model="no spaces")
            return [j.new for j in jobs] + [again.new]

    assert asyncio.run(scenario()) == [True, True, False]
    assert stream_ids(client, "qw:jobs:{b}") == ["a1"] and stream_ids(client, "qw:jobs") == ["a2"]


def test_cli_submit_model(prod_url: str, client: redis.Redis) -> None:
    def submit(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "qworker_client", "submit", *args,
                               "--no-wait", "--redis-url", prod_url], capture_output=True,
                              text=True, timeout=60, cwd=ROOT)

    ok = submit("hello", "--model", "org/m", "--id", "c1")
    assert (ok.returncode, ok.stdout) == (0, "c1\n"), ok.stderr
    assert stream_ids(client, "qw:jobs:{org/m}") == ["c1"]
    bad = submit("hello", "--model", "a{b}")
    assert bad.returncode != 0 and "model" in bad.stderr
    assert client.exists("qw:jobs") == 0


def test_batch_lines_go_to_their_models_streams(prod_url: str, client: redis.Redis) -> None:
    submitter = Submitter(redis.Redis.from_url(prod_url), KEYS, "bm")
    lines = [BatchLine(1, "l1", "b1", {"id": "b1", "prompt": "x", "model": "a"}),
             BatchLine(2, "l2", "b2", {"id": "b2", "prompt": "y"})]
    assert submitter.submit(lines) == [True, True]
    assert stream_ids(client, "qw:jobs:{a}") == ["b1"] and stream_ids(client, "qw:jobs") == ["b2"]
    assert submitter.submit(lines) == [False, False]  # queued: re-attached, not sent again
    (entry_id, fields), = client.xrange("qw:jobs:{a}")
    client.xdel("qw:jobs:{a}", entry_id)
    client.xadd("qw:requeue:{a}", fields)  # requeued by a worker of model a: still alive
    assert submitter.submit(lines) == [False, False]
    client.delete("qw:requeue:{a}")
    assert submitter.submit(lines) == [True, False]  # gone: submitted again, to its stream
    assert stream_ids(client, "qw:jobs:{a}") == ["b1"]


@pytest.fixture
def prod_url(redis_url: str) -> str:
    return redis_url


def test_stats_show_each_models_streams(prod_url: str, client: redis.Redis) -> None:
    with Producer(prod_url) as prod:
        prod.submit_many([{"prompt": "x", "model": "b"}, {"prompt": "y", "model": "a"},
                          {"prompt": "z", "model": "a"}, {"prompt": "w"}])
        client.xadd("qw:requeue:{a}", {"id": "r", "prompt": "x"})
        client.set("qw:jobs:{not-a-stream}", "x")  # only streams are work streams
        stats = prod.stats()
    assert [(s.key, s.length) for s in stats.models] == [
        ("qw:jobs:{a}", 2), ("qw:requeue:{a}", 1), ("qw:jobs:{b}", 1)]
    assert (stats.unfinished, stats.backlog) == (5, 5)
    text = subprocess.run([sys.executable, "-m", "qworker_client", "stats", "--redis-url",
                           prod_url], capture_output=True, text=True, timeout=60, cwd=ROOT)
    rows = [line.split()[:3] for line in text.stdout.splitlines()[1:6]]
    assert rows == [["qw:jobs", "1", "1"], ["qw:requeue", "0", "0"], ["qw:jobs:{a}", "2", "2"],
                    ["qw:requeue:{a}", "1", "1"], ["qw:jobs:{b}", "1", "1"]], text.stdout
