"""`qworker demo` (`make demo`): everything on this machine, then gone again.

Gets the model, starts a local Redis (unless $REDIS_URL is set; keys under the prefix `qwdemo`),
starts a worker, submits a few chat prompts and prints their tokens as they stream (several jobs
interleaving: continuous batching at work), then stops everything it started.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import redis

from qworker.commands.up import EmbeddedRedis, LocalRedis, OwnRedis
from qworker.engine.config import EngineConfig
from qworker.model.errors import ModelInputError, one_line
from qworker_client.connect import RedisURLError, checked_url
from qworker_client.local_redis import die_with_parent
from qworker_client.multiplex import Multiplexer
from qworker_client.protocol import Keys
from qworker_client.redis_clients import sync_redis
from qworker_client.result import OutputEvent

PROMPTS: tuple[tuple[str, str], ...] = (
    ("haiku", "Write a haiku about message queues."),
    ("paris", "What is the capital of France? Answer in one sentence."),
    ("lists", "Explain in two sentences what a Python list comprehension is."),
    ("robot", "Tell a three-sentence story about a robot who learns to bake bread."),
)
PREFIX = "qwdemo"


@dataclass
class Stream:
    tag: str
    job_id: str
    text: str = ""
    tokens: int = 0
    submitted: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    ended: float | None = None
    summary: str = ""


def say(message: str) -> None:
    print(f"qworker demo: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- what the demo starts


@contextmanager
def own_redis(data_dir: Path) -> Iterator[str]:
    """$REDIS_URL, or a redis-server (else the embedded server) of ours until the end."""
    if os.environ.get("REDIS_URL"):
        say(f"using REDIS_URL (keys under {PREFIX}:)")
        yield checked_url(os.environ["REDIS_URL"])
        return
    binary = shutil.which("redis-server")
    server: OwnRedis = LocalRedis(binary, data_dir) if binary else EmbeddedRedis()
    if not binary:
        say("no redis-server on PATH: an embedded, non-durable one (fakeredis)")
    url = server.start()
    try:
        say(f"Redis at {url} ({server.description})")
        yield url
    finally:
        server.stop()


@contextmanager
def worker_process(url: str, model: str, log_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`qworker serve` as a child (logs to `log_path`), stopped with SIGTERM at the end."""
    name = f"demo-{os.getpid()}"
    cmd = [sys.executable, "-m", "qworker.cli", "serve", "--redis-url", url, "--model", model,
           "--prefix", PREFIX, "--name", name, "--max-num-seqs", "8", "--drain-timeout", "3"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                start_new_session=True, preexec_fn=die_with_parent)
    try:
        wait_ready(url, name, proc, log_path)
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_ready(url: str, name: str, proc: subprocess.Popen[bytes], log_path: Path) -> None:
    say(f"starting a worker (pid {proc.pid}, log {log_path}); loading the model ...")
    client = sync_redis(url)
    started = time.monotonic()
    while not client.exists(Keys(PREFIX).worker(name)):
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the worker exited ({proc.returncode}):\n{tail}")
        if time.monotonic() - started > 900:
            raise RuntimeError("the worker did not start within 15 minutes")
        time.sleep(0.2)
    client.close()
    say(f"worker ready after {time.monotonic() - started:.1f} s")


# ---------------------------------------------------------------------- jobs and their streams


def submit_all(client: redis.Redis, max_tokens: int, stagger_s: float) -> list[Stream]:
    """The prompts as chat jobs; the later ones a moment later, so they join a running batch."""
    from qworker_client import Producer

    producer = Producer(prefix=PREFIX, client=client)
    streams = []
    for n, (tag, prompt) in enumerate(PROMPTS):
        if n == 2:
            time.sleep(stagger_s)
        job_id = f"demo-{tag}-{uuid.uuid4().hex[:8]}"
        producer.submit(messages=[{"role": "user", "content": prompt}], id=job_id,
                        max_tokens=max_tokens, temperature=0.7, top_p=0.9, seed=n)
        streams.append(Stream(tag, job_id))
    return streams


def read_events(client: redis.Redis, streams: list[Stream], timeout_s: float
                ) -> Iterator[tuple[Stream, OutputEvent]]:
    """Every job's events as they come (one XREAD over all the open output streams)."""
    by_id = {s.job_id: s for s in streams}
    reader = Multiplexer(client, Keys(PREFIX), block_ms=1000)
    for job_id in by_id:
        reader.follow(job_id)
    deadline = time.monotonic() + timeout_s
    while reader:
        if time.monotonic() > deadline:
            raise TimeoutError(f"jobs not done within {timeout_s:.0f} s")
        for job_id, event in reader.read():
            yield by_id[job_id], event


def apply(stream: Stream, event: OutputEvent) -> str:
    """Updates the job from one event; returns the new text."""
    now = time.monotonic()
    if event.type == "token":
        stream.tokens += 1
        stream.first_token = stream.first_token or now
        stream.text += event.text
        return event.text
    stream.ended = now
    if event.type == "done":
        stream.summary = (f"{event.completion_tokens} tokens, first after {event.ttft_ms} ms, "
                          f"done after {event.total_ms} ms ({event.finish_reason})")
        tail = event.text[len(stream.text):] if event.text.startswith(stream.text) else ""
        stream.text = event.text
        return tail
    stream.summary = f"error {event.code}: {event.message}"
    return ""


