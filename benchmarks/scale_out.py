"""Scale-out: K simulated-engine workers on one Redis against one worker's tokens/s.

    .venv/bin/python -m benchmarks.scale_out [--workers 1 2 4 8] [--step-ms 50] [--quick]
        [--stream-interval-ms MS] [--workload uniform | chat]

For each K: a fresh DB on one throwaway redis-server of the benchmark's own, K `qworker serve
--model sim:step_ms=S` processes (fixed step time, no model; `--max-num-seqs` 64 each), then
`jobs_per_worker * K` identical jobs (16 prompt tokens, `max_tokens` 64, ignore_eos) submitted in
one MULTI. Nobody reads the token streams during the run, so no reader can be the bottleneck: the
benchmark only polls the queue (XLEN of the job streams, whose entries are deleted when acked)
until it is empty, then checks every output stream ends in `done` with all its tokens.

tokens/s = generated tokens / (last `done` entry's time - first job entry's time), both taken from
the stream entry ids (Redis' own clock, ms). Redis commands per generated token come from
`INFO stats` `total_commands_processed` deltas (commands run inside Lua scripts included, the
benchmark's own polling excluded), with the `INFO commandstats` breakdown.

To tell what limits a figure it also prints the CPU seconds the workers, redis-server and the whole
machine (other users included) spent during the run, and the jobs each worker took (from its log).

`--workload chat` (benchmarks/chat_turns.py): `--sessions` conversations of `--turns` turns,
closed loop, each job naming its session; per K the same workload twice, with the workers'
prefix affinity (`--affinity-ms`, default 100: two steps) and with it off (`--affinity-ms 0`:
whoever pulls first takes each job, random pulling), each printing the fleet's prefix-cache hit
rate (from the workers' /metrics), against one worker's, and the tokens/s efficiency against
one worker's. The simulated engine runs the real engine core with prefix caching (blocks of 16
tokens, `--num-blocks` of them a worker: every session fits in one worker's cache).

    .venv/bin/python -m benchmarks.scale_out --workload chat --max-num-seqs 16 --max-tokens 16

Default step 50 ms: a sim worker spends a few ms of CPU per step (64 events published through one
script call) and Redis about as much, so 8 workers on 2 shared cores stay step-bound only when the
step is long against that (at 20 ms, 8 workers would want about all of both cores).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType

import redis

from benchmarks.chat_turns import ChatWorkload, prefix_cache_counts, run_chat
from benchmarks.local_redis import local_redis
from benchmarks.machine import machine_info
from benchmarks.redis_target import RedisTarget, redis_target
from qworker_client import Producer
from qworker_client.local_redis import free_port
from qworker_client.protocol import Keys
from qworker_client.redis_clients import sync_redis

KEYS = Keys()
POLL_S = 0.05


@dataclass(frozen=True)
class Settings:
    step_ms: float
    max_num_seqs: int
    jobs_per_worker: int
    prompt_tokens: int
    max_tokens: int
    timeout_s: float
    stream_interval_ms: int = 0
    model_options: str = ""  # more `sim:` options (`,block_size=16,...`)
    model: str = ""  # a real model instead of the simulated engine (its workers: 1 thread each)
    worker_args: tuple[str, ...] = ()  # more `qworker serve` flags


@dataclass(frozen=True)
class CpuSample:
    """CPU seconds so far: per worker, per redis-server (each master of a cluster), and the whole
    machine (busy, all users)."""

    workers: dict[int, float]
    redis_nodes: list[float]
    machine: float

    @property
    def redis(self) -> float:
        return sum(self.redis_nodes)


def stream_ms(entry_id: bytes | str) -> int:
    raw = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(raw.split("-")[0])


# ---------------------------------------------------------------------- processes


def start_workers(url: str, k: int, settings: Settings, logdir: Path,
                  per_worker: list[list[str]] | None = None) -> list[subprocess.Popen]:
    """`per_worker`: more flags of each worker (its metrics port, say)."""
    procs = []
    for i in range(k):
        model = settings.model or f"sim:step_ms={settings.step_ms:g}{settings.model_options}"
        cmd = [sys.executable, "-m", "qworker.cli", "serve", "--redis-url", url,
               "--model", model,
               "--name", f"w{i}",
               "--max-num-seqs", str(settings.max_num_seqs), "--claim-idle-ms", "600000",
               "--stream-interval-ms", str(settings.stream_interval_ms),
               *settings.worker_args, *(per_worker[i] if per_worker else [])]
        log = (logdir / f"w{i}.log").open("wb")
        env = {**os.environ, "OMP_NUM_THREADS": "1"} if settings.model else None
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True))  # Ctrl-C reaches us, not them
        log.close()
    return procs


def stop_workers(procs: list[subprocess.Popen], grace_s: float = 15.0) -> None:
    """SIGTERM all (they drain; nothing is left to drain here), wait, SIGKILL stragglers."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@contextmanager
