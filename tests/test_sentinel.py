"""Redis Sentinel: `redis+sentinel://` URLs, and a failover during a run on loopback (one master,
one replica, three sentinels, real processes; see sentinel_harness.py).

What a failover may lose, and so what these tests accept: replication is asynchronous, so the
writes the master took in its last moments (milliseconds here) may never reach the replica. The
tests make every submit reach the replica before the kill (WAIT), so no job may vanish. What the
worker wrote for a job in flight may be cut short: a lost token leaves a gap the worker's next
write finds (it drops the job, and the job is reclaimed and resumed from the stream's last token),
a lost owner hash ends the job with the `lost_state` error event. So a job in flight must end
either complete and exact (every token once, the text of an uninterrupted run) or with
`lost_state`; a job submitted after the failover must end complete and exact.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx2
import pytest
from openai import OpenAI

from qworker_client.aio import AsyncProducer
from qworker_client.client import Producer
from qworker_client.connect import ClientOptions, RedisURLError, checked_url, masked
from qworker_client.gateway.connection import gateway_client
from qworker_client.protocol import LOST_STATE, ErrorEvent
from qworker_client.redis_clients import sync_redis
from qworker_client.rq import _decoding_twin
from qworker_client.sentinel_pools import (
    AsyncBlockingSentinelPool,
    AsyncSentinelConnection,
    SentinelPool,
)
from qworker_client.sentinel_url import parse_sentinel_url
from tests.gateway_harness import gateway
from tests.sentinel_harness import Topology, elapsed, topology
from tests.service_harness import (
    ROOT,
    check_stream,
    events,
    expected,
    terminal,
    wait_for,
    wait_terminal,
)
from tests.worker_process import sim_worker

SIM = "sim:step_ms=20"
FAST_RECLAIM = ("--claim-idle-ms", "1000")


@pytest.fixture
def sentinels(tmp_path: Path) -> Iterator[Topology]:
    with topology(tmp_path) as found:
        yield found


def worker(url: str, name: str, log_path: Path) -> AbstractContextManager[subprocess.Popen[bytes]]:
    """`qworker serve --redis-url redis+sentinel://...` on the simulated engine, live."""
    return sim_worker(url, name, *FAST_RECLAIM, model=SIM, log_path=log_path)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "qworker_client", *args], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)


def test_a_sentinel_url_names_the_sentinels_the_service_and_the_db() -> None:
    target = parse_sentinel_url("redis+sentinel://app:s3cret@10.0.0.1:5000,10.0.0.2,[::1]:26380"
                                "/mymaster/3?sentinel_password=other&socket_keepalive=true")
    assert target.sentinels == (("10.0.0.1", 5000), ("10.0.0.2", 26379), ("::1", 26380))
    assert target.service_name == "mymaster"
    assert target.node_kwargs == {"username": "app", "password": "s3cret", "db": 3,
                                  "socket_keepalive": True}
    assert target.sentinel_kwargs == {"password": "other"}
    tls = parse_sentinel_url("rediss+sentinel://h/m?ssl_cert_reqs=none")
    assert tls.node_kwargs == {"ssl": True, "ssl_cert_reqs": "none"}
    assert tls.sentinel_kwargs == {"ssl": True, "ssl_cert_reqs": "none"}


@pytest.mark.parametrize("url, why", [
    ("redis+sentinel://h:26379", "no service name"),
    ("redis+sentinel://h:26379/", "no service name"),
    ("redis+sentinel:///mymaster", "no sentinel address"),
    ("redis+sentinel://h:port/mymaster", "is not host[:port]"),
    ("redis+sentinel://h:70000/mymaster", "out of range"),
    ("redis+sentinel://h/mymaster/zero", "/service_name/db"),
    ("redis+sentinel://h/mymaster/0/1", "/service_name/db"),
])
def test_a_malformed_sentinel_url_says_what_is_wrong(url: str, why: str) -> None:
    with pytest.raises(RedisURLError, match="invalid Redis URL") as raised:
        checked_url(url)
    assert why in str(raised.value)


def test_sentinel_urls_print_without_their_passwords() -> None:
    url = "redis+sentinel://app:s3cret@h1:1,h2:2/m/0?sentinel_password=other&protocol=3"
    assert masked(url) == "redis+sentinel://app:***@h1:1,h2:2/m/0?sentinel_password=***&protocol=3"
    assert masked("redis+sentinel://:pw@[::1]:1,[::2]:2/m") == "redis+sentinel://:***@[::1]:1,[::2]:2/m"


def test_the_gateways_sentinel_pool_waits_for_a_free_connection_as_its_plain_one() -> None:
    client = gateway_client("redis+sentinel://127.0.0.1:1/mymaster", ClientOptions(),
                            max_connections=7, wait_s=3.0)
    pool = client.connection_pool
    assert isinstance(pool, AsyncBlockingSentinelPool) and pool.service_name == "mymaster"
    assert (pool.max_connections, pool.timeout) == (7, 3.0)
    assert pool.connection_class is AsyncSentinelConnection


def test_an_rq_workers_sentinel_connection_gets_a_decoding_twin_of_the_same_master() -> None:
    rq_connection = sync_redis("redis+sentinel://:pw@127.0.0.1:1,127.0.0.1:2/mymaster/4")
    twin = _decoding_twin(rq_connection, ClientOptions())
    pool = twin.connection_pool
    assert isinstance(pool, SentinelPool) and pool.service_name == "mymaster"
    assert pool.sentinel_manager is rq_connection.connection_pool.sentinel_manager
    assert {k: pool.connection_kwargs[k] for k in ("db", "password", "decode_responses")} == \
        {"db": 4, "password": "pw", "decode_responses": True}
    assert not rq_connection.connection_pool.connection_kwargs.get("decode_responses")


def test_the_cli_refuses_a_malformed_sentinel_url_in_one_line() -> None:
    proc = cli("submit", "hi", "--redis-url", "redis+sentinel://app:s3cret@h1:1/")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "no service name" in proc.stderr, proc.stderr
    assert "s3cret" not in proc.stderr


def test_qworker_serve_refuses_a_malformed_sentinel_url_before_loading_a_model() -> None:
    proc = subprocess.run([sys.executable, "-m", "qworker.cli", "serve", "--model", "sim",
                           "--redis-url", "redis+sentinel://app:s3cret@h1:1/m/x"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert "invalid Redis URL" in proc.stderr and "/service_name/db" in proc.stderr
    assert "s3cret" not in proc.stderr + proc.stdout


def test_a_worker_follows_a_failover(sentinels: Topology, tmp_path: Path) -> None:
    url, log_path = sentinels.url(), tmp_path / "worker.log"
    jobs = {f"pre-{k}": {"prompt": f"before the failover {k}", "max_tokens": 150, "seed": k}
            for k in range(4)}
    with worker(url, "sentinel-w", log_path) as proc, Producer(url) as producer:
        raw = sync_redis(url, socket_timeout=5)
        for job_id, fields in jobs.items():
            producer.submit(id=job_id, **fields)
        sentinels.replicated()  # no submit may be lost: only what the worker wrote since
        wait_for(lambda: len(events(raw, "pre-0")) >= 10, what="tokens before the kill")
        assert terminal(raw, "pre-0") is None  # in flight when its Redis dies
        killed_at = time.monotonic()
        sentinels.kill_master()
        sentinels.wait_promoted()
        promoted_in = elapsed(killed_at)
        after = {f"post-{k}": {"prompt": f"after the failover {k}", "max_tokens": 20, "seed": k}
                 for k in range(4)}
        for job_id, fields in after.items():  # the same producer: its client follows too
            producer.submit(id=job_id, **fields)
        ends = wait_terminal(raw, [*jobs, *after], timeout=60)
        assert proc.poll() is None, "the worker died in the failover"
        post = {job_id: check_stream(raw, job_id) for job_id in after}
        want = expected({**jobs, **after})
        assert {k: (d.text, d.finish_reason) for k, d in post.items()} == \
            {k: want[k] for k in after}
        for job_id in jobs:  # in flight: complete and exact, or ended as Redis lost its state
            end = ends[job_id]
            if isinstance(end, ErrorEvent):
                assert end.code == LOST_STATE, (job_id, end)
            else:
                done = check_stream(raw, job_id)
                assert (done.text, done.finish_reason) == want[job_id], job_id
    assert promoted_in < 20, promoted_in
    assert_no_spin(log_path)


def test_what_a_failover_loses_ends_as_documented(sentinels: Topology, tmp_path: Path) -> None:
    """The replica stops replicating while jobs run; the master takes ten tokens more of each and
    one more job, then dies: the new master lacks all that. The worker's next write finds the
    gap, drops the jobs, reclaims them and resumes each from its stream's last token: complete
    and exact. The job submitted after the cut, already running, has no owner hash left: it
    ends with `lost_state` (its readers are told, not left waiting)."""
    url = sentinels.url()
    jobs = {f"lossy-{k}": {"prompt": f"lossy {k}", "max_tokens": 150, "seed": k} for k in range(3)}
    with worker(url, "sentinel-l", tmp_path / "worker.log") as proc, Producer(url) as producer:
        raw = sync_redis(url, socket_timeout=5)
        for job_id, fields in jobs.items():
            producer.submit(id=job_id, **fields)
        sentinels.replicated()
        wait_for(lambda: len(events(raw, "lossy-0")) >= 10, what="tokens before the cut")
        sentinels.cut_replication()
        replicated = len(events(raw, "lossy-0"))
        producer.submit(id="lossy-late", prompt="after the cut", max_tokens=150)
        wait_for(lambda: len(events(raw, "lossy-late")) >= 1, what="the late job to run")
        wait_for(lambda: len(events(raw, "lossy-0")) >= replicated + 10, what="unreplicated tokens")
        sentinels.kill_master()
        sentinels.wait_promoted()
        assert len(events(raw, "lossy-0")) < replicated + 10, "the failover lost nothing"
        ends = wait_terminal(raw, [*jobs, "lossy-late"], timeout=60)
        assert proc.poll() is None, "the worker died in the failover"
        late = ends.pop("lossy-late")
        assert isinstance(late, ErrorEvent) and late.code == LOST_STATE, late
        want = expected(jobs)
        for job_id, end in ends.items():
            if isinstance(end, ErrorEvent):
                assert end.code == LOST_STATE, (job_id, end)
            else:
                done = check_stream(raw, job_id)
                assert (done.text, done.finish_reason) == want[job_id], job_id


def assert_no_spin(log_path: Path) -> None:
    """The worker backed off while Redis was away: a few dozen error lines, not thousands."""
    lines = log_path.read_text(errors="replace").splitlines()
    redis_errors = [line for line in lines if "redis" in line.lower() and "error" in line.lower()]
    assert len(redis_errors) < 100, redis_errors[-5:]


def test_the_gateway_and_the_cli_serve_after_a_failover(sentinels: Topology,
                                                        tmp_path: Path) -> None:
    url = sentinels.url()
    with worker(url, "sentinel-g", tmp_path / "worker.log"), gateway(url) as base, \
            OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60) as sdk:
        before = sdk.completions.create(model=SIM, prompt="before", max_tokens=12, seed=1)
        assert before.choices[0].finish_reason == "length"
        texts = asyncio.run(async_producer_across(url, sentinels))
        after = sdk.completions.create(model=SIM, prompt="after", max_tokens=12, seed=2)
        board = httpx2.get(f"{base}/dashboard/workers", timeout=30)  # read from the new master
        assert board.status_code == 200 and "sentinel-g" in board.text, board.text[:300]
        by_cli = cli("submit", "from the cli", "--id", "cli-after", "--max-tokens", "5",
                     "--stream", "--redis-url", url)
        assert by_cli.returncode == 0, by_cli.stderr
        with sync_redis(url, socket_timeout=5) as raw:
            assert by_cli.stdout == check_stream(raw, "cli-after").text + "\n"
    want = expected({"after": {"prompt": "after", "max_tokens": 12, "seed": 2}, **ASYNC_JOBS})
    assert (after.choices[0].text, after.choices[0].finish_reason) == want["after"]
    assert texts == [want["async-before"][0], want["async-after"][0]]


ASYNC_JOBS: dict[str, dict[str, Any]] = {
    "async-before": {"prompt": "asyncio before", "max_tokens": 8, "seed": 3},
    "async-after": {"prompt": "asyncio after", "max_tokens": 8, "seed": 4}}


async def async_producer_across(url: str, sentinels: Topology) -> list[str]:
    """An AsyncProducer's job before the failover (the master is killed and the replica promoted
    meanwhile, its connections left open) and one after: their texts."""
    async with AsyncProducer(url) as producer:
        before = await producer.submit(id="async-before", **ASYNC_JOBS["async-before"])
        first = (await before.result(timeout=30)).text
        await asyncio.to_thread(sentinels.kill_master)
        await asyncio.to_thread(sentinels.wait_promoted)
        after = await producer.submit(id="async-after", **ASYNC_JOBS["async-after"])
        return [first, (await after.result(timeout=30)).text]
