"""The dashboard's Redis reads (qworker_client.dashboard.reads) on a real redis-server, filled by
hand as workers and clients leave it: what each page finds, and that it makes no more Redis calls
than its stated bound (counted with INFO commandstats)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import httpx2
import pytest
import redis

from qworker_client.dashboard import live, reads
from qworker_client.local_redis import free_port, stop_child
from qworker_client.protocol import DEFAULT_GROUP, THROUGHPUT_TTL_S, Keys, WorkerInfo
from tests.service_harness import checkout_env, submit, thread_worker, wait_for, wait_terminal

KEYS = Keys()
UNCOUNTED = {"cmdstat_info", "cmdstat_ping", "cmdstat_hello", "cmdstat_client|setinfo"}


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url, decode_responses=True)  # as the dashboard's
    c.ping()
    yield c
    c.close()


def calls(client: redis.Redis, read: Callable[[], Any]) -> tuple[Any, int]:
    """What `read` returns, and the Redis commands it made (pipelined ones one by one)."""
    def counted() -> int:
        stats = client.info("commandstats")
        return sum(v["calls"] for k, v in stats.items() if k not in UNCOUNTED)
    before = counted()
    result = read()
    return result, counted() - before


def worker_key(client: redis.Redis, name: str, model: str, ttl_ms: int = 3_000,
               liveness_ms: int = 3_000, **extra: Any) -> None:
    info = WorkerInfo(name=name, host="h1", pid=1, model=model, group=DEFAULT_GROUP,
                      started_ms=1, running=1, free_slots=3, native="avx2", version="0.1.0",
                      kv_used=0.25, liveness_ms=liveness_ms, **extra)
    client.set(KEYS.worker(name), info.model_dump_json(), px=ttl_ms)


def queue(client: redis.Redis, stream: str, n: int, taken: int = 0, prefix: str = "j") -> list[str]:
    """`n` jobs on `stream`, the first `taken` of them read by consumer w1 (running)."""
    ids = []
    for k in range(n):
        job_id = f"{prefix}{k}"
        entry = client.xadd(stream, {"id": job_id, "prompt": "hi", "max_tokens": "4"})
        client.set(KEYS.submitted(job_id), entry)
        ids.append(job_id)
    client.xgroup_create(stream, DEFAULT_GROUP, id="0", mkstream=True)
    if taken:
        client.xreadgroup(DEFAULT_GROUP, "w1", {stream: ">"}, count=taken)
    return ids


def test_overview_counts_each_model_and_band_and_the_last_hour(client: redis.Redis) -> None:
    queue(client, KEYS.jobs, 5, taken=2)
    queue(client, KEYS.jobs_of("m1", "high"), 3, prefix="h")
    queue(client, KEYS.requeue_of("m1"), 1, prefix="r")
    worker_key(client, "w1", "m1")
    now_minute = reads.server_ms(client) // 60_000
    client.hset(KEYS.throughput(now_minute - 1), mapping={"tokens:m1": 600, "jobs:m1": 3})
    client.expire(KEYS.throughput(now_minute - 1), THROUGHPUT_TTL_S)
    client.xadd(KEYS.dead, {"reason": "bad", "code": "invalid_job",
                            "source": KEYS.jobs_of("m1"), "source_id": "1-1", "worker": "w1"})
    data, n = calls(client, lambda: reads.overview(client, KEYS))
    assert n <= reads.page_bound("overview", client.dbsize())
    rows = {(q.model, q.band): q for q in data.queues}
    assert (rows[("", "")].queued, rows[("", "")].running) == (3, 2)
    assert rows[("m1", "high")].queued == 3
    assert rows[("m1", "")].requeued == 1 and rows[("m1", "")].dead_hour == 1
    assert rows[("", "")].oldest_ms is not None
    assert data.workers == 1 and data.dead_hour == 1
    (series,) = data.series
    assert series.model == "m1" and series.tokens[-2] == 600 and series.jobs[-2] == 3
    assert series.tokens_per_s == 10.0


def test_workers_marks_the_stalled_and_the_gone(client: redis.Redis) -> None:
    queue(client, KEYS.jobs, 2, taken=1)  # consumer w1 holds one, and has no key: gone
    worker_key(client, "w2", "m1")  # beat just now
    worker_key(client, "w3", "m1", ttl_ms=1_000, liveness_ms=3_000)  # 2 s since its beat
    now_minute = reads.server_ms(client) // 60_000
    client.hset(KEYS.throughput(now_minute - 1), "worker:w2", 120)
    data, n = calls(client, lambda: reads.workers(client, KEYS))
    assert n <= reads.page_bound("workers", client.dbsize())
    by_name = {w.name: w for w in data.live}
    assert set(by_name) == {"w2", "w3"}
    assert not by_name["w2"].stalled and by_name["w3"].stalled
    assert by_name["w2"].tokens_per_s == 2.0 and by_name["w2"].info["kv_used"] == 0.25
    assert [(g.name, g.pending) for g in data.gone] == [("w1", 1)]


def test_jobs_filters_by_status_and_model(client: redis.Redis) -> None:
    queue(client, KEYS.jobs, 3, taken=1)
    client.hset(KEYS.owner("j0"), mapping={"worker": "w1/abc", "t0": "1"})
    queue(client, KEYS.jobs_of("m1"), 2, prefix="m")
    client.xadd(KEYS.recent, {"id": "old", "model": "m1", "status": "done", "reason": "stop",
                              "tokens": "7", "worker": "w1"})
    data, n = calls(client, lambda: reads.jobs(client, KEYS))
    assert n <= reads.page_bound("jobs", client.dbsize())
    assert {r.job_id: r.status for r in data.rows} == {
        "j0": "running", "j1": "queued", "j2": "queued", "m0": "queued", "m1": "queued",
        "old": "done"}
    assert [r.job_id for r in reads.jobs(client, KEYS, status="done").rows] == ["old"]
    assert {r.job_id for r in reads.jobs(client, KEYS, model="m1").rows} == {"m0", "m1", "old"}
    assert {r.job_id for r in reads.jobs(client, KEYS, model="-").rows} == {"j0", "j1", "j2"}


def test_job_reads_its_fields_timings_and_text(client: redis.Redis) -> None:
    queue(client, KEYS.jobs_of("m1"), 1, taken=1, prefix="x")
    client.hset(KEYS.owner("x0"), mapping={"worker": "w1/run", "t0": "1000", "crashes": "1"})
    out = KEYS.out("x0")
    client.xadd(out, {"type": "token", "i": "0", "token_id": "5", "text": "Hel"}, id="1100-0")
    client.xadd(out, {"type": "token", "i": "1", "token_id": "6", "text": "lo"}, id="1200-0")
    running, n = calls(client, lambda: reads.job(client, KEYS, "x0"))
    assert n <= reads.page_bound("job", client.dbsize())
    assert (running.status, running.text, running.tokens) == ("running", "Hello", 2)
    assert running.fields["prompt"] == "hi" and running.stream == KEYS.jobs_of("m1")
    assert running.deliveries == 1 and running.workers == ["w1"]
    assert (running.queued_ms, running.ttft_ms, running.last_entry) == (1000, 100, "1200-0")
    client.xadd(out, {"type": "done", "finish_reason": "stop", "text": "Hello", "prompt_tokens":
                      "1", "completion_tokens": "2", "ttft_ms": "100", "total_ms": "300"},
                id="1300-0")
    done = reads.job(client, KEYS, "x0")
    assert (done.status, done.finish_reason, done.total_ms, done.ended) == ("done", "stop", 300,
                                                                          True)
    assert reads.job(client, KEYS, "nobody").status == "unknown"


def test_job_of_a_dead_letter_shows_its_copy_and_error(client: redis.Redis) -> None:
    client.xadd(KEYS.dead, {"reason": "prompt is empty", "code": "invalid_job",
                            "source": KEYS.jobs, "source_id": "5-0", "worker": "w1",
                            "id": "bad1", "prompt": ""})
    client.xadd(KEYS.out("bad1"), {"type": "error", "code": "invalid_job",
                                   "message": "prompt is empty"})
    data = reads.job(client, KEYS, "bad1")
    assert data.status == "error" and data.error == "invalid_job: prompt is empty"
    assert data.dead is not None and data.fields["id"] == "bad1"


def test_dead_counts_codes_and_filters(client: redis.Redis) -> None:
    for k in range(3):
        client.xadd(KEYS.dead, {"reason": "r", "code": "invalid_job" if k else "poison",
                                "source": KEYS.jobs, "source_id": f"{k}-0", "worker": "w"})
    data, n = calls(client, lambda: reads.dead(client, [KEYS]))
    assert n <= reads.page_bound("dead", client.dbsize())
    assert data.codes == {"invalid_job": 2, "poison": 1}
    assert len(reads.dead(client, [KEYS], "poison").letters) == 1


def test_a_page_calls_stay_bounded_whatever_the_queue_holds(client: redis.Redis) -> None:
    """3,000 queued jobs, 300 workers' keys: each page's calls stay under its bound, which does
    not grow with the jobs (only the SCANs grow with the keys)."""
    pipe = client.pipeline(transaction=False)
    for k in range(3_000):
        pipe.xadd(KEYS.jobs, {"id": f"q{k}", "prompt": "p"})
    for k in range(300):
        info = WorkerInfo(name=f"w{k}", host="h", pid=k, model="m", group=DEFAULT_GROUP,
                          started_ms=1)
        pipe.set(KEYS.worker(f"w{k}"), json.dumps(info.model_dump()), px=60_000)
    pipe.execute()
    keys_in_db = client.dbsize()
    for page, read in (("overview", lambda: reads.overview(client, KEYS)),
                       ("workers", lambda: reads.workers(client, KEYS)),
                       ("jobs", lambda: reads.jobs(client, KEYS)),
                       ("job", lambda: reads.job(client, KEYS, "q1")),
                       ("dead", lambda: reads.dead(client, [KEYS]))):
        _, n = calls(client, read)
        assert n <= reads.page_bound(page, keys_in_db), page
    assert reads.page_bound("jobs", keys_in_db) < 1_000


def test_a_worker_counts_each_minute_and_says_its_kv_use(redis_url: str,
                                                         client: redis.Redis) -> None:
    """A real worker (simulated engine): each ended job adds to its minute's counters, which
    expire; its liveness key says its KV use, version and liveness TTL."""
    with thread_worker(redis_url, "w-count"):
        submit(client, "t1", prompt="hi", max_tokens=5)
        submit(client, "t2", prompt="hi", max_tokens=7)
        wait_terminal(client, ["t1", "t2"])
        minute_keys = [k for k in client.scan_iter(match=KEYS.throughput("*"))]
        info = json.loads(client.get(KEYS.worker("w-count")) or "{}")
    counters: dict[str, int] = {}
    for key in minute_keys:
        assert 0 < client.ttl(key) <= THROUGHPUT_TTL_S
        for name, value in client.hgetall(key).items():
            counters[name] = counters.get(name, 0) + int(value)
    assert counters == {"tokens:": 12, "jobs:": 2, "worker:w-count": 12}
    assert info["liveness_ms"] > 0 and 0 <= info["kv_used"] <= 1
    series = reads.overview(client, KEYS).series
    assert sum(series[0].tokens) == 12 and sum(series[0].jobs) == 2


def test_qworker_dashboard_serves_alone(redis_url: str) -> None:
    """`qworker dashboard`: no gateway, no key (open: every visitor is admin)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "qworker_client", "dashboard", "--redis-url",
                             redis_url, "--port", str(port)], env=checkout_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        def up() -> bool:
            try:
                return httpx2.get(f"http://127.0.0.1:{port}/").status_code == 200
            except httpx2.HTTPError:
                return False
        wait_for(up, timeout=30, what="qworker dashboard to serve")
        page = httpx2.get(f"http://127.0.0.1:{port}/dead").text
        assert "Dead letters" in page and "log out" not in page
    finally:
        stop_child(proc, 10)
    assert proc.stdout is not None
    assert f"ready at http://127.0.0.1:{port}/" in proc.stdout.read().decode()