def workers(url: str, k: int, settings: Settings, logdir: Path,
            per_worker: list[list[str]] | None = None) -> Iterator[list[subprocess.Popen]]:
    procs = start_workers(url, k, settings, logdir, per_worker)
    try:
        yield procs
    finally:
        stop_workers(procs)


def wait_live(client: redis.Redis, procs: list[subprocess.Popen], timeout_s: float = 120,
              target: RedisTarget | None = None) -> None:
    """Until every worker has written its liveness key (it reached its loop and Redis)."""
    names = [KEYS.worker(f"w{i}") if target is None
             else target.keys_of(target.model_of(i)).worker(f"w{i}") for i in range(len(procs))]
    deadline = time.monotonic() + timeout_s
    while sum(client.exists(name) for name in names) < len(names):
        dead = [f"w{i}" for i, p in enumerate(procs) if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"workers not live (exited: {dead})")
        time.sleep(0.1)


def jobs_taken(logdir: Path, k: int) -> list[int]:
    counts = []
    for i in range(k):
        lines = (logdir / f"w{i}.log").read_text(errors="replace").splitlines()
        counts.append(sum('"event": "started"' in line for line in lines))
    return counts


# ---------------------------------------------------------------------- measurements


def proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_s() -> float:
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return (sum(values[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def cpu_sample(nodes: list[redis.Redis], procs: list[subprocess.Popen]) -> CpuSample:
    infos = [node.info("cpu") for node in nodes]
    return CpuSample({p.pid: proc_cpu_s(p.pid) for p in procs},
                     [i["used_cpu_user"] + i["used_cpu_sys"] for i in infos], machine_busy_s())


def commands(nodes: list[redis.Redis]) -> tuple[int, Counter[str]]:
    """total_commands_processed (these INFO calls included) and calls per command, over every
    node."""
    total, calls = 0, Counter[str]()
    for node in nodes:
        total += node.info("stats")["total_commands_processed"]
        calls.update({name.removeprefix("cmdstat_"): v["calls"]
                      for name, v in node.info("commandstats").items()})
    return total, calls


# ---------------------------------------------------------------------- one K


@dataclass(frozen=True)
class Submitted:
    job_id: str
    model: str | None
    entry_id: str


def submit(target: RedisTarget, k: int, settings: Settings) -> list[Submitted]:
    """The jobs, dealt to the workers' models in turn (one model-less stream on one Redis)."""
    rng = random.Random(0)
    specs = [dict(id=f"k{k}-{j}", max_tokens=settings.max_tokens, ignore_eos=True,
                  prompt_token_ids=[rng.randrange(32, 127) for _ in range(settings.prompt_tokens)],
                  model=target.model_of(j % k))
             for j in range(settings.jobs_per_worker * k)]
    with Producer(target.url) as producer:
        jobs = producer.submit_many(specs)
    return [Submitted(job.id, job.model, job.entry_id or "") for job in jobs]


def wait_drained(client: redis.Redis, target: RedisTarget, procs: list[subprocess.Popen],
                 timeout_s: float) -> int:
    """Polls until the job streams are empty (every job acked); returns the polls' commands."""
    deadline, polls = time.monotonic() + timeout_s, 0
    streams = [stream for m in dict.fromkeys(target.models)
               for stream in (target.keys_of(m).jobs_of(m), target.keys_of(m).requeue_of(m))]
    while True:
        pipe = client.pipeline(transaction=False)
        for stream in streams:
            pipe.xlen(stream)
        polls += 1
        if sum(pipe.execute()) == 0:
            return len(streams) * polls
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            raise RuntimeError("workers exited or timed out before the queue drained")
        time.sleep(POLL_S)


def last_done_ms(client: redis.Redis, target: RedisTarget, jobs: list[Submitted],
                 max_tokens: int) -> int:
    """Checks every job ended `done` with all its tokens; the latest done entry's time."""
    pipe = client.pipeline(transaction=False)
    for job in jobs:
        pipe.xrevrange(target.keys_of(job.model).out(job.job_id), count=1)
    latest = 0
    for job, reply in zip(jobs, pipe.execute(), strict=True):
        entry_id, fields = reply[0]
        if fields.get(b"type") != b"done" or int(fields[b"completion_tokens"]) != max_tokens:
            raise RuntimeError(f"job {job.job_id} did not finish with {max_tokens} tokens: "
                               f"{fields}")
        latest = max(latest, stream_ms(entry_id))
    return latest


def run_k(target: RedisTarget, k: int, settings: Settings) -> dict[str, object]:
    target.flush()
    client = sync_redis(target.url, socket_timeout=30)
    served = [["--served-model-name", model] if model else [] for model in
              (target.model_of(i) for i in range(k))]
    with tempfile.TemporaryDirectory() as tmp, \
            workers(target.url, k, settings, Path(tmp), served) as procs:
        wait_live(client, procs, target=target)
        cmd0, stats0 = commands(target.nodes)
        cpu0 = cpu_sample(target.nodes, procs)
        jobs = submit(target, k, settings)
        polled = wait_drained(client, target, procs, settings.timeout_s)
        cpu1 = cpu_sample(target.nodes, procs)
        cmd1, stats1 = commands(target.nodes)
        end_ms = last_done_ms(client, target, jobs, settings.max_tokens)
        taken = jobs_taken(Path(tmp), k)
    client.close()
    wall_s = (end_ms - min(stream_ms(job.entry_id) for job in jobs)) / 1000
    tokens = len(jobs) * settings.max_tokens
    infos = 4 * len(target.nodes)  # INFO stats, commandstats, cpu twice, on each node
    stats = stats1 - stats0
    stats.subtract({"xlen": polled, "info": infos})  # the benchmark's own
    return {"k": k, "redis_masters": len(target.nodes) if target.cluster else 0,
            "jobs": len(jobs), "tokens": tokens, "wall_s": round(wall_s, 3),
            "tok_s": round(tokens / wall_s, 1),
            "commands_per_token": round((cmd1 - cmd0 - polled - infos) / tokens, 3),
            "commands_per_token_by_name": {name: round(n / tokens, 3)
                                           for name, n in stats.most_common(6) if n > 0},
            **cpu_figures(cpu0, cpu1, wall_s), **redis_capacity(cpu0, cpu1, tokens),
            "jobs_per_worker": taken}


def redis_capacity(before: CpuSample, after: CpuSample, tokens: int) -> dict[str, object]:
    """Tokens per CPU second of Redis in all, and of the busiest node: what the fleet could
    make were each node given a core of its own and Redis the bottleneck."""
    used = [b - a for a, b in zip(before.redis_nodes, after.redis_nodes, strict=True)]
    return {"redis_cpu_s_by_node": [round(u, 3) for u in used],
            "tokens_per_redis_cpu_s": round(tokens / max(sum(used), 1e-9)),
            "tokens_per_busiest_node_cpu_s": round(tokens / max(max(used), 1e-9))}


def run_chat_k(url: str, k: int, settings: Settings, workload: ChatWorkload,
               affinity_ms: int) -> dict[str, object]:
    """The chat workload on K workers, prefix affinity on (`affinity_ms` > 0) or off (whoever
    pulls first takes each job: random pulling): tokens/s and the fleet's prefix-cache hit rate."""
    client = redis.Redis.from_url(url, socket_timeout=30)
    client.flushall()
    nodes = [client]
    ports = [free_port() for _ in range(k)]
    per_worker = [["--metrics-port", str(port), "--affinity-ms", str(affinity_ms)]
                  for port in ports]
    with tempfile.TemporaryDirectory() as tmp, \
            workers(url, k, settings, Path(tmp), per_worker) as procs:
        wait_live(client, procs)
        cpu0 = cpu_sample(nodes, procs)
        run = run_chat(url, workload, f"k{k}a{affinity_ms}", settings.timeout_s)
        cpu1 = cpu_sample(nodes, procs)
        time.sleep(0.5)  # the counters are exported once a loop turn: an idle turn ends by then
        queries, hits = prefix_cache_counts(ports)
        taken = jobs_taken(Path(tmp), k)
    client.close()
    return {"k": k, "affinity_ms": affinity_ms, "sessions": workload.sessions,
            "turns": workload.turns, "jobs": run.jobs, "tokens": run.tokens,
            "wall_s": round(run.wall_s, 3), "tok_s": round(run.tokens / run.wall_s, 1),
            "prefix_hit_rate": round(hits / queries, 4) if queries else 0.0,
            "later_turns_ttft_ms_p50": run.later_ttft_ms_p50,
            **cpu_figures(cpu0, cpu1, run.wall_s), "jobs_per_worker": taken}


def chat_main(args: argparse.Namespace, settings: Settings) -> None:
    """Per K: the chat workload with prefix affinity and with random pulling, side by side; the
    hit rates against one worker's, the efficiency against one worker's tokens/s (same mode)."""
    workload = ChatWorkload(args.sessions, args.turns, max_tokens=settings.max_tokens,
                            opening_tokens=args.opening_tokens)
    if args.model:
        settings = replace(settings, model=args.model, worker_args=("--block-size", "16"))
    else:
        settings = replace(settings,
                           model_options=f",block_size=16,num_blocks={args.num_blocks}")
    base: dict[int, dict[str, object]] = {}
    with local_redis() as url:
        for k in args.workers:
            rows = {mode: run_chat_k(url, k, settings, workload, mode)
                    for mode in (args.affinity_ms, 0)}
            for mode, row in rows.items():
                base.setdefault(mode, row)
                one = base[mode]
                speedup = float(row["tok_s"]) / float(one["tok_s"])  # type: ignore[arg-type]
                row["efficiency"] = round(speedup / k * int(one["k"]), 3)  # type: ignore[call-overload]
                row["hit_rate_vs_one_worker"] = round(
                    float(row["prefix_hit_rate"]) / float(one["prefix_hit_rate"]), 3)  # type: ignore[arg-type]
            print(json.dumps({"workload": "chat", "step_ms": settings.step_ms,
                              "max_num_seqs": settings.max_num_seqs, "k": k,
                              "affinity": rows[args.affinity_ms], "random": rows[0],
                              **machine_info()}), flush=True)


def cpu_figures(before: CpuSample, after: CpuSample, wall_s: float) -> dict[str, float]:
    workers_s = sum(after.workers[pid] - t for pid, t in before.workers.items())
    return {"workers_cpu_cores": round(workers_s / wall_s, 2),
            "redis_cpu_cores": round((after.redis - before.redis) / wall_s, 2),
            "machine_busy_cores": round((after.machine - before.machine) / wall_s, 2),
            "machine_cores": os.cpu_count() or 0, "loadavg_1m": round(os.getloadavg()[0], 2)}


# ---------------------------------------------------------------------- main


def on_sigterm(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds through every cleanup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--step-ms", type=float, default=50.0)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--jobs-per-worker", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per K")
    parser.add_argument("--stream-interval-ms", type=int, default=0,
                        help="the workers' --stream-interval-ms")
    parser.add_argument("--cluster", type=int, default=0, metavar="MASTERS",
                        help="uniform: run each K on one Redis and on a Redis Cluster of this "
                             "many masters (one model a master), side by side")
    parser.add_argument("--quick", action="store_true", help="smoke run: K = 1, 2; 64 jobs each")
    parser.add_argument("--workload", choices=("uniform", "chat"), default="uniform",
                        help="chat: multi-turn sessions, closed loop, with prefix affinity and "
                             "without (benchmarks/chat_turns.py)")
    parser.add_argument("--model", default="",
                        help="chat: a real model for the workers (e.g. smollm2), one thread each, "
                             "instead of the simulated engine")
    parser.add_argument("--sessions", type=int, default=200, help="chat: sessions in all")
    parser.add_argument("--turns", type=int, default=5, help="chat: turns a session")
    parser.add_argument("--opening-tokens", type=int, default=ChatWorkload.opening_tokens,
                        help="chat: tokens of a session's first prompt (a system prompt, a "
                             "document)")
    parser.add_argument("--affinity-ms", type=int, default=100,
                        help="chat: the workers' --affinity-ms (2 steps of the default step)")
    parser.add_argument("--num-blocks", type=int, default=8192,
                        help="chat: KV blocks of 16 tokens a worker (all sessions fit in one)")
    args = parser.parse_args()
    if args.quick:
        args.workers, args.jobs_per_worker = [1, 2], 64
    settings = Settings(args.step_ms, args.max_num_seqs, args.jobs_per_worker, 16,
                        args.max_tokens, args.timeout, args.stream_interval_ms)
    signal.signal(signal.SIGTERM, on_sigterm)
    if args.workload == "chat":
        if args.cluster:
            parser.error("--cluster runs the uniform workload only")
        return chat_main(args, settings)
    if args.cluster:
        return cluster_main(args, settings)
    base: float | None = None
    with redis_target(0) as target:
        for k in args.workers:
            row = run_k(target, k, settings)
            base = base or float(row["tok_s"]) / k  # type: ignore[arg-type]
            print(json.dumps(uniform_row(row, k, base, settings)), flush=True)


def uniform_row(row: dict[str, object], k: int, base: float,
                settings: Settings) -> dict[str, object]:
    speedup = float(row["tok_s"]) / base  # type: ignore[arg-type]
    ideal = k * settings.max_num_seqs * 1000 / settings.step_ms
    return {"step_ms": settings.step_ms, "stream_interval_ms": settings.stream_interval_ms,
            **row, "speedup": round(speedup, 2), "efficiency": round(speedup / k, 3),
            "step_bound_tok_s": round(ideal, 1),
            "share_of_step_bound": round(float(row["tok_s"]) / ideal, 3), **machine_info()}


def cluster_main(args: argparse.Namespace, settings: Settings) -> None:
    """Per K, the fleet on one Redis and on a cluster of `--cluster` masters (one model a
    master), one after the other: tokens/s of each, and the Redis capacity of each (tokens per
    CPU second of the one Redis, and of the cluster's busiest master)."""
    with redis_target(0) as one, redis_target(args.cluster) as cluster:
        for k in args.workers:
            rows = {"one_redis": run_k(one, k, settings), "cluster": run_k(cluster, k, settings)}
            ratio = float(rows["cluster"]["tok_s"]) / float(rows["one_redis"]["tok_s"])  # type: ignore[arg-type]
            capacity = (float(rows["cluster"]["tokens_per_busiest_node_cpu_s"])  # type: ignore[arg-type]
                        / float(rows["one_redis"]["tokens_per_redis_cpu_s"]))  # type: ignore[arg-type]
            print(json.dumps({"k": k, "step_ms": settings.step_ms, **rows,
                              "cluster_vs_one_redis_tok_s": round(ratio, 3),
                              "cluster_vs_one_redis_capacity": round(capacity, 3),
                              **machine_info()}), flush=True)

if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)  # workers and redis-server already stopped by the cleanups
