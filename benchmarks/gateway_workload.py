"""Workload v1 through the OpenAI gateway with the official SDK, beside the direct protocol, in the
same run, on one real worker.

    .venv/bin/python -m benchmarks.gateway_workload [--model smollm2] [--rounds 1] [--requests 64]

A throwaway redis-server, one `qworker serve` process on the real model and one `qworker gateway`
process. After two requests off the clock, each round runs workload v1 twice, in turn (the order
alternates by round): submitted straight to the queue and read
back with the client's stream multiplexer, then sent as 64 concurrent streamed completions
through `openai.AsyncOpenAI` (token-id prompts, greedy, `min_tokens` + `ignore_eos` so every
request makes exactly its output length). Prints one JSON line: useful output tokens/s of both
and their ratio (median over rounds), and the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import openai
import redis

from benchmarks.local_redis import local_redis
from benchmarks.machine import machine_info
from benchmarks.workload import WorkItem, fingerprint, standard_workload
from qworker_client import Producer
from qworker_client.local_redis import free_port
from qworker_client.multiplex import Multiplexer
from qworker_client.protocol import Keys, TokenEvent


@contextmanager
def fleet_of(url: str, worker_args: list[str], port: int) -> Iterator[str]:
    """One worker and one gateway process while the block runs; yields the served model id."""
    procs = [subprocess.Popen([sys.executable, "-m", *args], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for args in (
        ["qworker.cli", "serve", "--redis-url", url, "--name", "bench", *worker_args],
        ["qworker_client", "gateway", "--redis-url", url, "--port", str(port),
         "--log-level", "warning"])]
    try:
        yield wait_for_model(port)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(60)


def wait_for_model(port: int, timeout_s: float = 600) -> str:
    """The first model a live worker serves, once the gateway lists one (the worker warms up)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
                data = json.load(r)["data"]
            if data:
                return str(data[0]["id"])
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit("no worker came up behind the gateway")


def direct(url: str, items: list[WorkItem]) -> float:
    """Useful tok/s of the workload submitted as plain jobs and read back live."""
    ids = [f"direct-{uuid.uuid4().hex[:8]}-{i}" for i in range(len(items))]
    reader = Multiplexer(redis.Redis.from_url(url, socket_timeout=30), Keys(), block_ms=5000,
                         count=1000)
    for job_id in ids:
        reader.follow(job_id)
    start, tokens = time.monotonic(), 0
    with Producer(url) as producer:
        producer.submit_many([
            dict(id=job_id, prompt_token_ids=item.prompt_ids, max_tokens=item.output_len,
                 min_tokens=item.output_len, ignore_eos=True, temperature=0.0)
            for job_id, item in zip(ids, items, strict=True)])
    while reader:
        tokens += sum(isinstance(event, TokenEvent) for _, event in reader.read())
    assert tokens == sum(item.output_len for item in items), "tokens missing"
    return tokens / (time.monotonic() - start)


async def through_gateway(port: int, model: str, items: list[WorkItem]) -> float:
    """Useful tok/s of the workload as concurrent streamed completions through the SDK."""
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                                max_retries=0, timeout=3600)

    async def one(item: WorkItem) -> int:
        stream = await client.completions.create(
            model=model, prompt=item.prompt_ids, max_tokens=item.output_len, temperature=0.0,
            stream=True, extra_body={"min_tokens": item.output_len, "ignore_eos": True})
        return len([chunk async for chunk in stream if chunk.choices and chunk.choices[0].text])

    start = time.monotonic()
    counts = await asyncio.gather(*(one(item) for item in items))
    wall = time.monotonic() - start
    await client.close()
    # a chunk carries each token's text; a token whose text is held back (a split character)
    # comes in a later chunk, so count the workload's tokens, and check that chunks came
    assert all(counts), "a stream brought no text"
    return sum(item.output_len for item in items) / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--requests", type=int, default=64, help="the first N of the workload")
    args = parser.parse_args()
    items = standard_workload(seed=0)[: args.requests]
    port = free_port()
    runs: dict[str, list[float]] = {"direct": [], "gateway": []}
    with local_redis() as url, fleet_of(url, ["--model", args.model, "--max-num-seqs", "64"],
                                        port) as model:
        direct(url, items[:2])  # the worker's first steps, off the clock
        for k in range(args.rounds):
            for name in ("direct", "gateway") if k % 2 == 0 else ("gateway", "direct"):
                runs[name].append(direct(url, items) if name == "direct"
                                  else asyncio.run(through_gateway(port, model, items)))
    median = {name: statistics.median(values) for name, values in runs.items()}
    print(json.dumps({"workload": "v1", "fingerprint": fingerprint(items), "clients": len(items),
                      "direct_useful_out_tok_s": round(median["direct"], 1),
                      "gateway_useful_out_tok_s": round(median["gateway"], 1),
                      "ratio": round(median["gateway"] / median["direct"], 3),
                      "rounds": {k: [round(v, 1) for v in vs] for k, vs in runs.items()},
                      **machine_info()}), flush=True)


if __name__ == "__main__":
    main()
