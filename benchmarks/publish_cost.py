"""What one engine step's round trip costs the worker's CPU and redis-server's, without an engine:
`--jobs` running jobs, one new token each, flushed as the worker flushes them (events, the cancel
flags of every running job, and a read of new entries) against a redis-server of our own.

    .venv/bin/python -m benchmarks.publish_cost [--jobs 64] [--steps 300] [--steps-per-flush 1]
        [--no-aof]

Prints one JSON line: medians per step of the worker thread's CPU and wall time, redis-server's CPU
per step, Redis commands per token (those run inside scripts included: INFO stats), the tokens a
second one Redis core carries at that cost, and the append script's microseconds per call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import redis

from benchmarks.local_redis import local_redis
from benchmarks.machine import machine_info
from qworker.service import publisher as pub
from qworker.service.config import ServiceConfig
from qworker.service.intake import Intake
from qworker.service.job import ActiveJob, Entry
from qworker.service.publisher import Publisher
from qworker.service.scripts import Scripts
from qworker_client.protocol import Job, Keys, TokenEvent


def owned_jobs(client: redis.Redis, keys: Keys, config: ServiceConfig, token: str,
               count: int) -> list[ActiveJob]:
    """`count` jobs delivered to this consumer and owned by `token`, as after an admission."""
    client.xgroup_create(keys.jobs, config.group, id="0", mkstream=True)
    jobs = []
    for k in range(count):
        entry_id = client.xadd(keys.jobs, {"id": f"job-{k}", "prompt": "p"}).decode()
        client.hset(keys.owner(f"job-{k}"), "worker", token)
        jobs.append(ActiveJob(Job(id=f"job-{k}", prompt="p"), Entry(keys.jobs, entry_id, {}),
                              log=None, t0_ms=0, started_ms=0))
    client.xreadgroup(config.group, config.name, {keys.jobs: ">"})
    return jobs


def redis_cpu_s(client: redis.Redis) -> float:
    cpu = client.info("cpu")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def commands_processed(client: redis.Redis) -> int:
    """Commands Redis has run, those inside scripts included (INFO stats)."""
    return int(client.info("stats")["total_commands_processed"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=64)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--no-aof", action="store_true",
                        help="redis-server without its append-only file (default: AOF, fsync "
                             "every second)")
    parser.add_argument("--steps-per-flush", type=int, default=1,
                        help="engine steps whose tokens go in one round trip (a stream interval "
                             "of this many steps); figures stay per step")
    args = parser.parse_args()
    group = args.steps_per_flush
    with local_redis(aof=not args.no_aof) as url:
        client = redis.Redis.from_url(url)
        keys, config, token = Keys(), ServiceConfig(redis_url=url, name="bench"), "bench/1"
        Scripts.load(client)
        jobs = owned_jobs(client, keys, config, token, args.jobs)
        publisher = Publisher(client, keys, config, Scripts(), token)
        caps = Intake(client, keys, config, Scripts(), token).caps(4)
        running = [job.job_id for job in jobs]
        cpu, wall = [], []
        client.config_resetstat()
        redis_before = redis_cpu_s(client)
        commands_before = commands_processed(client)
        for first in range(0, args.steps, group):
            for job in jobs:
                job.outbox = [TokenEvent(i=i, token_id=1000 + i, text=" word")
                              for i in range(first, first + group)]
            started_cpu, started = time.thread_time(), time.perf_counter()
            result = publisher.flush(jobs, running, caps)
            cpu.append((time.thread_time() - started_cpu) / group)
            wall.append((time.perf_counter() - started) / group)
            assert set(result.status.values()) == {pub.OK}, result.status
        redis_per_step = (redis_cpu_s(client) - redis_before) / args.steps
        commands_per_step = (commands_processed(client) - commands_before) / args.steps
        evalsha = client.info("commandstats")["cmdstat_evalsha"]["usec_per_call"]
    print(json.dumps({"jobs": args.jobs, "steps": args.steps, "steps_per_flush": group,
                      "aof": not args.no_aof,
                      "worker_cpu_ms_per_step": round(statistics.median(cpu) * 1e3, 3),
                      "worker_wall_ms_per_step": round(statistics.median(wall) * 1e3, 3),
                      "redis_cpu_ms_per_step": round(redis_per_step * 1e3, 3),
                      "redis_commands_per_token": round(commands_per_step / args.jobs, 2),
                      "tokens_per_s_per_redis_core": round(args.jobs / redis_per_step),
                      "scripts_usec_per_call": evalsha,  # the append and the read, averaged
                      **machine_info()}), flush=True)


if __name__ == "__main__":
    main()
