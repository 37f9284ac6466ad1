"""Prometheus metrics and the health endpoints, scraped over HTTP from running workers."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from prometheus_client.parser import text_string_to_metric_families

from qworker.engine.request import StepOutput
from qworker.engine.simulated import SimulatedEngine
from qworker.service.config import ServiceConfig
from qworker.service.metrics import Metrics, engine_stats
from qworker.service.worker import Worker
from tests.conftest import RedisServer, free_port
from tests.service_harness import (
    check_stream,
    sim_engine,
    spawn_worker,
    stop_process,
    submit,
    wait_for,
    wait_terminal,
)

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def scrape_until(port: int, cond: Any, timeout: float, what: str) -> Samples:
    """The first scrape for which `cond(samples)` holds."""
    def attempt() -> Samples | None:
        samples = scrape(port)
        return samples if cond(samples) else None

    return wait_for(attempt, timeout, interval=0.01, what=what)


def health(port: int, path: str = "/healthz") -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())
    except (urllib.error.URLError, ConnectionError):
        return 0, {}


def test_a_scrape_during_a_run_sees_every_metric_move(redis_url: str, tmp_path: Path) -> None:
    port = free_port()
    # a small KV cache (24 blocks of 4 tokens) so that long jobs preempt each other
    model = "sim:step_ms=4,num_blocks=24,block_size=4"
    proc = spawn_worker(redis_url, "metrics-1", "--model", model, "--metrics-port", str(port),
                        log_path=tmp_path / "worker.log")
    client = redis.Redis.from_url(redis_url)
    try:
        wait_for(lambda: health(port)[0] == 200, 60, what="/healthz to answer 200")
        ids = [submit(client, f"m{i}", prompt=f"prompt {i}", max_tokens=30, seed=i)
               for i in range(6)]
        submit(client, "bad", prompt="x", colour="blue")  # dead-lettered
        during = scrape_until(port, lambda s: value(s, "qworker_requests_running") > 1, 30,
                              "a scrape showing a running batch")
        assert value(during, "qworker_kv_blocks_used") > 0
        assert value(during, "qworker_kv_blocks_free") < 24
        wait_terminal(client, [*ids, "bad"])
        for job_id in ids:
            check_stream(client, job_id)
        after = scrape_until(
            port, lambda s: value(s, "qworker_jobs_finished_total", finish_reason="length") == 6,
            10, "the finished jobs to be counted")
    finally:
        client.close()
        stop_process(proc)
    assert value(after, "qworker_generated_tokens_total") >= 6 * 30  # recomputed ones too
    assert value(after, "qworker_prompt_tokens_total") >= sum(len(f"prompt {i}") for i in range(6))
    assert value(after, "qworker_preemptions_total") >= 1
    assert value(after, "qworker_requeues_total", reason="preempted") >= 1
    assert value(after, "qworker_dead_letters_total", code="invalid_request") == 1
    assert value(after, "qworker_ttft_seconds_count") == 6
    assert value(after, "qworker_queue_seconds_count") == 6
    assert value(after, "qworker_job_seconds_count") == 6
    assert value(after, "qworker_inter_token_seconds_count") >= 6 * 25
    assert value(after, "qworker_step_seconds_count") >= 30
    steps = value(after, "qworker_batch_size_count")
    assert value(after, "qworker_batch_size_sum") > steps > 0, "some step batched several jobs"
    assert value(after, "qworker_requests_running") == 0
    assert value(after, "qworker_kv_blocks_used") == 0
    # every prompt starts with the block "prom": found cached by all but the first few
    assert 0 < value(after, "qworker_prefix_cache_hits_total") < value(
        after, "qworker_prefix_cache_queries_total")
    assert value(after, "qworker_kv_blocks_cached") > 0


@dataclass
class Running:
    worker: Worker
    port: int
    thread: threading.Thread


@contextmanager
def metered_worker(url: str, engine: Any, stall_s: float = 60.0) -> Iterator[Running]:
    port = free_port()
    config = ServiceConfig(redis_url=url, name=f"health-{port}", model="sim", metrics_port=port,
                           block_ms=100, backoff_max_s=0.2)
    worker = Worker(engine, config, metrics=Metrics(stall_s=stall_s))
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        yield Running(worker, port, thread)
    finally:
        worker.request_stop()
        worker.request_stop()
        thread.join(30)


def test_healthz_fails_while_redis_is_unreachable(tmp_path: Path) -> None:
    server = RedisServer(tmp_path)
    server.start()
    try:
        with metered_worker(server.url, sim_engine()) as w:
            wait_for(lambda: health(w.port)[0] == 200, 10, what="healthy")
            server.stop()
            wait_for(lambda: health(w.port)[0] == 503, 10, what="/healthz to fail")
            report = health(w.port)[1]
            assert report["redis"] == "failed" and report["live"] is True
            assert health(w.port, "/livez")[0] == 200  # the loop turns: no restart wanted
            server.start()
            wait_for(lambda: health(w.port)[0] == 200, 10, what="healthy again")
    finally:
        server.stop()


class StuckEngine(SimulatedEngine):
    """A simulated engine whose steps hang until released."""

    def __init__(self, base: SimulatedEngine) -> None:
        super().__init__(base.config, base.options)
        self.release = threading.Event()

    def step(self) -> list[StepOutput]:
        self.release.wait(30)
        return super().step()


def test_healthz_and_livez_fail_while_the_loop_is_stuck(redis_url: str) -> None:
    engine = StuckEngine(sim_engine("sim:step_ms=1"))
    with metered_worker(redis_url, engine, stall_s=0.5) as w:
        wait_for(lambda: health(w.port)[0] == 200, 10, what="healthy")
        client = redis.Redis.from_url(redis_url)
        submit(client, "stuck", prompt="hi", max_tokens=3)
        wait_for(lambda: health(w.port, "/livez")[0] == 503, 10, what="/livez to fail")
        status, report = health(w.port)
        assert status == 503 and report["loop_age_s"] > 0.5
        engine.release.set()
        wait_terminal(client, ["stuck"], timeout=10)
        wait_for(lambda: health(w.port)[0] == 200, 10, what="healthy again")


def test_engine_stats_keeps_the_known_gauges_of_stats() -> None:
    class Engine:
        def stats(self) -> dict[str, int]:
            return {"running": 2, "waiting": 1, "not_a_gauge": 5}

    assert engine_stats(Engine()) == {"running": 2, "waiting": 1}
    sim = sim_engine("sim:num_blocks=32")
    assert engine_stats(sim) == {"running": 0, "waiting": 0, "blocks_free": 32,
                                 "blocks_total": 32, "batch_seqs": 0, "batch_tokens": 0,
                                 "prefix_cache_queries": 0, "prefix_cache_hits": 0,
                                 "blocks_cached": 0}


def test_unknown_path_is_404(redis_url: str) -> None:
    with metered_worker(redis_url, sim_engine()) as w:
        wait_for(lambda: health(w.port)[0] == 200, 10, what="healthy")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{w.port}/nothing", timeout=5)
            raise AssertionError("expected 404")
        except urllib.error.HTTPError as err:
            assert err.code == 404



def test_every_metric_is_documented() -> None:
    doc = (Path(__file__).resolve().parents[1] / "docs" / "operating.md").read_text()
    for family in Metrics().registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        assert f"| `{name}` | {family.type} |" in doc, name


class NoKernelsEngine(SimulatedEngine):
    """Reports what a real engine reports where the native build is missing."""

    def kernel_report(self) -> dict[str, str]:
        return {"native": "missing: no installed build and no C++ compiler", "attention": "torch"}


def test_missing_native_kernels_are_said_at_start_in_metrics_and_in_stats(
        redis_url: str, capsys: Any) -> None:
    from qworker_client.commands.stats import render
    from qworker_client.stats import collect_stats
    from tests.service_harness import KEYS

    sim = sim_engine()
    engine = NoKernelsEngine(sim.config, sim.options)
    with metered_worker(redis_url, engine) as w:
        wait_for(lambda: health(w.port)[0] == 200, 10, what="the metrics endpoint")
        samples = scrape_until(w.port, lambda s: any(
            name == "qworker_native_kernels_loaded" for name, _ in s), 10, "the kernel gauge")
        level = "missing: no installed build and no C++ compiler"
        assert value(samples, "qworker_native_kernels_loaded", level=level) == 0
        assert value(samples, "qworker_kernel", op="attention", kernel="torch") == 1
        client = redis.Redis.from_url(redis_url, decode_responses=True)
        stats = wait_for(lambda: (s := collect_stats(client, KEYS)).workers and s, 10,
                         what="the worker's liveness key")
        assert f"kernels={level}" in render(stats)
    logged = capsys.readouterr()
    assert "native CPU kernels missing" in logged.out + logged.err


def test_a_real_engine_reports_its_kernels(smollm2_tokenizer: Any) -> None:
    import torch

    from qworker.model.kernels import native
    from tests.engine_fixtures import tiny_engine, tiny_model

    engine = tiny_engine(smollm2_tokenizer, tiny_model(128, dtype=torch.float32, seed=1))
    report = engine.kernel_report()
    status = native.status()
    assert report["native"] == (status.level or f"missing: {status.reason}")
    linear = [k for k in report if k.startswith("linear ")]
    assert linear and all(report[k].count("@") == 5 for k in linear)