def test_the_live_stream_resumes_after_an_entry_and_skips_repeats(client: redis.Redis) -> None:
    out = KEYS.out("s1")
    client.xadd(out, {"type": "token", "i": "0", "token_id": "1", "text": "A"}, id="10-0")
    client.xadd(out, {"type": "token", "i": "1", "token_id": "2", "text": "B"}, id="11-0")
    client.xadd(out, {"type": "token", "i": "1", "token_id": "2", "text": "B"}, id="12-0")  # again
    client.xadd(out, {"type": "done", "finish_reason": "stop", "text": "AB", "prompt_tokens": "1",
                      "completion_tokens": "2"}, id="13-0")
    client.xadd(out, {"type": "token", "i": "2", "token_id": "3", "text": "C"}, id="14-0")
    assert live.try_open()
    frames = list(live.events(client, KEYS, "s1", "10-0", 1))  # the page had token 0
    assert [f.split("\n")[:2] for f in frames[1:]] == [["id: 11-0", "event: token"],
                                                      ["id: 13-0", "event: done"]]
    assert '"text": "AB"' in frames[-1]
    for _ in range(live.MAX_LIVE):  # every stream it opened was given back
        assert live.try_open()
    assert not live.try_open()
    for _ in range(live.MAX_LIVE):
        live._live.release()


