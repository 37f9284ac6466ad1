"""Delayed and time-limited jobs on a real redis-server and simulated workers: `delay_ms` and
`not_before_ms` (deferred to a sorted set, queued again by the workers' promoter: never early, at
most a poll late on an idle worker), `start_within_ms` beside `deadline_ms`, `timeout_ms` (ends
`timeout` with its text so far) and `result_ttl_s` within the workers' `--max-result-ttl`."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.crc import key_slot

from qworker_client import Producer
from qworker_client.cli import main
from qworker_client.jobs import server_ms
from qworker_client.protocol import BANDS, DoneEvent, ErrorEvent, TokenEvent, entry_ms
from tests.service_harness import (
    KEYS,
    ROOT,
    check_stream,
    checkout_env,
    sim_engine,
    stop_process,
    thread_worker,
    wait_for,
    wait_terminal,
)
from tests.worker_process import sim_worker


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url, decode_responses=True)
    yield c
    c.close()


def first_token_ms(client: redis.Redis, job_id: str) -> int:
    """When the job's first token was written (its entry's time, by Redis' clock)."""
    entry_id, _ = client.xrange(KEYS.out(job_id), count=1)[0]
    ms = entry_ms(entry_id)
    assert ms is not None
    return ms


def test_delayed_jobs_run_no_sooner_than_their_time_and_at_most_a_poll_late(
        redis_url: str, client: redis.Redis, capsys: pytest.CaptureFixture[str]) -> None:
    with thread_worker(redis_url, "idle", sim_engine("sim:step_ms=2")), \
            Producer(redis_url) as prod:
        wait_for(lambda: client.exists(KEYS.worker("idle")), what="the worker")
        now = server_ms(client)
        due = {"soon": prod.submit("a", id="soon", max_tokens=2, delay_ms=300),
               "later": prod.submit("b", id="later", max_tokens=2, delay_ms=1200),
               "at": prod.submit("c", id="at", max_tokens=2, not_before_ms=now + 700),
               "past": prod.submit("d", id="past", max_tokens=2, not_before_ms=now - 5000)}
        # any language: a plain XADD with the field
        raw = client.xadd(KEYS.jobs, {"id": "raw", "prompt": "e", "max_tokens": "2",
                                      "delay_ms": "500"})
        times = {job_id: entry_ms(job.entry_id or "") or 0 for job_id, job in due.items()}
        wanted = {"soon": times["soon"] + 300, "later": times["later"] + 1200, "at": now + 700,
                  "past": times["past"], "raw": (entry_ms(raw) or 0) + 500}
        wait_for(lambda: client.zcard(KEYS.delayed_of(None)) >= 3, what="the delayed set")
        main(["jobs", "--json", "--status", "delayed", "--redis-url", redis_url])
        listed = [json.loads(line) for line in capsys.readouterr().out.splitlines()
                  if line.startswith("{")]
        ended = wait_terminal(client, wanted, timeout=30)
    assert {row["id"] for row in listed} <= {"soon", "later", "at", "raw"} and listed
    assert all(row["since_ms"] == wanted[row["id"]] for row in listed)
    late = {}
    for job_id, due_ms in wanted.items():
        assert isinstance(ended[job_id], DoneEvent), (job_id, ended[job_id])
        check_stream(client, job_id)
        late[job_id] = first_token_ms(client, job_id) - due_ms
    assert all(0 <= ms < 1000 for ms in late.values()), late
    print(f"\ndelayed jobs on an idle worker, first token after their time (ms): {late}")
    assert client.zcard(KEYS.delayed_of(None)) == 0
    assert client.hlen(KEYS.delayed_jobs_of(None)) == 0


