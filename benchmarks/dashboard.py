"""The dashboard's pages over a big fleet's Redis: each page's server time and Redis calls.

    .venv/bin/python -m benchmarks.dashboard [--jobs 100000] [--workers 200] [--repeat 5]

A throwaway redis-server filled as a busy fleet leaves it: `--jobs` jobs, of which a tenth
queued (spread over 4 models and the three bands, a tenth of those taken by a worker: pending,
with an owner hash and a few tokens out), the rest ended (each its output stream and submit
marker; the last 1,000 in `<prefix>:recent`), 10,000 dead letters, `--workers` live workers' keys
(and as many consumers in the group), an hour of throughput counters. Then each page is asked
`--repeat` times through the dashboard's ASGI app in this process (no HTTP: the server's own
time, Redis round trips and rendering included). Prints one JSON line: per page, the median and
worst milliseconds, the Redis calls (INFO commandstats) and the page's stated bound; and, apart,
what finding the keys by SCAN costs (`finding_keys`), which the dashboard does in a thread of
its own every `REFRESH_S`, never in a page's request."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import redis

from benchmarks.local_redis import local_redis
from benchmarks.machine import machine_info
from qworker_client.dashboard import reads
from qworker_client.dashboard.app import create_dashboard
from qworker_client.dashboard.directory import REFRESH_S
from qworker_client.found_keys import find_keys
from qworker_client.protocol import BANDS, DEFAULT_GROUP, Keys, WorkerInfo

KEYS = Keys()
MODELS = ("m0", "m1", "m2", "m3")
CHUNK = 5_000
PAGES = {"overview": "/", "workers": "/workers", "jobs": "/jobs", "job": "/jobs/done-7",
         "dead": "/dead"}


def fill(client: redis.Redis, jobs: int, workers: int) -> None:
    queued = jobs // 10
    pipe = client.pipeline(transaction=False)
    now_ms = int(time.time() * 1000)
    streams = [KEYS.jobs_of(m, b) for m in MODELS for b in BANDS]
    for stream in streams:
        pipe.xgroup_create(stream, DEFAULT_GROUP, id="0", mkstream=True)
    for k in range(jobs):
        job_id = f"q-{k}" if k < queued else f"done-{k}"
        if k < queued:
            stream = streams[k % len(streams)]
            pipe.xadd(stream, {"id": job_id, "prompt": "p" * 200, "max_tokens": "64",
                               "model": MODELS[k % len(streams) // len(BANDS)]})
        else:
            pipe.xadd(KEYS.out(job_id), {"type": "done", "finish_reason": "stop", "text": "t" * 200,
                                         "prompt_tokens": "20", "completion_tokens": "64"})
            if k >= jobs - 1_000:
                pipe.xadd(KEYS.recent, {"id": job_id, "model": "m0", "status": "done",
                                        "reason": "stop", "tokens": "64", "worker": "w-1"})
        pipe.set(KEYS.submitted(job_id), "1-1")
        if len(pipe) >= CHUNK:
            pipe.execute()
    for k in range(10_000):
        pipe.xadd(KEYS.dead, {"reason": "deadline passed", "code": "expired", "source": KEYS.jobs,
                              "source_id": f"{k + 1}-0", "worker": "w-1", "id": f"dead-{k}",
                              "prompt": "p" * 200})
    for k in range(workers):
        info = WorkerInfo(name=f"w-{k}", host="h", pid=k, model=MODELS[k % len(MODELS)],
                          group=DEFAULT_GROUP, started_ms=now_ms, running=4, free_slots=60,
                          kv_used=0.4, liveness_ms=15_000)
        pipe.set(KEYS.worker(f"w-{k}"), info.model_dump_json(), px=600_000)
    minute = now_ms // 60_000
    for m in range(minute - 60, minute + 1):
        pipe.hset(KEYS.throughput(m), mapping={f"tokens:{model}": 30_000 for model in MODELS})
    pipe.execute()
    for k, stream in enumerate(streams):  # a tenth of the queued taken: pending, owned
        taken = client.xreadgroup(DEFAULT_GROUP, f"w-{k}", {stream: ">"}, count=queued // 10
                                  // len(streams))
        for _, entries in taken:
            for _, fields in entries:
                pipe.hset(KEYS.owner(fields["id"]), mapping={"worker": f"w-{k}/r", "t0": now_ms})
                pipe.xadd(KEYS.out(fields["id"]), {"type": "token", "i": "0", "token_id": "1",
                                                   "text": "a"})
    pipe.execute()


async def ask(app: Any, path: str) -> tuple[int, float]:
    """One GET through the ASGI app: its status and seconds."""
    sent: list[dict[str, Any]] = []
    scope = {"type": "http", "http_version": "1.1", "method": "GET", "path": path,
             "raw_path": path.encode(), "query_string": b"", "headers": [], "root_path": "",
             "scheme": "http", "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1)}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    start = time.perf_counter()
    await app(scope, receive, send)
    return int(sent[0]["status"]), time.perf_counter() - start


def calls(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return sum(v["calls"] for k, v in stats.items() if k not in ("cmdstat_info",))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dashboard")
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--workers", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with local_redis() as url:
        client = redis.Redis.from_url(url, decode_responses=True)
        fill(client, args.jobs, args.workers)
        app = create_dashboard(url, refresh_s=3600)  # the pages' own calls alone, below
        keys_in_db = int(client.dbsize())
        before, started = calls(client), time.perf_counter()
        find_keys(client, Keys())  # what the dashboard's thread does every REFRESH_S
        finding = {"ms": round((time.perf_counter() - started) * 1000, 1),
                   "redis_calls": calls(client) - before, "every_s": REFRESH_S}
        result: dict[str, Any] = {"jobs": args.jobs, "workers": args.workers,
                                  "keys": keys_in_db, "finding_keys": finding, "pages": {}}
        loop = asyncio.new_event_loop()
        loop.run_until_complete(ask(app, "/"))  # warm: connections, templates
        for page, path in PAGES.items():
            seconds = []
            before = calls(client)
            for _ in range(args.repeat):
                status, took = loop.run_until_complete(ask(app, path))
                assert status == 200, (page, status)
                seconds.append(took)
            result["pages"][page] = {
                "median_ms": round(statistics.median(seconds) * 1000, 1),
                "worst_ms": round(max(seconds) * 1000, 1),
                "redis_calls": (calls(client) - before) // args.repeat,
                "bound": reads.page_bound(page, keys_in_db, found=True)}
        loop.close()
        client.close()
    result["machine"] = machine_info()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
