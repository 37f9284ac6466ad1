"""Standard workload v1 through Redis: submitted as jobs, served by one worker, read back live
by a separate consumer process; beside it, the same workload in-process in the same run.

    .venv/bin/python -m benchmarks.service_throughput [--dtype bfloat16]

Runs `--rounds` pairs (in-process, then through Redis, on one engine) and prints one JSON line for
the pair of the median ratio, with every pair's ratio and figures (`*_runs`): useful output tokens/s
end to end and in-process, Redis round trips per engine step (and commands per generated token),
the CPU seconds redis-server and the consumer took beside the engine, and TTFT / inter-token
latency p50 and p99 as the consumer saw them.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import threading
import time
from typing import Any

import redis
import torch
from redis.connection import Connection

from benchmarks.engine_throughput import run_engine
from benchmarks.local_redis import local_redis
from benchmarks.machine import machine_info
from benchmarks.workload import WorkItem, fingerprint, standard_workload
from qworker.engine.config import EngineConfig
from qworker.engine.engine import Engine
from qworker.engine.request import SamplingParams
from qworker.model.decoder import load_model
from qworker.model.dtypes import resolve_dtype
from qworker.model.loading.hub import resolve_model
from qworker.model.tokenizer.tokenizer import Tokenizer
from qworker.service.config import ServiceConfig
from qworker.service.worker import Worker
from qworker_client import Producer
from qworker_client.multiplex import Multiplexer
from qworker_client.protocol import Keys, TokenEvent


class CountingConnection(Connection):
    """Counts round trips: one packed send (a command or a whole pipeline) each."""

    sends = 0

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        CountingConnection.sends += 1
        super().send_packed_command(command, check_health)


def read_streams(url: str, ids: list[str], started: Any, out: Any) -> None:
    """Consumer process: follow every job's output stream, note when each token arrives."""
    client = redis.Redis.from_url(url, socket_timeout=30)
    reader = Multiplexer(client, Keys(), block_ms=5000, count=1000)
    for job_id in ids:
        reader.follow(job_id)
    arrivals: dict[str, list[float]] = {i: [] for i in ids}
    started.set()
    cpu_before = time.process_time()
    while reader:
        events = reader.read()
        now = reader.replied_at  # when the XREAD returned, as each of its tokens arrived
        for job, event in events:
            if isinstance(event, TokenEvent):
                arrivals[job].append(now)
    out.put((arrivals, time.process_time() - cpu_before))


def drive(url: str, engine: Engine, worker: Worker, items: list[WorkItem],
          seen: dict[str, Any]) -> None:
    """Start the consumer, submit the workload, wait for every token, then stop the worker."""
    ids = [f"bench-{i}" for i in range(len(items))]
    ctx = mp.get_context("spawn")
    started, out = ctx.Event(), ctx.Queue()
    consumer = ctx.Process(target=read_streams, args=(url, ids, started, out))
    consumer.start()
    started.wait(60)
    steps_before, sends_before = engine.num_steps, CountingConnection.sends
    info = redis.Redis.from_url(url)
    commands_before = info.info("stats")["total_commands_processed"]
    redis_cpu_before = redis_cpu_s(info)
    seen["submitted"] = time.time()
    with Producer(url) as producer:
        producer.submit_many([
            dict(id=job_id, prompt_token_ids=item.prompt_ids, max_tokens=item.output_len,
                 min_tokens=item.output_len, ignore_eos=True, temperature=0.0)
            for job_id, item in zip(ids, items, strict=True)])
    seen["arrivals"], seen["consumer_cpu_s"] = out.get(timeout=3600)
    seen["redis_cpu_s"] = redis_cpu_s(info) - redis_cpu_before
    seen["steps"] = engine.num_steps - steps_before
    seen["sends"] = CountingConnection.sends - sends_before
    seen["commands"] = info.info("stats")["total_commands_processed"] - commands_before
    consumer.join(30)
    worker.request_stop()


def redis_cpu_s(client: redis.Redis) -> float:
    """CPU seconds redis-server has used so far (user + system, all its threads)."""
    cpu = client.info("cpu")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 \
        else values[0]


def time_steps(engine: Engine) -> list[float]:
    """Wraps `engine.step` to add up the seconds spent in it (the one-item list it returns)."""
    total = [0.0]
    step = engine.step

    def timed() -> Any:
        started = time.perf_counter()
        try:
            return step()
        finally:
            total[0] += time.perf_counter() - started

    engine.step = timed  # type: ignore[method-assign]
    return total