def test_a_delayed_job_of_a_model_keeps_its_model_its_band_and_its_slot(
        redis_url: str, client: redis.Redis) -> None:
    stream = KEYS.jobs_of("sim", "high")
    with thread_worker(redis_url, "m", sim_engine("sim:step_ms=2")), \
            Producer(redis_url) as prod:
        job = prod.submit("p", id="urgent-later", model="sim", priority=-3, max_tokens=2,
                          delay_ms=600)
        assert client.xrange(stream)[0][1]["delay_ms"] == "600"  # queued like any job
        stored = wait_for(lambda: client.hget(KEYS.delayed_jobs_of("sim"), job.id),
                          what="the job to be delayed")
        assert client.zscore(KEYS.delayed_of("sim"), job.id) is not None
        done = wait_terminal(client, [job.id])[job.id]
    assert isinstance(done, DoneEvent)
    band, *flat = json.loads(stored)
    assert band == "high" and dict(zip(flat[::2], flat[1::2], strict=True)) == {
        "id": "urgent-later", "model": "sim", "priority": "-3", "max_tokens": "2",
        "prompt": "p"}  # as queued, but the delay
    # the scripts' keys of one model: one Redis Cluster slot
    keys = [KEYS.delayed_of("sim"), KEYS.delayed_jobs_of("sim"),
            *(KEYS.jobs_of("sim", band) for band in BANDS)]
    assert len({key_slot(key.encode()) for key in keys}) == 1


def test_start_within_ms_is_counted_from_queueing_or_from_a_delayed_job_s_time(
        redis_url: str, client: redis.Redis) -> None:
    engine = sim_engine("sim:step_ms=5", max_num_seqs=1)
    with thread_worker(redis_url, "s", engine) as w:
        client.xadd(KEYS.jobs, {"id": "hog", "prompt": "p", "max_tokens": "120",
                                "ignore_eos": "true"})
        wait_for(lambda: client.xlen(KEYS.out("hog")) >= 1, what="hog to start")
        client.xadd(KEYS.jobs, {"id": "impatient", "prompt": "p", "max_tokens": "2",
                                "start_within_ms": "100"})
        client.xadd(KEYS.jobs, {"id": "patient", "prompt": "p", "max_tokens": "2",
                                "start_within_ms": "60000"})
        client.xadd(KEYS.jobs, {"id": "delayed", "prompt": "p", "max_tokens": "2",
                                "delay_ms": "1500", "start_within_ms": "800"})
        ended = wait_terminal(client, ["hog", "impatient", "patient", "delayed"])
        assert w.stop() == 0
    impatient = ended["impatient"]
    assert isinstance(impatient, ErrorEvent) and impatient.code == "expired"
    assert "start_within_ms 100" in impatient.message
    assert isinstance(ended["patient"], DoneEvent)
    assert isinstance(ended["delayed"], DoneEvent)  # 1.5 s after queueing, but on time


def test_timeout_ms_ends_a_job_with_its_text_so_far(redis_url: str, client: redis.Redis) -> None:
    with thread_worker(redis_url, "t", sim_engine("sim:step_ms=5")) as w:
        client.xadd(KEYS.jobs, {"id": "slow", "prompt": "p", "max_tokens": "20000",
                                "ignore_eos": "true", "timeout_ms": "400"})
        client.xadd(KEYS.jobs, {"id": "quick", "prompt": "p", "max_tokens": "3",
                                "timeout_ms": "60000"})
        ended = wait_terminal(client, ["slow", "quick"], timeout=20)
        assert w.stop() == 0
    slow = check_stream(client, "slow")
    assert slow.finish_reason == "timeout" and 0 < slow.completion_tokens < 20000
    assert slow.text == "".join(e.text for e in _tokens(client, "slow"))
    assert 400 <= slow.total_ms < 5000
    assert isinstance(ended["quick"], DoneEvent) and ended["quick"].finish_reason == "length"


def _tokens(client: redis.Redis, job_id: str) -> list[TokenEvent]:
    from tests.service_harness import events

    return [e for e in events(client, job_id) if isinstance(e, TokenEvent)]


