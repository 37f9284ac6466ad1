"""The gateway alone under load: one gateway process, simulated workers, N concurrent streaming
clients.

    .venv/bin/python -m benchmarks.gateway [--clients 256] [--requests 4] [--max-tokens 64]
                                           [--workers 2] [--step-ms 10] [--stream-interval MS]
                                           [--no-warmup]

A throwaway redis-server, K `qworker serve --model sim:...` processes (no model: a fixed step
time; 256 sequences each), one `qworker gateway` process, then N asyncio clients in this process
(a lean HTTP client: `benchmarks.sse_client`), each sending `--requests` streamed completions one
after another and counting the tokens streamed (the usage chunk's completion tokens) and the
chunks that carry text (several tokens each with a stream interval). Each client first sends
one short stream, not counted (the steady state: the gateway's Redis pool and the clients'
connections already open), unless `--no-warmup`. Prints one JSON line: streamed tokens/s over
the run, the gateway's CPU seconds and its CPU per streamed token (µs), how often it read the
output streams (XREAD calls, from Redis' command stats) and the chunks a read brought, the CPU
of the workers, of Redis and of the clients, the machine's CPU over the run, time to first
chunk p50/p99, and the machine (`benchmarks.machine`).

The clients share the machine with the gateway, the workers and Redis: on a small machine the
tokens/s figure is a floor of what one gateway sustains, and its CPU per token is the figure to
compare (one gateway core sustains 1e6 / that many tokens/s).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx2
import redis

from benchmarks.local_redis import local_redis
from benchmarks.machine import machine_info
from benchmarks.sse_client import Connection
from qworker_client.local_redis import free_port
from qworker_client.protocol import Keys


@dataclass
class Tally:
    tokens: int = 0
    text_chunks: int = 0
    errors: int = 0
    first_chunk_s: list[float] = field(default_factory=list)


def cpu_seconds(pid: int) -> float:
    """User + system CPU of one process, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_cpu_seconds() -> float:
    with open("/proc/stat") as f:
        parts = [int(v) for v in f.readline().split()[1:]]
    busy = sum(parts) - parts[3] - parts[4]  # all but idle and iowait
    return busy / os.sysconf("SC_CLK_TCK")


