"""Redis forgets what the workers rely on, against a real redis-server: `FLUSHALL` or `DEL` of the
job stream under an idle and a busy worker, an `XTRIM` of entries still pending, a restart with no
data, and a Redis out of memory. No worker exits; the next job is answered; a job whose state
vanished ends with `error` `lost_state` (so its readers end), one whose state is intact finishes.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis
from structlog.testing import capture_logs

from qworker_client.local_redis import RedisProcess
from qworker_client.protocol import LOST_STATE, DoneEvent, ErrorEvent
from tests.service_harness import (
    KEYS,
    check_stream,
    events,
    expected,
    group_pending,
    sim_engine,
    submit,
    terminal,
    thread_worker,
    wait_for,
    wait_terminal,
)

RECREATED = "consumer group missing, recreated"


def _blocked(client: redis.Redis, name: str) -> bool:
    """The worker `name` waits in its blocking read now (XREAD with fair share: it takes
    nothing, XREADGROUP without)."""
    return any(c.get("name") == f"qworker:{name}" and c.get("cmd") in ("xread", "xreadgroup")
               and "b" in c.get("flags", "") for c in client.client_list())


def _answered(client: redis.Redis, prefix: str, n: int = 2) -> None:
    jobs = {f"{prefix}{k}": {"prompt": f"after {k}", "max_tokens": 8} for k in range(n)}
    for job_id, fields in jobs.items():
        submit(client, job_id, **fields)
    wait_terminal(client, jobs, timeout=20)
    want = expected(jobs)
    for job_id in jobs:
        assert (check_stream(client, job_id).text, "length") == want[job_id], job_id


@pytest.mark.parametrize("wipe", [("FLUSHALL",), ("DEL", KEYS.jobs)], ids=["flushall", "del"])
def test_idle_and_busy_workers_survive_a_wiped_job_stream(redis_url: str,
                                                          wipe: tuple[str, ...]) -> None:
    client = redis.Redis.from_url(redis_url)
    running = {"running": {"prompt": "wiped under me", "max_tokens": 300}}
    with capture_logs() as logs, \
            thread_worker(redis_url, "busy", sim_engine("sim:step_ms=10", max_num_seqs=1)) as busy:
        submit(client, "running", **running["running"])
        wait_for(lambda: client.xlen(KEYS.out("running")) >= 5, what="tokens of the busy worker")
        with thread_worker(redis_url, "idle", sim_engine("sim:step_ms=2")) as idle:
            wait_for(lambda: _blocked(client, "idle"), what="the idle worker's blocked read")
            assert terminal(client, "running") is None  # still running when it is wiped
            client.execute_command(*wipe)
            ended = wait_terminal(client, running, timeout=20)["running"]
            _answered(client, "after")
            assert idle.thread.is_alive() and busy.thread.is_alive()
            assert idle.stop() == 0
        assert busy.stop() == 0
    if wipe[0] == "FLUSHALL":  # the owner hash and every token went: the job cannot finish
        assert isinstance(ended, ErrorEvent) and ended.code == LOST_STATE, ended
        assert events(client, "running") == [ended]  # a new stream: only the error
        assert busy.worker.metrics.jobs_failed.labels(LOST_STATE)._value.get() == 1
    else:  # only its entry went: the worker holds the job and finishes it
        assert isinstance(ended, DoneEvent), ended
        assert check_stream(client, "running").text == expected(running)["running"][0]
    assert sum(line["event"] == RECREATED for line in logs) >= 1
    assert sum(line["event"] == RECREATED and line["worker"] == "idle" for line in logs) <= 1
    assert group_pending(client) == 0


def test_an_empty_restart_ends_the_jobs_in_flight_with_lost_state(tmp_path: Path) -> None:
    server = RedisProcess(tmp_path, ("--save", "", "--appendonly", "no"))
    server.start()
    try:
        client = redis.Redis.from_url(server.url)
        jobs = {f"gone{k}": {"prompt": f"forgotten {k}", "max_tokens": 400} for k in range(3)}
        with thread_worker(server.url, "survivor", sim_engine("sim:step_ms=10"),
                           backoff_max_s=0.2) as w:
            for job_id, fields in jobs.items():
                submit(client, job_id, **fields)
            wait_for(lambda: all(client.xlen(KEYS.out(j)) >= 3 for j in jobs), what="tokens")
            assert not any(terminal(client, j) for j in jobs)
            server.restart()  # no persistence: it comes back empty, scripts included
            got = wait_terminal(client, jobs, timeout=15)
            _answered(client, "next")
            assert w.stop() == 0
        for job_id, event in got.items():
            assert isinstance(event, ErrorEvent) and event.code == LOST_STATE, (job_id, event)
            assert "vanished" in event.message
    finally:
        server.stop()


def test_trimmed_entries_of_running_jobs_still_finish_through_preemptions(redis_url: str) -> None:
    """`XTRIM` deletes entries that are still pending; the heartbeat's re-claim then drops them
    from the group. A job preempted after that is requeued all the same, and every job finishes
    with its whole text."""
    client = redis.Redis.from_url(redis_url)
    jobs = {f"trim{k}": {"prompt": f"trimmed {k}", "max_tokens": 120} for k in range(4)}
    # 4 jobs that grow to 33 blocks each in 36 blocks: preempted over and over
    tiny = sim_engine("sim:step_ms=10", num_blocks=36, block_size=4, max_num_seqs=4)
    with thread_worker(redis_url, "trimmed", tiny, claim_idle_ms=200) as w:
        for job_id, fields in jobs.items():
            submit(client, job_id, **fields)
        wait_for(lambda: group_pending(client) == len(jobs), what="all jobs taken")
        client.xtrim(KEYS.jobs, maxlen=0)
        got = wait_terminal(client, jobs, timeout=60)
        assert w.stop() == 0
    assert w.worker.metrics.preemptions._value.get() > 0
    want = expected(jobs)
    for job_id, event in got.items():
        assert isinstance(event, DoneEvent), (job_id, event)
        assert (check_stream(client, job_id).text, "length") == want[job_id], job_id


def test_out_of_memory_backs_off_more_and_more(tmp_path: Path) -> None:
    """Redis at `maxmemory` refuses every write: the worker retries with a wait that doubles
    (up to --backoff-max-s), not at the shortest wait forever, and finishes once Redis has room."""
    server = RedisProcess(tmp_path, ("--save", "", "--appendonly", "no"))
    server.start()
    try:
        client = redis.Redis.from_url(server.url)
        job = {"full": {"prompt": "no room", "max_tokens": 60}}
        engine = sim_engine("sim:step_ms=5")
        with capture_logs() as logs, \
                thread_worker(server.url, "oom", engine, backoff_max_s=1.0) as w:
            submit(client, "full", **job["full"])
            wait_for(lambda: client.xlen(KEYS.out("full")) >= 2, what="tokens")
            client.config_set("maxmemory", 1)
            wait_for(lambda: w.worker.metrics.redis_errors._value.get() >= 1, what="an OOM")
            first, lines = w.worker.metrics.redis_errors._value.get(), len(logs)
            time.sleep(3.0)
            retries = w.worker.metrics.redis_errors._value.get() - first
            said = [line for line in logs[lines:] if line["event"] == "redis unavailable, retrying"]
            delay = w.worker.backoff.delay
            client.config_set("maxmemory", 0)
            wait_terminal(client, job, timeout=15)
            assert w.stop() == 0
        # doubling from 0.05 s to 1 s takes 5 retries, then one every 0.5-1 s: at most ~9
        assert retries <= 12 and len(said) <= 12 and delay == 1.0, (retries, len(said), delay)
        assert "maxmemory" in said[0]["error"]
        assert check_stream(client, "full").text == expected(job)["full"][0]
    finally:
        server.stop()


def test_a_dead_worker_s_trimmed_entry_is_said_when_reclaimed(redis_url: str) -> None:
    """An entry trimmed while a dead worker held it is dropped from the group by the XCLAIM that
    would have reclaimed it; the job cannot be named (its id was in the entry), but the worker
    says which entry went, instead of nothing."""
    client = redis.Redis.from_url(redis_url)
    client.xgroup_create(KEYS.jobs, "workers", id="0", mkstream=True)
    entry = client.xadd(KEYS.jobs, {"id": "ghostly", "prompt": "x"}).decode()
    client.xreadgroup("workers", "ghost", {KEYS.jobs: ">"})  # a worker that then died
    client.xtrim(KEYS.jobs, maxlen=0)
    with capture_logs() as logs, \
            thread_worker(redis_url, "heir", claim_idle_ms=100, block_ms=100) as w:
        said = wait_for(lambda: [line for line in logs if line["event"].startswith(
            "pending entries deleted")], timeout=10, what="the deleted entry said")
        assert w.stop() == 0
    assert said[0]["entries"] == [entry] and said[0]["stream"] == KEYS.jobs
    assert group_pending(client) == 0