def test_result_ttl_s_within_the_workers_maximum(redis_url: str, client: redis.Redis) -> None:
    with thread_worker(redis_url, "ttl", sim_engine("sim:step_ms=1"), result_ttl=100,
                       max_result_ttl=200) as w:
        for job_id, fields in {"default": {}, "short": {"result_ttl_s": "5"},
                               "long": {"result_ttl_s": "100000"},
                               "late": {"result_ttl_s": "7", "deadline_ms": "1"}}.items():
            client.xadd(KEYS.jobs, {"id": job_id, "prompt": "p", "max_tokens": "2", **fields})
        ended = wait_terminal(client, ["default", "short", "long", "late"])
        assert w.stop() == 0
    assert isinstance(ended["late"], ErrorEvent) and ended["late"].code == "expired"
    ttl = {job_id: client.ttl(KEYS.out(job_id)) for job_id in ended}
    assert 90 < ttl["default"] <= 100 and 0 < ttl["short"] <= 5
    assert 190 < ttl["long"] <= 200 and 0 < ttl["late"] <= 7


def test_submit_takes_the_new_fields_and_says_what_deadline_ms_is(
        redis_url: str, client: redis.Redis, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["submit", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--deadline-ms DEADLINE_MS absolute start deadline, unix time in ms" in help_text
    for flag in ("--start-within-ms", "--delay-ms", "--not-before-ms", "--timeout-ms",
                 "--result-ttl-s"):
        assert flag in help_text
    assert main(["submit", "p", "--no-wait", "--id", "x1", "--delay-ms", "5000",
                 "--start-within-ms", "9", "--timeout-ms", "8", "--result-ttl-s", "7",
                 "--redis-url", redis_url]) == 0
    fields = client.xrange(KEYS.jobs)[0][1]
    assert {k: fields[k] for k in ("delay_ms", "start_within_ms", "timeout_ms",
                                   "result_ttl_s")} == {"delay_ms": "5000",
                                                        "start_within_ms": "9",
                                                        "timeout_ms": "8", "result_ttl_s": "7"}


def test_a_thousand_delayed_jobs_each_run_once_on_time_though_a_worker_dies_promoting(
        redis_url: str, client: redis.Redis, tmp_path: Path) -> None:
    """Two worker processes; one dies (SIGKILL) inside its first promote call that has jobs to
    move. Each job is queued again exactly once (the job stream's entries-added: 1,000 submits
    and 1,000 promotions), runs once (one clean stream each), none before its time, none more
    than 1 s late."""
    crash_log = tmp_path / "crashes.log"
    dying = subprocess.Popen(
        [sys.executable, "-m", "tests.promote_crash_worker", redis_url, "dying", str(crash_log)],
        cwd=ROOT, env=checkout_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with sim_worker(redis_url, "survivor", "--claim-idle-ms", "300",
                        model="sim:step_ms=1"):
            wait_for(lambda: client.exists(KEYS.worker("dying")), 60, what="the dying worker")
            with Producer(redis_url) as prod:
                jobs = prod.submit_many([{"prompt": f"job {k}", "id": f"j{k}", "max_tokens": 1,
                                          "delay_ms": 1500 + 2 * k} for k in range(1000)])
            due = {job.id: (entry_ms(job.entry_id or "") or 0) + 1500 + 2 * k
                   for k, job in enumerate(jobs)}
            assert dying.wait(30) == -signal.SIGKILL
            ended = wait_terminal(client, due, timeout=60)
    finally:
        stop_process(dying)
    died = crash_log.read_text().split()
    assert died[0] == "dying" and int(died[1]) > 0  # it died with jobs to move
    assert all(isinstance(event, DoneEvent) for event in ended.values())
    late = {}
    for job_id, due_ms in due.items():
        check_stream(client, job_id)
        late[job_id] = first_token_ms(client, job_id) - due_ms
    assert min(late.values()) >= 0, min(late.items(), key=lambda kv: kv[1])
    assert max(late.values()) < 1000, max(late.items(), key=lambda kv: kv[1])
    assert client.xinfo_stream(KEYS.jobs)["entries-added"] == 2000
    assert client.zcard(KEYS.delayed_of(None)) == 0 and client.xlen(KEYS.dead) == 0
    print(f"\n1,000 delayed jobs, a worker killed promoting: lateness of the first token "
          f"median {sorted(late.values())[500]} ms, max {max(late.values())} ms")
