"""Helpers of the service tests: submit jobs, read their streams, run workers (threads or
processes) on the simulated engine, and compute what an uninterrupted run would print."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import redis

from qworker.engine.config import EngineConfig
from qworker.engine.request import Request
from qworker.engine.simulated import SimulatedEngine, run_offline
from qworker.service.config import ServiceConfig
from qworker.service.worker import Worker, sampling_params
from qworker_client.protocol import (
    DoneEvent,
    ErrorEvent,
    Keys,
    TokenEvent,
    parse_event,
    parse_job_fields,
)
from tests import internal_errors

KEYS = Keys("qw")
ROOT = Path(__file__).resolve().parent.parent


def wait_for(cond: Callable[[], Any], timeout: float = 30.0, interval: float = 0.02,
             what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def submit(client: redis.Redis, job_id: str, **fields: Any) -> str:
    wire = {"id": job_id}
    for k, v in fields.items():
        wire[k] = v if isinstance(v, str) else (str(v).lower() if isinstance(v, bool) else str(v))
    client.xadd(KEYS.jobs, wire)
    return job_id


def events(client: redis.Redis, job_id: str, keys: Keys = KEYS
           ) -> list[TokenEvent | DoneEvent | ErrorEvent]:
    return [parse_event(f) for _, f in client.xrange(keys.out(job_id))]


def terminal(client: redis.Redis, job_id: str, keys: Keys = KEYS
             ) -> DoneEvent | ErrorEvent | None:
    last = client.xrevrange(keys.out(job_id), count=1)
    if not last:
        return None
    ev = parse_event(last[0][1])
    return ev if isinstance(ev, (DoneEvent, ErrorEvent)) else None


def wait_terminal(client: redis.Redis, ids: Iterable[str], timeout: float = 60.0,
                  keys: Keys = KEYS) -> dict[str, DoneEvent | ErrorEvent]:
    ids = list(ids)

    def all_done() -> dict[str, DoneEvent | ErrorEvent] | None:
        got = {i: terminal(client, i, keys) for i in ids}
        return got if all(v is not None for v in got.values()) else None

    return wait_for(all_done, timeout, what=f"{len(ids)} jobs to finish")


def check_stream(client: redis.Redis, job_id: str, keys: Keys = KEYS) -> DoneEvent:
    """Indices 0..n-1 exactly once, one terminal `done` last, joined texts == final text."""
    evs = events(client, job_id, keys)
    assert evs and isinstance(evs[-1], DoneEvent), (job_id, evs[-3:])
    tokens = evs[:-1]
    assert all(isinstance(e, TokenEvent) for e in tokens), job_id
    assert [e.i for e in tokens] == list(range(len(tokens))), (job_id, [e.i for e in tokens])
    done = evs[-1]
    assert "".join(e.text for e in tokens) == done.text, job_id
    assert done.completion_tokens == len(tokens), job_id
    return done


def expected(jobs: dict[str, dict[str, Any]], model: str = "sim:step_ms=0"
             ) -> dict[str, tuple[str, str | None]]:
    """(text, finish_reason) of each job in an uninterrupted run with a roomy KV cache."""
    engine = SimulatedEngine.from_config(EngineConfig(model=model, num_blocks=100_000))
    requests = []
    for job_id, fields in jobs.items():
        wire = {k: v if isinstance(v, str) else str(v) for k, v in {"id": job_id, **fields}.items()}
        job = parse_job_fields(wire, "0-1")
        prompt = engine.tokenizer.encode(job.prompt or "")
        requests.append(Request(job_id, prompt, sampling_params(job, job_id)))
    return {k: (r.text, r.finish_reason) for k, r in run_offline(engine, requests).items()}


def sim_engine(model: str = "sim:step_ms=2", **config: Any) -> SimulatedEngine:
    return SimulatedEngine.from_config(EngineConfig(model=model, requeue_preempted=True, **config))


@dataclass
class ThreadWorker:
    worker: Worker
    thread: threading.Thread
    result: list[int]

    def stop(self, timeout: float = 30.0) -> int:
        self.worker.request_stop()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "worker thread did not stop"
        return self.result[0]


@contextmanager
def thread_worker(url: str, name: str, engine: SimulatedEngine | None = None,
                  **config: Any) -> Iterator[ThreadWorker]:
    """A worker in a thread of this process; stopped (drained) on exit."""
    cfg = ServiceConfig(redis_url=url, name=name, **{"model": "sim", **config})
    worker = Worker(engine or sim_engine(), cfg)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(worker.run()), name=name, daemon=True)
    thread.start()
    tw = ThreadWorker(worker, thread, result)
    try:
        yield tw
    finally:
        if thread.is_alive():
            worker.request_stop()
            worker.request_stop()
            thread.join(30)


def commands_per_job(url: str, jobs: list[dict[str, str]], **config: Any) -> float:
    """Redis commands (those scripts run included) one worker of 8 slots on the simulated engine
    spends a job, taking `jobs` (queued before it starts) through to their ends."""
    client = redis.Redis.from_url(url)
    client.flushall()
    for fields in jobs:
        client.xadd(KEYS.jobs, fields)  # type: ignore[arg-type]
    client.config_resetstat()
    polls = 0  # this function's own commands (XLEN, INFO) are not counted
    with thread_worker(url, "counted", sim_engine("sim:step_ms=1", max_num_seqs=8),
                       claim_idle_ms=60_000, **config) as w:  # no beats meanwhile
        deadline = time.monotonic() + 60
        while client.xlen(KEYS.recent) < len(jobs) and time.monotonic() < deadline:
            polls += 1
            time.sleep(0.01)
        spent = _commands(client) - polls - 1
        assert w.stop() == 0
    assert len(dict(client.xrange(KEYS.recent))) == len(jobs)
    client.close()
    return spent / len(jobs)


def _commands(client: redis.Redis) -> int:
    stats: dict[str, Any] = client.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k != "cmdstat_info")


def spawn_worker(url: str, name: str, *args: str, log_path: Path | None = None
                 ) -> subprocess.Popen[bytes]:
    """`qworker serve` in a subprocess, logging to `log_path` (else a file of its own), where
    `internal_errors` looks for failed jobs."""
    cmd = [sys.executable, "-m", "qworker.cli", "serve", "--redis-url", url, "--name", name,
           *args]
    out = open(internal_errors.worker_log(log_path), "wb")  # noqa: SIM115
    return subprocess.Popen(cmd, stdout=out, stderr=out, cwd=ROOT, env=checkout_env())


def checkout_env() -> dict[str, str]:
    """This process' environment with this checkout's packages first on the path, the worker's
    and the client's (an editable install may point at another checkout)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "producer")])}


def stop_process(proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        proc.wait(30)


def work_streams(client: redis.Redis) -> list[str]:
    """Every job and requeue stream: the model-less ones, then each model's."""
    found = {_text(key) for pattern in KEYS.model_stream_patterns
             for key in client.scan_iter(match=pattern, _type="stream")}
    return [*KEYS.streams, *sorted(found - set(KEYS.streams))]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def group_pending(client: redis.Redis) -> int:
    total = 0
    for stream in work_streams(client):
        with suppress(redis.ResponseError):
            total += client.xpending(stream, "workers")["pending"]
    return total


def owners_by_job(client: redis.Redis, ids: Iterable[str]) -> dict[str, str]:
    return {i: (client.hget(KEYS.owner(i), "worker") or b"").decode() for i in ids}


__all__ = ["KEYS", "replace"]


def spy(engine: SimulatedEngine) -> list[str]:
    """The job ids the engine is given, in order (filled as it runs)."""
    added: list[str] = []
    original = engine.add

    def add(request: Request) -> None:
        added.append(request.request_id)
        original(request)

    engine.add = add  # type: ignore[method-assign]
    return added
