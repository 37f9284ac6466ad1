"""Many tenants on one fleet (issue 38): fair share against first come, first served, on a real
redis-server of its own and workers on the simulated engine (or `--engine real`: the real
engine on `--model`), one JSON line of figures.

    .venv/bin/python -m benchmarks.fairness [--flood 2000 --delay-s 10 --interactive 20]
        [--workers 4 --slots 8 --step-ms 5] [--window-s 60 --tenants 1000] [--engine real]
        [--parts flood,alone,weights,many,intake]

- flood: tenant A queues --flood jobs; --delay-s later tenant B queues --interactive short ones
  at the same band. B's TTFT p50 with fair share (and with it but no fair preemption), first
  come first served, and on an idle fleet (target: fair <= 2x idle).
- alone: A alone, the same flood through the fleet: jobs/s with fair share over FIFO (target
  >= 0.97).
- weights: two tenants 3:1, both backlogged for --window-s: their completion-token shares
  (target: within 10% of 3:1).
- many: --tenants tenants with work queued, the fleet for --window-s: the least tenant's tokens
  over its fair share (target >= 0.8).
- intake: --intake-tenants tenants with one job each, read by one worker's intake: ms a job.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import redis

from benchmarks.local_redis import local_redis
from benchmarks.machine import machine_info
from qworker.engine.config import EngineConfig
from qworker.engine.simulated import SimulatedEngine
from qworker.service.config import ServiceConfig
from qworker.service.groups import Groups
from qworker.service.intake import Intake
from qworker.service.logs import get_logger
from qworker.service.scripts import Scripts
from qworker.service.worker import Worker
from qworker_client.protocol import DoneEvent, Keys, parse_event

KEYS = Keys()
EngineFactory = Callable[[], Any]


def sim_factory(args: argparse.Namespace) -> EngineFactory:
    config = EngineConfig(model=f"sim:step_ms={args.step_ms}", max_num_seqs=args.slots,
                          requeue_preempted=True)
    return lambda: SimulatedEngine.from_config(config)


def real_factory(args: argparse.Namespace) -> EngineFactory:
    from qworker.engine.engine import Engine
    from qworker.model.decoder import load_model
    from qworker.model.dtypes import resolve_dtype
    from qworker.model.loading.hub import resolve_model
    from qworker.model.tokenizer.tokenizer import Tokenizer

    path = str(resolve_model(args.model))
    config = EngineConfig(max_num_seqs=args.slots, kv_cache_gb=1.0, requeue_preempted=True)

    def make() -> Any:
        engine = Engine(load_model(path, dtype=resolve_dtype("auto", "cpu")),
                        Tokenizer.load(path), config)
        engine.warm_up()
        return engine
    return make


@contextlib.contextmanager
def fleet(url: str, n: int, fair: bool, make: EngineFactory, preemption: bool = True
          ) -> Iterator[list[Worker]]:
    workers = [Worker(make(), ServiceConfig(redis_url=url, name=f"w{k}", fair_share=fair,
                                            fair_preemption=preemption,
                                            claim_idle_ms=600_000, drain_timeout=0,
                                            recent_maxlen=1_000_000, model="sim"))
               for k in range(n)]
    threads = [threading.Thread(target=w.run, daemon=True) for w in workers]
    for t in threads:
        t.start()
    try:
        yield workers
    finally:
        for w in workers:
            w.request_stop()
        for t in threads:
            t.join(60)


def queue(client: redis.Redis, tenant: str, ids: list[str], tokens: int) -> None:
    pipe = client.pipeline(transaction=False)
    for job_id in ids:
        pipe.xadd(KEYS.jobs, {"id": job_id, "tenant": tenant, "prompt": f"job {job_id}",
                              "max_tokens": tokens, "ignore_eos": "true"})
    pipe.execute()


def dones(client: redis.Redis, ids: list[str], timeout: float) -> dict[str, DoneEvent]:
    got: dict[str, DoneEvent] = {}
    deadline = time.monotonic() + timeout
    while len(got) < len(ids) and time.monotonic() < deadline:
        pipe = client.pipeline(transaction=False)
        waiting = [j for j in ids if j not in got]
        for job_id in waiting:
            pipe.xrevrange(KEYS.out(job_id), count=1)
        for job_id, last in zip(waiting, pipe.execute(), strict=True):
            if last:
                event = parse_event(last[0][1])
                if isinstance(event, DoneEvent):
                    got[job_id] = event
        time.sleep(0.05)
    return got


def ended_tokens(client: redis.Redis) -> Counter[str]:
    """Completion tokens of the ended jobs, per tenant (the recent-jobs stream)."""
    out: Counter[str] = Counter()
    for _, fields in client.xrange(KEYS.recent):
        out[fields[b"tenant"].decode()] += int(fields[b"tokens"])
    return out


def interactive_ttft(url: str, args: argparse.Namespace, make: EngineFactory, fair: bool,
                     flood: bool, preemption: bool = True) -> float:
    client = redis.Redis.from_url(url)
    client.flushall()
    with fleet(url, args.workers, fair, make, preemption):
        if flood:
            queue(client, "A", [f"a{k}" for k in range(args.flood)], args.flood_tokens)
            time.sleep(args.delay_s)
        ids = [f"b{k}" for k in range(args.interactive)]
        queue(client, "B", ids, args.interactive_tokens)
        got = dones(client, ids, timeout=600)
    return statistics.median(e.ttft_ms for e in got.values())


def alone_rate(url: str, args: argparse.Namespace, make: EngineFactory, fair: bool) -> float:
    client = redis.Redis.from_url(url)
    client.flushall()
    ids = [f"a{k}" for k in range(args.flood)]
    queue(client, "A", ids, args.flood_tokens)
    started = time.monotonic()
    with fleet(url, args.workers, fair, make):
        dones(client, ids, timeout=3600)
        return len(ids) / (time.monotonic() - started)


def window_tokens(url: str, args: argparse.Namespace, make: EngineFactory,
                  tenants: dict[str, float], per_tenant: int, tokens: int) -> Counter[str]:
    client = redis.Redis.from_url(url)
    client.flushall()
    client.hset(KEYS.tenants, mapping={t: f"{w:g} 0 0" for t, w in tenants.items()})
    for k in range(per_tenant):  # interleaved, as arrivals would be
        pipe = client.pipeline(transaction=False)
        for t in tenants:
            pipe.xadd(KEYS.jobs, {"id": f"{t}-{k}", "tenant": t, "prompt": "shared work",
                                  "max_tokens": tokens, "ignore_eos": "true"})
        pipe.execute()
    with fleet(url, args.workers, True, make):
        time.sleep(args.window_s)
        return ended_tokens(client)


def intake_ms_per_job(url: str, tenants: int) -> float:
    client = redis.Redis.from_url(url)
    client.flushall()
    config = ServiceConfig(redis_url=url, name="intake")
    intake = Intake(client, KEYS, config, Scripts(), token="intake/1")
    Groups(client, intake.streams, config.group, get_logger()).ensure()
    Scripts.load(client)
    queue_many = client.pipeline(transaction=False)
    for k in range(tenants):
        queue_many.xadd(KEYS.jobs, {"id": f"j{k}", "tenant": f"t{k}", "prompt": "x",
                                    "max_tokens": "4"})
    queue_many.execute()
    taken, started = 0, time.perf_counter()
    while taken < tenants:
        got = intake.read(8, block_ms=None)
        intake.ack(got)
        taken += len(got)
    return (time.perf_counter() - started) * 1000 / tenants


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("sim", "real"), default="sim")
    parser.add_argument("--model", default="smollm2", help="with --engine real")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--step-ms", type=float, default=5.0)
    parser.add_argument("--flood", type=int, default=2000)
    parser.add_argument("--flood-tokens", type=int, default=64)
    parser.add_argument("--delay-s", type=float, default=10.0)
    parser.add_argument("--interactive", type=int, default=20)
    parser.add_argument("--interactive-tokens", type=int, default=16)
    parser.add_argument("--window-s", type=float, default=60.0)
    parser.add_argument("--tenants", type=int, default=1000)
    parser.add_argument("--intake-tenants", type=int, default=10_000)
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated, of {','.join(PARTS)}")
    args = parser.parse_args()
    make = sim_factory(args) if args.engine == "sim" else real_factory(args)
    figures: dict[str, Any] = {
        "benchmark": "fairness", "engine": args.engine, "workers": args.workers,
        "slots": args.slots, "step_ms": args.step_ms, "flood": args.flood,
        "interactive": args.interactive, "delay_s": args.delay_s, "window_s": args.window_s}
    with local_redis() as url:
        for part in args.parts.split(","):
            figures |= PARTS[part](url, args, make)
    print(json.dumps({**figures, **machine_info()}), flush=True)


def flood_part(url: str, args: argparse.Namespace, make: EngineFactory) -> dict[str, Any]:
    idle = interactive_ttft(url, args, make, fair=True, flood=False)
    fair_ttft = interactive_ttft(url, args, make, fair=True, flood=True)
    fifo_ttft = interactive_ttft(url, args, make, fair=False, flood=True)
    no_preempt = interactive_ttft(url, args, make, fair=True, flood=True, preemption=False)
    return {"b_ttft_ms_p50_idle": round(idle, 1), "b_ttft_ms_p50_fair": round(fair_ttft, 1),
            "b_ttft_ms_p50_fair_no_preemption": round(no_preempt, 1),
            "b_ttft_ms_p50_fifo": round(fifo_ttft, 1),
            "b_ttft_fair_over_idle": round(fair_ttft / idle, 2), "target_fair_over_idle": 2.0}


def alone_part(url: str, args: argparse.Namespace, make: EngineFactory) -> dict[str, Any]:
    fifo_rate = alone_rate(url, args, make, fair=False)
    fair_rate = alone_rate(url, args, make, fair=True)
    return {"alone_jobs_per_s_fair": round(fair_rate, 1),
            "alone_jobs_per_s_fifo": round(fifo_rate, 1),
            "alone_fair_over_fifo": round(fair_rate / fifo_rate, 3), "target_alone": 0.97}


def weights_part(url: str, args: argparse.Namespace, make: EngineFactory) -> dict[str, Any]:
    tokens = 16
    weighted = window_tokens(url, args, make, {"heavy": 3.0, "light": 1.0},
                             backlog(args, tokens), tokens)
    return {"weights_3_1_token_ratio": round(weighted["heavy"] / max(weighted["light"], 1), 2),
            "target_ratio": "3.0 +- 10%"}


def many_part(url: str, args: argparse.Namespace, make: EngineFactory) -> dict[str, Any]:
    many = window_tokens(url, args, make, {f"t{k}": 1.0 for k in range(args.tenants)},
                         max(2, backlog(args, 8) // args.tenants), 8)
    fair_share = sum(many.values()) / args.tenants
    least = min((many.get(f"t{k}", 0) for k in range(args.tenants)), default=0)
    return {"many_tenants": args.tenants, "many_tenants_served": len(many),
            "many_min_share_of_fair": round(least / max(fair_share, 1e-9), 2),
            "target_min_share": 0.8}


def intake_part(url: str, args: argparse.Namespace, make: EngineFactory) -> dict[str, Any]:
    return {"intake_tenants": args.intake_tenants,
            "intake_ms_per_job": round(intake_ms_per_job(url, args.intake_tenants), 3),
            "target_intake_ms": 1.0}


def backlog(args: argparse.Namespace, tokens: int) -> int:
    """Jobs per tenant that keep every tenant backlogged through the window: twice what the
    fleet could run in it were every step as short as --step-ms."""
    per_job_s = tokens * args.step_ms / 1000
    return int(2 * args.window_s * args.workers * args.slots / per_job_s)


PARTS: dict[str, Callable[[str, argparse.Namespace, EngineFactory], dict[str, Any]]] = {
    "flood": flood_part, "alone": alone_part, "weights": weights_part, "many": many_part,
    "intake": intake_part}


if __name__ == "__main__":
    main()