def test_pages_given_the_found_keys_scan_nothing_and_new_keys_are_found_in_time(
        client: redis.Redis) -> None:
    """A SCAN looks at every key in Redis: the pages read the keys the directory found (in its
    own thread, every refresh), so their calls stay fixed however many keys Redis holds."""
    from qworker_client.dashboard.directory import Directory

    worker_key(client, "w1", "m1", ttl_ms=60_000)
    queue(client, KEYS.jobs_of("m1"), 3, taken=1)
    directory = Directory(client, KEYS, refresh_s=0.1)
    found = directory.found()
    assert found.workers == (KEYS.worker("w1"),) and KEYS.jobs_of("m1") in found.streams

    def scans(read: Callable[[], Any]) -> int:
        before = client.info("commandstats").get("cmdstat_scan", {}).get("calls", 0)
        read()
        return client.info("commandstats").get("cmdstat_scan", {}).get("calls", 0) - before

    for read in (lambda: reads.overview(client, KEYS, found=directory.found()),
                 lambda: reads.workers(client, KEYS, found=directory.found()),
                 lambda: reads.jobs(client, KEYS, found=directory.found()),
                 lambda: reads.job(client, KEYS, "j0", found=directory.found())):
        assert scans(read) == 0
    assert [w.name for w in reads.workers(client, KEYS, found=found).live] == ["w1"]

    worker_key(client, "w2", "m2", ttl_ms=60_000)  # a new worker and a new model's stream
    new = queue(client, KEYS.jobs_of("m2"), 1, prefix="n")
    assert reads.job(client, KEYS, new[0], found=found).fields["id"] == "n0"  # found afresh
    wait_for(lambda: KEYS.worker("w2") in directory.found().workers
             and KEYS.jobs_of("m2") in directory.found().streams, timeout=10,
             what="the directory to find the new keys")
    client.delete(KEYS.worker("w1"))  # gone: shown gone at once (read by name)
    assert [w.name for w in reads.workers(client, KEYS, found=found).live] == []


def test_the_directory_s_thread_ends_when_nobody_looks_and_the_next_page_starts_another(
        client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dashboard nobody looks at (or one whose app is gone) leaves no thread behind."""
    from qworker_client.dashboard import directory as module

    monkeypatch.setattr(module, "IDLE_S", 0.2)
    directory = module.Directory(client, KEYS, refresh_s=0.05)
    directory.found()
    first = directory._thread
    assert first is not None and first.is_alive()
    first.join(timeout=5)
    assert not first.is_alive() and directory._thread is None
    directory.found()
    assert directory._thread is not None and directory._thread is not first
    assert directory._thread.is_alive()
