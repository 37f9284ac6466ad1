"""A stand-in for a fleet of workers on other machines, for `benchmarks.gateway --fleet paced`:
one lean process that takes the jobs of one model and writes each job's output stream at a
fixed rate (`--rate` tokens per second per stream), a few µs of CPU per token (one pipelined
XADD), so that a gateway measured on a small machine sees tokens arrive as from a real fleet, not
at the pace of simulated workers starved of the CPU they share with it.

    .venv/bin/python -m benchmarks.token_feeder --redis-url URL --model NAME [--rate 80]
                                                [--tick-ms 10]

It speaks only what the gateway reads: the liveness key (`served_model_name`), the model's job
stream (a consumer group of its own, each job acked when taken), and each job's output stream
(`token` entries with `i`, `token_id`, `text`, then `done` with `length` and the token counts).
It ignores cancels, priorities and sampling fields: every job runs to its `max_tokens`.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from qworker_client.protocol import Keys, band_of_fields

GROUP = "token-feeder"
DEFAULT_MAX_TOKENS = 256  # the workers' default
LIVENESS_TTL_S = 10
OUTPUT_TTL_S = 600


@dataclass
class Job:
    job_id: str
    max_tokens: int
    prompt_tokens: int
    sent: int = 0
    credit: float = 1.0  # tokens due: the first one at once
    texts: list[str] = field(default_factory=list)


def taken(fields: dict[str, str]) -> Job:
    prompt = fields.get("prompt") or fields.get("messages") or ""
    return Job(fields["id"], int(fields.get("max_tokens") or DEFAULT_MAX_TOKENS),
               max(1, len(prompt.split())))


def feed(pipe: redis.client.Pipeline, keys: Keys, job: Job, due: int) -> None:
    """Queue `due` more tokens of `job` on `pipe`, and its `done` after its last."""
    for _ in range(min(due, job.max_tokens - job.sent)):
        text = f" t{job.sent}"
        job.texts.append(text)
        pipe.xadd(keys.out(job.job_id), {"type": "token", "i": job.sent,
                                         "token_id": 1000 + job.sent, "text": text})
        job.sent += 1
    if job.sent == job.max_tokens:
        pipe.xadd(keys.out(job.job_id), {
            "type": "done", "finish_reason": "length", "text": "".join(job.texts),
            "prompt_tokens": job.prompt_tokens, "completion_tokens": job.sent})
        pipe.expire(keys.out(job.job_id), OUTPUT_TTL_S)


def run(url: str, model: str, rate: float, tick_s: float, name: str) -> None:
    client, keys = redis.Redis.from_url(url, decode_responses=True), Keys()
    stream = keys.jobs_of(model, band_of_fields({}))
    try:
        client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise
    alive = json.dumps({"name": name, "model": model, "served_model_name": model,
                        "started_ms": int(time.time() * 1000)})
    active: list[Job] = []
    last, alive_at = time.monotonic(), 0.0
    while True:
        now = time.monotonic()
        if now - alive_at > 1:
            client.set(keys.worker(name), alive, ex=LIVENESS_TTL_S)
            alive_at = now
        block = 1 if active else int(tick_s * 1000)
        reply: Any = client.xreadgroup(GROUP, name, {stream: ">"}, count=1024, block=block)
        for _, entries in reply or ():
            if entries:
                client.xack(stream, GROUP, *[entry_id for entry_id, _ in entries])
            active += [taken(fields) for _, fields in entries]
        now = time.monotonic()
        elapsed, last = now - last, now
        pipe = client.pipeline(transaction=False)
        for job in active:
            job.credit += rate * elapsed
            due = int(job.credit)
            job.credit -= due
            feed(pipe, keys, job, due)
        pipe.execute()
        active = [job for job in active if job.sent < job.max_tokens]
        time.sleep(max(0.0, tick_s - (time.monotonic() - now)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--rate", type=float, default=80.0, help="tokens/s of each stream")
    parser.add_argument("--tick-ms", type=float, default=10.0)
    parser.add_argument("--name", default="token-feeder")
    args = parser.parse_args()
    run(args.redis_url, args.model, args.rate, args.tick_ms / 1000, args.name)


if __name__ == "__main__":
    main()
