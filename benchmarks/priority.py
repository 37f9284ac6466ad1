"""Priority under load (issue 16, target 4): while low-priority long jobs fill a real worker, a
burst of high-priority short jobs arrives; their TTFT against the same burst on the idle worker,
and the low jobs' greedy texts against a run without the high ones.

    .venv/bin/python -m benchmarks.priority [--low 64 --low-tokens 256 --high 8 --high-tokens 16]

One real worker (the loop on the main thread, as under `qworker serve`), a real redis-server of
its own, max_num_seqs = --low (so the low jobs take every slot and a high job must displace one).
Three phases on the same worker: (1) the low jobs alone (their reference texts), (2) the high
burst on the idle worker, (3) the low jobs again and, once every one has streamed a token, the
high burst. Prints one JSON line: high TTFT p50 / max idle and under load, their ratio (target
<= 2), displacements, requeues, and whether every low job finished with its reference text.

Aging (`--aging-s`, the engine's `priority_aging_s`) lifts a job one level per that many seconds
it has *waited* (not run; qworker/engine/aging.py): a low job that waited (LOW - HIGH) levels'
worth before it started ranks with the burst and is not displaced, by design (a bound on
starvation); however long it then runs, it does not age. The JSON says how long the low jobs
had been submitted when the burst came (`low_age_at_burst_s`), the longest any running one had
waited (`low_waited_max_s`), and whether they all still ranked below the burst.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from typing import Any

import redis
import torch

from benchmarks.local_redis import local_redis
from benchmarks.machine import machine_info
from benchmarks.workload import standard_workload
from qworker.engine.config import EngineConfig
from qworker.engine.engine import Engine
from qworker.model.decoder import load_model
from qworker.model.dtypes import resolve_dtype
from qworker.model.loading.hub import resolve_model
from qworker.model.tokenizer.tokenizer import Tokenizer
from qworker.service.config import ServiceConfig
from qworker.service.worker import Worker
from qworker_client import Producer
from qworker_client.protocol import DoneEvent, Keys, TokenEvent, parse_event

KEYS = Keys()
LOW, HIGH = 1, -1  # priorities: the low and high bands


def job(job_id: str, prompt: list[int], tokens: int, priority: int) -> dict[str, Any]:
    return dict(id=job_id, prompt_token_ids=prompt, max_tokens=tokens, min_tokens=tokens,
                ignore_eos=True, temperature=0.0, priority=priority)


def first_tokens(client: redis.Redis, ids: list[str], since: float, timeout: float = 3600.0
                 ) -> dict[str, float]:
    """When each job's first token was seen (seconds after `since`), polling every 2 ms."""
    seen: dict[str, float] = {}
    deadline = time.monotonic() + timeout
    while len(seen) < len(ids):
        assert time.monotonic() < deadline, "first tokens missing"
        pipe = client.pipeline(transaction=False)
        waiting = [i for i in ids if i not in seen]
        for job_id in waiting:
            pipe.xrange(KEYS.out(job_id), "-", "+", count=1)
        for job_id, reply in zip(waiting, pipe.execute(), strict=True):
            fields = reply[0][1] if reply else None
            if fields is not None and isinstance(parse_event(fields), TokenEvent):
                seen[job_id] = time.monotonic() - since
        time.sleep(0.002)
    return seen


def finals(client: redis.Redis, ids: list[str], timeout: float = 3600.0) -> dict[str, str]:
    """Each job's final text, once all are done."""
    deadline = time.monotonic() + timeout
    out: dict[str, str] = {}
    while len(out) < len(ids):
        assert time.monotonic() < deadline, "jobs did not finish"
        for job_id in ids:
            last = client.xrevrange(KEYS.out(job_id), count=1) if job_id not in out else None
            fields = last[0][1] if last else None
            if fields is not None:
                event = parse_event(fields)
                if isinstance(event, DoneEvent):
                    out[job_id] = event.text
        time.sleep(0.05)
    return out


