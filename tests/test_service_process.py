"""Workers as processes (`qworker serve --model sim:...`): kill -9, SIGTERM drain, and a Redis
restart under a running worker."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import redis

from qworker_client.protocol import WorkerInfo
from tests.conftest import RedisServer
from tests.service_harness import (
    KEYS,
    check_stream,
    expected,
    group_pending,
    owners_by_job,
    sim_engine,
    spawn_worker,
    stop_process,
    submit,
    terminal,
    thread_worker,
    wait_for,
    wait_terminal,
)

SIM = ["--model", "sim:step_ms=5", "--claim-idle-ms", "1000", "--max-num-seqs", "4"]


def _jobs(n: int, max_tokens: int) -> dict[str, dict[str, object]]:
    return {f"p{k}": {"prompt": f"process job {k}", "max_tokens": max_tokens + k}
            for k in range(n)}


def _alive(client: redis.Redis, name: str) -> bool:
    return bool(client.exists(KEYS.worker(name)))


def _mid_run(client: redis.Redis, jobs: dict, owner_prefix: str) -> list[str]:
    """Jobs the named worker owns that have tokens out but are not finished."""
    owners = owners_by_job(client, jobs)
    return [j for j, o in owners.items() if o.startswith(owner_prefix + "/")
            and client.xlen(KEYS.out(j)) > 0 and terminal(client, j) is None]


def test_kill_9_one_of_two_workers_every_job_still_finishes_once(
        redis_url: str, tmp_path: Path) -> None:
    client = redis.Redis.from_url(redis_url)
    jobs = _jobs(12, max_tokens=80)
    want = expected(jobs)
    victim = spawn_worker(redis_url, "victim", *SIM, log_path=tmp_path / "victim.log")
    try:
        wait_for(lambda: _alive(client, "victim"), 30, what="victim up")
        with thread_worker(redis_url, "survivor", sim_engine("sim:step_ms=5", max_num_seqs=4),
                           claim_idle_ms=1000) as survivor:
            for job_id, fields in jobs.items():
                submit(client, job_id, **fields)
            wait_for(lambda: len(_mid_run(client, jobs, "victim")) >= 2, 30,
                     what="victim mid-run")
            victim.send_signal(signal.SIGKILL)
            victim.wait(10)
            wait_terminal(client, jobs, timeout=60)
            assert survivor.worker.metrics.reclaimed._value.get() >= 2
            assert survivor.worker.metrics.resumed_tokens._value.get() > 0  # resumed, not rerun
            assert survivor.stop() == 0
    finally:
        stop_process(victim)
    for job_id in jobs:
        done = check_stream(client, job_id)
        assert (done.text, done.finish_reason) == want[job_id], job_id
    assert group_pending(client) == 0


def test_sigterm_drains_then_requeues_and_another_worker_finishes(
        redis_url: str, tmp_path: Path) -> None:
    client = redis.Redis.from_url(redis_url)
    jobs = _jobs(6, max_tokens=1000)  # ~5 s each at 5 ms a step: cannot finish in the drain
    jobs["short"] = {"prompt": "finishes during the drain", "max_tokens": 120}
    want = expected(jobs)
    proc = spawn_worker(redis_url, "drainer", *SIM[:-1], "8", "--drain-timeout", "2",
                        log_path=tmp_path / "drainer.log")
    try:
        wait_for(lambda: _alive(client, "drainer"), 30, what="drainer up")
        for job_id, fields in jobs.items():
            submit(client, job_id, **fields)
        wait_for(lambda: len(_mid_run(client, jobs, "drainer")) == len(jobs), 30,
                 what="all jobs running")
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        assert time.monotonic() - sent < 2 + 3
    finally:
        stop_process(proc)
    assert check_stream(client, "short").text == want["short"][0]  # finished while draining
    assert client.xlen(KEYS.requeue) == len(jobs) - 1
    assert not client.exists(KEYS.worker("drainer"))
    with thread_worker(redis_url, "finisher", sim_engine("sim:step_ms=1", max_num_seqs=8)) as w:
        wait_terminal(client, jobs, timeout=60)
        assert w.worker.metrics.resumed_tokens._value.get() >= 6 * 20
        assert w.stop() == 0
    for job_id in jobs:
        done = check_stream(client, job_id)
        assert (done.text, done.finish_reason) == want[job_id], job_id
    assert group_pending(client) == 0 and client.xlen(KEYS.requeue) == 0


def test_second_signal_requeues_at_once(redis_url: str, tmp_path: Path) -> None:
    client = redis.Redis.from_url(redis_url)
    jobs = _jobs(2, max_tokens=3000)
    proc = spawn_worker(redis_url, "impatient", *SIM, "--drain-timeout", "60",
                        log_path=tmp_path / "impatient.log")
    try:
        wait_for(lambda: _alive(client, "impatient"), 30, what="worker up")
        for job_id, fields in jobs.items():
            submit(client, job_id, **fields)
        wait_for(lambda: len(_mid_run(client, jobs, "impatient")) == 2, 30, what="running")
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: WorkerInfo.model_validate_json(
            client.get(KEYS.worker("impatient"))).draining, 10, what="draining")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 0
        assert time.monotonic() - sent < 5
    finally:
        stop_process(proc)
    assert client.xlen(KEYS.requeue) == 2 and group_pending(client) == 0


def test_redis_restart_under_a_running_worker(redis_server: RedisServer, redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    jobs = _jobs(8, max_tokens=150)
    want = expected(jobs)
    with thread_worker(redis_url, "steady", sim_engine("sim:step_ms=5", max_num_seqs=8),
                       claim_idle_ms=2000) as w:
        for job_id, fields in jobs.items():
            submit(client, job_id, **fields)
        wait_for(lambda: all(client.xlen(KEYS.out(j)) >= 10 for j in jobs), 30, what="progress")
        redis_server.restart()
        client = redis.Redis.from_url(redis_url)
        wait_terminal(client, jobs, timeout=60)
        assert w.worker.metrics.redis_errors._value.get() >= 1
        assert w.stop() == 0
    for job_id in jobs:
        done = check_stream(client, job_id)
        assert (done.text, done.finish_reason) == want[job_id], job_id
    assert group_pending(client) == 0


def test_stalled_worker_is_fenced_out_after_its_jobs_are_reclaimed(
        redis_url: str, tmp_path: Path) -> None:
    client = redis.Redis.from_url(redis_url)
    jobs = _jobs(8, max_tokens=200)
    want = expected(jobs)
    log = tmp_path / "zombie.log"
    zombie = spawn_worker(redis_url, "zombie", *SIM, log_path=log)
    try:
        wait_for(lambda: _alive(client, "zombie"), 30, what="zombie up")
        for job_id, fields in jobs.items():
            submit(client, job_id, **fields)
        stalled = wait_for(lambda: _mid_run(client, jobs, "zombie"), 30, what="zombie mid-run")
        zombie.send_signal(signal.SIGSTOP)
        with thread_worker(redis_url, "heir", sim_engine("sim:step_ms=5", max_num_seqs=8),
                           claim_idle_ms=1000) as heir:
            wait_for(lambda: all(o.startswith("heir/") or terminal(client, j)
                                 for j, o in owners_by_job(client, stalled).items()),
                     30, what="heir owns the stalled jobs")
            zombie.send_signal(signal.SIGCONT)
            wait_terminal(client, jobs, timeout=60)
            assert heir.stop() == 0
        wait_for(lambda: b"fenced out: another worker owns the job" in log.read_bytes(), 10,
                 what="zombie drops a job")
        zombie.send_signal(signal.SIGTERM)
        assert zombie.wait(10) == 0
    finally:
        if zombie.poll() is None:
            zombie.send_signal(signal.SIGCONT)
        stop_process(zombie)
    for job_id in jobs:
        done = check_stream(client, job_id)
        assert (done.text, done.finish_reason) == want[job_id], job_id
    assert group_pending(client) == 0


def test_worker_started_before_redis_waits_for_it(tmp_path: Path) -> None:
    server = RedisServer(tmp_path)
    with thread_worker(server.url, "early", backoff_max_s=0.2) as w:
        wait_for(lambda: w.worker.metrics.redis_errors._value.get() >= 2, 10, what="retries")
        server.start()
        try:
            client = redis.Redis.from_url(server.url)
            submit(client, "late", prompt="finally", max_tokens=5)
            wait_terminal(client, ["late"], timeout=20)
            assert w.stop() == 0
            check_stream(client, "late")
        finally:
            server.stop()
