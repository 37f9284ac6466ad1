"""What a finished job costs Redis while its result lives (`--result-ttl`): `INFO memory` before
and after `--jobs` jobs of each length, submitted by the Python producer and run to `done` by a
worker on the simulated engine (one byte of text a token), and `MEMORY USAGE` of each key kind.
Once per `stream-node-max-bytes` asked (Redis' default, 4096, first), on a redis-server of our own
without persistence.

    .venv/bin/python -m benchmarks.job_memory [--jobs 500] [--lengths 1,16,128,512]
        [--node-bytes 4096,1024,512]

Prints one JSON object: the machine, the Redis version, and per setting and length the bytes per
job (`used_memory` and `used_memory_dataset` deltas), the keys a finished job leaves, and the
`MEMORY USAGE` of one output stream and one submit marker (and of an owner hash as a running job
has it: a finished job has none).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from typing import Any

import redis

from benchmarks.machine import machine_info
from qworker.engine.config import EngineConfig
from qworker.engine.simulated import SimulatedEngine
from qworker.service.config import ServiceConfig
from qworker.service.logs import configure_logging
from qworker.service.worker import Worker
from qworker_client.client import Producer
from qworker_client.local_redis import local_redis
from qworker_client.protocol import Keys

KEYS = Keys()


def memory(client: redis.Redis) -> tuple[int, int]:
    info = client.info("memory")
    return int(info["used_memory"]), int(info["used_memory_dataset"])


def finished(client: redis.Redis, job_ids: list[str]) -> bool:
    pipe = client.pipeline(transaction=False)
    for job_id in job_ids:
        pipe.xrevrange(KEYS.out(job_id), count=1)
    return all(last and last[0][1].get(b"type") == b"done" for last in pipe.execute())


def run_length(client: redis.Redis, producer: Producer, length: int, jobs: int) -> dict[str, Any]:
    """`jobs` jobs of `length` tokens each, run to `done`: what they left behind, per job."""
    time.sleep(0.2)  # the worker is idle and blocked in its read: its buffers are settled
    used0, dataset0 = memory(client)
    keys0 = client.dbsize()
    specs = [{"prompt": f"job {length}-{k}", "max_tokens": length, "ignore_eos": True,
              "id": f"m{length}-{k}"} for k in range(jobs)]
    ids = [job.id for job in producer.submit_many(specs)]
    deadline = time.monotonic() + 600
    while not finished(client, ids):
        if time.monotonic() > deadline:
            raise RuntimeError(f"jobs of {length} tokens did not finish")
        time.sleep(0.1)
    time.sleep(0.2)
    used1, dataset1 = memory(client)
    out = client.memory_usage(KEYS.out(ids[0]), samples=0)
    return {
        "tokens": length,
        "bytes_per_job": round((used1 - used0) / jobs),
        "dataset_bytes_per_job": round((dataset1 - dataset0) / jobs),
        "keys_per_job": (client.dbsize() - keys0) / jobs,
        "out_stream_bytes": out,
        "out_stream_entries": client.xlen(KEYS.out(ids[0])),
        "out_stream_bytes_per_token": round(out / max(length, 1), 1),
        "submit_marker_bytes": client.memory_usage(KEYS.submitted(ids[0]), samples=0),
        "owner_hashes_left": sum(client.exists(KEYS.owner(i)) for i in ids[:100]),
    }


def owner_hash_bytes(client: redis.Redis) -> int:
    """An owner hash as `take_owner` writes it for a running job (deleted at `done`)."""
    key = KEYS.owner("sizing")
    now = str(int(time.time() * 1000))
    client.hset(key, mapping={"worker": "host-12345/0123456789ab", "t0": now, "started": now})
    client.expire(key, 3600)
    size = int(client.memory_usage(key, samples=0))
    client.delete(key)
    return size


def measure(url: str, node_bytes: int, lengths: list[int], jobs: int) -> dict[str, Any]:
    client = redis.Redis.from_url(url)
    client.flushall()
    client.config_set("stream-node-max-bytes", node_bytes)
    engine = SimulatedEngine.from_config(EngineConfig(model="sim:step_ms=0", max_num_seqs=64))
    worker = Worker(engine, ServiceConfig(redis_url=url, name="memory", model="sim"))
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        producer = Producer(url)
        rows = [run_length(client, producer, length, jobs) for length in lengths]
    finally:
        worker.request_stop()
        thread.join(60)
    return {"stream_node_max_bytes": node_bytes, "owner_hash_bytes": owner_hash_bytes(client),
            "lengths": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=500)
    parser.add_argument("--lengths", default="1,16,128,512")
    parser.add_argument("--node-bytes", default="4096,1024,512")
    args = parser.parse_args()
    configure_logging("warning")  # a line per job started would drown the figures
    lengths = [int(n) for n in args.lengths.split(",")]
    with local_redis("--save", "", "--appendonly", "no") as server:
        client = redis.Redis.from_url(server.url)
        version = client.info("server")["redis_version"]
        settings = [measure(server.url, int(n), lengths, args.jobs)
                    for n in args.node_bytes.split(",")]
    print(json.dumps({"benchmark": "job_memory", "machine": machine_info(),
                      "redis_version": version, "jobs_per_length": args.jobs,
                      "settings": settings}, indent=1))


if __name__ == "__main__":
    main()