def run_service(url: str, engine: Engine, items: list[WorkItem]) -> dict[str, object]:
    """The worker loop runs on the main thread, as under `qworker serve` (torch runs ~20% slower
    when driven from a second thread here); a driver thread submits, reads and stops it."""
    client = redis.Redis.from_url(url, connection_class=CountingConnection, socket_timeout=30)
    worker = Worker(engine, ServiceConfig(redis_url=url, name="bench", claim_idle_ms=600_000),
                    client=client)
    seen: dict[str, Any] = {}
    step_s = time_steps(engine)
    driver = threading.Thread(target=drive, args=(url, engine, worker, items, seen), daemon=True)
    driver.start()
    worker.run()
    driver.join(60)
    arrivals, submitted = seen["arrivals"], seen["submitted"]
    wall = max(max(a) for a in arrivals.values()) - submitted
    steps, sends, commands = seen["steps"], seen["sends"], seen["commands"]
    useful = sum(item.output_len for item in items)
    assert sum(len(a) for a in arrivals.values()) == useful, "tokens missing end to end"
    ttft = [(a[0] - submitted) * 1000 for a in arrivals.values()]
    itl = [(b - a) * 1000 for times in arrivals.values()
           for a, b in zip(times, times[1:], strict=False)]
    return {
        "useful_out_tok_s": round(useful / wall, 1),
        "wall_s": round(wall, 2),
        "engine_steps": steps,
        "engine_step_s": round(step_s[0], 2),  # inside engine.step, of wall_s
        "worker_round_trips_per_step": round(sends / max(1, steps), 2),
        "redis_commands_per_token": round(commands / useful, 2),
        # the CPU the rest of the service took beside the engine, on the same cores here
        "redis_server_cpu_s": round(seen["redis_cpu_s"], 2),
        "consumer_cpu_s": round(seen["consumer_cpu_s"], 2),
        **{f"{name}_ms_p{q}": round(percentile(values, q), 1)
           for name, values in (("ttft", ttft), ("itl", itl)) for q in (50, 99)},
    }


def workload_engine(model: str, dtype: str, follow_cores: bool = True) -> Engine:
    """The engine both halves of a pair run on, warm: `qworker serve`'s for workload v1."""
    path = str(resolve_model(model))
    config = EngineConfig(max_num_seqs=64, kv_cache_gb=2.0, requeue_preempted=True,
                          prefix_caching=False, follow_cores=follow_cores)
    engine = Engine(load_model(path, dtype=resolve_dtype(dtype, "cpu")), Tokenizer.load(path),
                    config)
    engine.prepare()  # as Engine.from_config does for `qworker serve`
    engine.generate([standard_workload(seed=0)[0].prompt_ids],
                    SamplingParams(max_tokens=4, ignore_eos=True))
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3,
                        help="pairs of runs, in-process then through Redis, on the same engine")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="the engine's; fewer than the cores leaves room for Redis and the "
                             "consumer, as where they run on other machines")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    items = standard_workload(seed=0)[: args.requests]
    engine = workload_engine(args.model, args.dtype)
    dtype = engine.runner.model.dtype
    pairs = []
    for _ in range(args.rounds):
        in_process = run_engine(engine, items)
        with local_redis() as url:
            pairs.append((in_process, run_service(url, engine, items)))
    ratios = [s["useful_out_tok_s"] / i["useful_out_tok_s"] for i, s in pairs]  # type: ignore
    in_process, service = pairs[ratios.index(statistics.median_low(ratios))]
    print(json.dumps({"workload": "v1", "fingerprint": fingerprint(items), "dtype": str(dtype),
                      "threads": torch.get_num_threads(),
                      "in_process_useful_out_tok_s": in_process["useful_out_tok_s"],
                      "end_to_end_useful_out_tok_s": service["useful_out_tok_s"],
                      "ratio": round(statistics.median_low(ratios), 3),  # that pair's
                      "ratios": [round(r, 3) for r in ratios],
                      "in_process_runs": [i["useful_out_tok_s"] for i, _ in pairs],
                      "end_to_end_runs": [s["useful_out_tok_s"] for _, s in pairs],
                      "engine_step_s_runs": [s["engine_step_s"] for _, s in pairs],
                      **service, **machine_info()}),
          flush=True)


if __name__ == "__main__":
    main()