def spawn(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


@dataclass
class Fleet:
    gateway: subprocess.Popen[bytes]
    workers: list[subprocess.Popen[bytes]]
    redis: redis.Redis
    redis_pid: int

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far: the gateway's, all workers', Redis'."""
        return {"gateway": cpu_seconds(self.gateway.pid),
                "workers": sum(cpu_seconds(w.pid) for w in self.workers),
                "redis": cpu_seconds(self.redis_pid)}

    def reads(self) -> int:
        """XREAD calls so far: the gateway's reads of the output streams (workers take jobs
        with XREADGROUP; nothing else here sends XREAD)."""
        stats: dict[str, Any] = self.redis.info("commandstats")
        return int(stats.get("cmdstat_xread", {}).get("calls", 0))


def spawn_workers(url: str, kind: str, workers: int, step_ms: float, rate: float
                  ) -> list[subprocess.Popen[bytes]]:
    """`sim`: K simulated workers (`qworker serve --model sim:...`) on this machine; `paced`: one
    `benchmarks.token_feeder` writing every stream at `rate` tokens/s (a fleet elsewhere)."""
    if kind == "paced":
        return [spawn("benchmarks.token_feeder", "--redis-url", url, "--model", "paced",
                      "--rate", str(rate))]
    sim = f"sim:step_ms={step_ms},num_blocks=8192,max_num_seqs=256"
    return [spawn("qworker.cli", "serve", "--redis-url", url, "--name", f"bench-{k}",
                  "--model", sim) for k in range(workers)]


@contextmanager
def fleet(url: str, sims: list[subprocess.Popen[bytes]], port: int,
          stream_interval: float | None) -> Iterator[Fleet]:
    interval = [] if stream_interval is None else ["--stream-interval", str(stream_interval)]
    gateway = spawn("qworker_client", "gateway", "--redis-url", url, "--port", str(port),
                    "--log-level", "warning", *interval)
    try:
        wait_ready(url, len(sims), port)
        client = redis.Redis.from_url(url)
        yield Fleet(gateway, sims, client, int(client.info("server")["process_id"]))
    finally:
        for proc in [*sims, gateway]:
            proc.terminate()
        for proc in [*sims, gateway]:
            proc.wait(30)


def wait_ready(url: str, workers: int, port: int) -> None:
    client, deadline = redis.Redis.from_url(url), time.monotonic() + 120
    while len(list(client.scan_iter(Keys().worker_pattern))) < workers:
        if time.monotonic() > deadline:
            raise SystemExit("the workers did not start")
        time.sleep(0.2)
    while True:
        try:
            if httpx2.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return
        except httpx2.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit("the gateway did not start")
        time.sleep(0.2)


async def one_stream(conn: Connection, model: str, k: int, max_tokens: int, tally: Tally
                     ) -> None:
    body = {"model": model, "prompt": f"client {k}: tell me about queues", "stream": True,
            "max_tokens": max_tokens, "ignore_eos": True, "seed": k,
            "stream_options": {"include_usage": True}}
    start, first = time.monotonic(), 0.0
    pieces: list[bytes] = []
    async for piece in conn.post("/v1/completions", json.dumps(body).encode()):
        first = first or time.monotonic() - start
        pieces.append(piece)
    if conn.status != 200:
        tally.errors += 1
        return
    tally.first_chunk_s.append(first)
    whole = b"".join(pieces)
    usage = whole.rpartition(b"data: {")[2].partition(b"\n")[0]  # the last chunk's
    tally.tokens += json.loads(b"{" + usage)["usage"]["completion_tokens"]
    # the text chunks: not the finish chunk, nor the usage chunk
    tally.text_chunks += whole.count(b"data: {") - whole.count(b'"text":""') - 1


async def clients(port: int, n: int, requests: int, max_tokens: int, tally: Tally,
                  warmup: bool, start: Callable[[], None]) -> None:
    """N clients, each its own connection; with `warmup`, one short stream each first (the
    gateway's Redis pool and the clients' connections opened), then `start()`, then the run."""
    async with httpx2.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]  # the workers' --model
    conns = [Connection("127.0.0.1", port) for _ in range(n)]

    async def client(k: int) -> None:
        for r in range(requests):
            await one_stream(conns[k], model, k * requests + r, max_tokens, tally)

    try:
        if warmup:
            ignored = Tally()
            await asyncio.gather(*(one_stream(conns[k], model, n * requests + k, 2, ignored)
                                   for k in range(n)))
        start()
        await asyncio.gather(*(client(k) for k in range(n)))
    finally:
        for conn in conns:
            await conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=256)
    parser.add_argument("--requests", type=int, default=4, help="streams per client, in turn")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--fleet", choices=["sim", "paced"], default="sim",
                        help="sim: simulated workers here; paced: a token feeder at --rate")
    parser.add_argument("--rate", type=float, default=80.0,
                        help="--fleet paced: tokens/s of each stream")
    parser.add_argument("--stream-interval", type=float, default=None,
                        help="the gateway's --stream-interval, ms (default: the gateway's own)")
    parser.add_argument("--no-warmup", action="store_true",
                        help="count from the first request (connections opened in the run)")
    args = parser.parse_args()
    port = free_port()
    with local_redis() as url, fleet(url, spawn_workers(url, args.fleet, args.workers,
                                                        args.step_ms, args.rate),
                                     port, args.stream_interval) as procs:
        tally = Tally()
        at: dict[str, Any] = {}

        def start() -> None:
            at.update(cpu=procs.cpu(), mine=time.process_time(),
                      machine=machine_cpu_seconds(), reads=procs.reads(), t=time.monotonic())

        asyncio.run(clients(port, args.clients, args.requests, args.max_tokens, tally,
                            not args.no_warmup, start))
        wall = time.monotonic() - at["t"]
        cpu = {k: v - at["cpu"][k] for k, v in procs.cpu().items()}
        mine = time.process_time() - at["mine"]
        machine = machine_cpu_seconds() - at["machine"]
        reads = procs.reads() - at["reads"]
    firsts = sorted(tally.first_chunk_s) or [0.0]
    tokens = max(tally.tokens, 1)
    print(json.dumps({
        "benchmark": "gateway", "command": " ".join(["python -m benchmarks.gateway",
                                                     *sys.argv[1:]]),
        "clients": args.clients, "requests_per_client": args.requests,
        "warmup": not args.no_warmup,
        "max_tokens": args.max_tokens, "fleet": args.fleet,
        **({"rate_per_stream": args.rate} if args.fleet == "paced" else
           {"workers": args.workers, "step_ms": args.step_ms}),
        "stream_interval_ms": args.stream_interval,
        "streamed_tokens": tally.tokens, "text_chunks": tally.text_chunks,
        "tokens_per_chunk": round(tally.tokens / max(tally.text_chunks, 1), 2),
        "errors": tally.errors, "wall_s": round(wall, 3),
        "tokens_per_s": round(tally.tokens / wall, 1),
        "gateway_cpu_s": round(cpu["gateway"], 3),
        "gateway_cpu_us_per_token": round(cpu["gateway"] / tokens * 1e6, 1),
        "gateway_tokens_per_cpu_s": round(tokens / max(cpu["gateway"], 1e-9)),
        # what a token costs depends on how many share a chunk (a read of the stream): per chunk
        "gateway_cpu_us_per_chunk": round(cpu["gateway"] / max(tally.text_chunks, 1) * 1e6, 1),
        # how often the gateway read the output streams, and how many chunks a read brought
        "reads_per_s": round(reads / wall, 1),
        "chunks_per_read": round(tally.text_chunks / max(reads, 1), 1),
        "workers_cpu_s": round(cpu["workers"], 3), "redis_cpu_s": round(cpu["redis"], 3),
        "clients_cpu_s": round(mine, 3),
        "machine_cpu_s": round(machine, 3), "machine_cpus": os.cpu_count(),
        "first_chunk_ms_p50": round(statistics.median(firsts) * 1000, 1),
        "first_chunk_ms_p99": round(firsts[int(0.99 * (len(firsts) - 1))] * 1000, 1),
        **machine_info(),
    }))


if __name__ == "__main__":
    main()