# ---------------------------------------------------------------------- showing it


class Lines:
    """Not a terminal: one line per piece of new text, tagged with its job."""

    def __init__(self, streams: list[Stream], out: TextIO) -> None:
        self.out = out
        self.width = max(len(s.tag) for s in streams)

    def update(self, stream: Stream, new_text: str) -> None:
        if new_text:
            shown = new_text.replace("\n", "⏎")
            self.out.write(f"[{stream.tag:<{self.width}}] {shown}\n")
            self.out.flush()

    def close(self) -> None:
        pass


class Panel:
    """A terminal: one live row per job, redrawn in place."""

    def __init__(self, streams: list[Stream], out: TextIO) -> None:
        self.streams, self.out = streams, out
        self.width = max(len(s.tag) for s in streams)
        self.out.write("\n" * len(streams))
        self.last_draw = 0.0

    def update(self, stream: Stream, new_text: str) -> None:
        if time.monotonic() - self.last_draw >= 0.05 or stream.ended:
            self.draw()

    def draw(self) -> None:
        columns = max(40, os.get_terminal_size(self.out.fileno()).columns)
        room = columns - self.width - 14
        rows = []
        for s in self.streams:
            flat = " ".join(s.text.split())
            state = "done" if s.ended else f"{s.tokens:4d} tok"
            rows.append(f"\x1b[2K{s.tag:<{self.width}} {state:>8} | {flat[-room:]}")
        self.out.write(f"\x1b[{len(rows)}F" + "\n".join(rows) + "\n")
        self.out.flush()
        self.last_draw = time.monotonic()

    def close(self) -> None:
        self.draw()


def report(streams: list[Stream], started: float, out: TextIO) -> None:
    out.write("\n")
    for s in streams:
        out.write(f"── {s.tag}: {s.summary}\n{s.text.strip()}\n\n")
    tokens = sum(s.tokens for s in streams)
    elapsed = max(s.ended or started for s in streams) - started
    overlap = max_overlap(streams)
    out.write(f"{len(streams)} jobs, {tokens} tokens in {elapsed:.1f} s "
              f"({tokens / max(elapsed, 1e-9):.1f} tokens/s); up to {overlap} jobs streamed "
              "at once (continuous batching)\n")
    out.flush()


def max_overlap(streams: list[Stream]) -> int:
    """Most jobs between their first token and their end at the same time."""
    edges = sorted([(s.first_token, 1) for s in streams if s.first_token] +
                   [(s.ended, -1) for s in streams if s.first_token and s.ended])
    best = running = 0
    for _, delta in edges:
        running += delta
        best = max(best, running)
    return best


# ---------------------------------------------------------------------- the command


def run(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _interrupt)  # stop like Ctrl-C: through the cleanups
    try:
        return _run(args)
    except KeyboardInterrupt:
        say("interrupted; stopping what the demo started")
        return 130
    except (RedisURLError, ModelInputError) as exc:  # what the user gave: one line, exit 2
        say(f"failed: {one_line(exc)}")
        return 2
    except (RuntimeError, TimeoutError, redis.RedisError) as exc:
        say(f"failed: {exc}")
        return 1


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _run(args: argparse.Namespace) -> int:
    from qworker.engine.simulated import is_simulated
    from qworker.model.loading.hub import resolve_model

    if not is_simulated(args.model):
        say(f"model {args.model}: {resolve_model(args.model)}")
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="qworker-demo-")))
        url = stack.enter_context(own_redis(workdir / "redis"))
        stack.enter_context(worker_process(url, args.model, workdir / "worker.log"))
        client = sync_redis(url, socket_timeout=10, protocol=2)
        stack.callback(client.close)
        started = time.monotonic()
        streams = submit_all(client, args.max_tokens, args.stagger)
        say(f"submitted {len(streams)} chat jobs; their tokens as they stream:")
        show = (Panel if sys.stdout.isatty() and not args.lines else Lines)(streams, sys.stdout)
        for stream, event in read_events(client, streams, args.timeout):
            show.update(stream, apply(stream, event))
        show.close()
        report(streams, started, sys.stdout)
        say("stopping the worker and the Redis it started")
    return 0 if all(s.summary and not s.summary.startswith("error") for s in streams) else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("demo", help="run a local worker and stream a few chat jobs",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=EngineConfig.model,
                   help=f"model (default {EngineConfig.model}; `sim` for none)")
    p.add_argument("--max-tokens", type=int, default=80, help="tokens per job at most")
    p.add_argument("--stagger", type=float, default=0.5,
                   help="seconds before the second half of the jobs is submitted")
    p.add_argument("--timeout", type=float, default=600, help="seconds for all jobs to finish")
    p.add_argument("--lines", action="store_true",
                   help="one tagged line per piece of text, also on a terminal")
    p.set_defaults(func=run)