def drive(url: str, engine: Engine, worker: Worker, args: argparse.Namespace,
          seen: dict[str, Any]) -> None:
    client = redis.Redis.from_url(url)
    items = standard_workload(seed=0)
    lows = items[: args.low]
    highs = [item.prompt_ids[:32] for item in items[-args.high:]]
    try:
        with Producer(url) as prod:
            ref_ids = [f"ref-{k}" for k in range(args.low)]
            prod.submit_many([job(i, it.prompt_ids, args.low_tokens, LOW)
                              for i, it in zip(ref_ids, lows, strict=True)])
            seen["reference"] = finals(client, ref_ids)

            idle_ids = [f"idle-{k}" for k in range(args.high)]
            started = time.monotonic()
            prod.submit_many([job(i, p, args.high_tokens, HIGH)
                              for i, p in zip(idle_ids, highs, strict=True)])
            seen["idle_ttft"] = first_tokens(client, idle_ids, started)
            finals(client, idle_ids)

            low_ids = [f"low-{k}" for k in range(args.low)]
            low_submitted = time.monotonic()
            prod.submit_many([job(i, it.prompt_ids, args.low_tokens, LOW)
                              for i, it in zip(low_ids, lows, strict=True)])
            first_tokens(client, low_ids, time.monotonic())  # every low job is running now
            before = engine.num_preemptions
            busy_ids = [f"busy-{k}" for k in range(args.high)]
            started = time.monotonic()
            seen["low_age_at_burst_s"] = started - low_submitted
            seen["low_waited_max_s"] = max(
                (seq.waited_s for seq in list(engine.scheduler.running)), default=0.0)
            prod.submit_many([job(i, p, args.high_tokens, HIGH)
                              for i, p in zip(busy_ids, highs, strict=True)])
            seen["busy_ttft"] = first_tokens(client, busy_ids, started)
            seen["high_done_s"] = max(0.0, time.monotonic() - started)
            finals(client, busy_ids)
            seen["mixed"] = finals(client, low_ids)
            seen["displaced"] = engine.num_preemptions - before
            seen["requeued"] = int(client.xinfo_stream(KEYS.requeue_of(None, "low"))
                                   ["entries-added"])
    finally:
        worker.request_stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--low", type=int, default=64)
    parser.add_argument("--low-tokens", type=int, default=256)
    parser.add_argument("--high", type=int, default=8)
    parser.add_argument("--high-tokens", type=int, default=16)
    parser.add_argument("--aging-s", type=float, default=EngineConfig().priority_aging_s,
                        help="the engine's priority_aging_s (0: strict priority)")
    args = parser.parse_args()
    path = str(resolve_model(args.model))
    dtype = resolve_dtype(args.dtype, "cpu")
    config = EngineConfig(max_num_seqs=args.low, kv_cache_gb=2.0, requeue_preempted=True,
                          prefix_caching=False, priority_aging_s=args.aging_s)
    engine = Engine(load_model(path, dtype=dtype), Tokenizer.load(path), config)
    engine.warm_up()
    with local_redis() as url:
        worker = Worker(engine, ServiceConfig(redis_url=url, name="bench",
                                              claim_idle_ms=600_000))
        seen: dict[str, Any] = {}
        driver = threading.Thread(target=drive, args=(url, engine, worker, args, seen),
                                  daemon=True)
        driver.start()
        worker.run()
        driver.join(60)
    idle, busy = list(seen["idle_ttft"].values()), list(seen["busy_ttft"].values())
    reference = [seen["reference"][f"ref-{k}"] for k in range(args.low)]
    mixed = [seen["mixed"][f"low-{k}"] for k in range(args.low)]
    p50_idle, p50_busy = statistics.median(idle), statistics.median(busy)
    print(json.dumps({
        "benchmark": "priority", "low_jobs": args.low, "low_tokens": args.low_tokens,
        "high_jobs": args.high, "high_tokens": args.high_tokens, "dtype": str(dtype),
        "threads": torch.get_num_threads(),
        "idle_high_ttft_ms_p50": round(p50_idle * 1000, 1),
        "idle_high_ttft_ms_max": round(max(idle) * 1000, 1),
        "busy_high_ttft_ms_p50": round(p50_busy * 1000, 1),
        "busy_high_ttft_ms_max": round(max(busy) * 1000, 1),
        "ttft_ratio_p50": round(p50_busy / p50_idle, 2),
        "ttft_ratio_max": round(max(busy) / max(idle), 2),
        "target_ratio": 2.0, "aging_s": args.aging_s,
        "low_age_at_burst_s": round(seen["low_age_at_burst_s"], 1),
        "low_waited_max_s": round(seen["low_waited_max_s"], 1),
        "lows_ranked_below_burst": (args.aging_s == 0
                                    or seen["low_waited_max_s"] < (LOW - HIGH) * args.aging_s),
        "displaced": seen["displaced"], "requeued_low": seen["requeued"],
        "low_jobs_finished": len(seen["mixed"]),
        "low_texts_unchanged": sum(a == b for a, b in zip(reference, mixed, strict=True)),
        **machine_info()}), flush=True)


if __name__ == "__main__":
    main()
