"""A multi-turn chat workload for `benchmarks.scale_out --workload chat`: `sessions` conversations
of `turns` turns each, closed loop (a session's next turn is submitted when its last one ends, as
a person or an agent would). Turn t's prompt is the whole conversation so far: turn t-1's prompt,
an answer of `max_tokens` tokens and a new user message, so every turn's prompt begins with the
last one's (its prefix-cache hit on the worker that ran it). Each job names its session
(`session`), unless sessions are off. Tokens are ids (no tokenizer): each session's own random
ones, so no two sessions share a block.

The prefix-cache hit rate is the workers' own: `qworker_prefix_cache_hits_total` over
`qworker_prefix_cache_queries_total` (prompt tokens found cached over prompt tokens admitted),
summed over the fleet from each worker's /metrics.
"""

from __future__ import annotations

import random
import re
import statistics
import time
import urllib.request
from dataclasses import dataclass

import redis

from qworker_client import Producer
from qworker_client.multiplex import Multiplexer
from qworker_client.protocol import DoneEvent, ErrorEvent, Keys


@dataclass(frozen=True)
class ChatWorkload:
    sessions: int
    turns: int
    max_tokens: int = 32
    opening_tokens: int = 96
    user_tokens: int = 24
    with_sessions: bool = True


@dataclass(frozen=True)
class ChatRun:
    jobs: int
    tokens: int
    wall_s: float
    later_ttft_ms_p50: float  # time to first token of the turns after each session's first


class Conversations:
    """Every session's prompt so far, and the spec of its next turn."""

    def __init__(self, workload: ChatWorkload, seed: int = 0) -> None:
        self.workload = workload
        self.rng = random.Random(seed)
        self.prompts = [self._tokens(workload.opening_tokens) for _ in range(workload.sessions)]

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(32, 127) for _ in range(n)]

    def spec(self, session: int, turn: int, tag: str) -> dict[str, object]:
        spec: dict[str, object] = {
            "id": f"{tag}-s{session}-t{turn}", "max_tokens": self.workload.max_tokens,
            "ignore_eos": True, "prompt_token_ids": list(self.prompts[session])}
        if self.workload.with_sessions:
            spec["session"] = f"chat-{session}"
        return spec

    def answered(self, session: int) -> None:
        """The turn's answer and the next user message join the conversation."""
        self.prompts[session] += self._tokens(self.workload.max_tokens + self.workload.user_tokens)


def run_chat(url: str, workload: ChatWorkload, tag: str, timeout_s: float) -> ChatRun:
    """All sessions' turns, closed loop; every job must end `done` with all its tokens."""
    client = redis.Redis.from_url(url, socket_timeout=30)
    chats = Conversations(workload)
    mux = Multiplexer(client, Keys(), block_ms=100)
    turn_of: dict[str, tuple[int, int]] = {}
    with Producer(url) as producer:
        start = time.monotonic()
        first = [chats.spec(s, 0, tag) for s in range(workload.sessions)]
        for job in producer.submit_many(first):
            mux.follow(job.id)  # type: ignore[arg-type]
        turn_of.update({str(spec["id"]): (s, 0) for s, spec in enumerate(first)})
        done, later_ttft = 0, []
        while mux.open:
            if time.monotonic() - start > timeout_s:
                raise RuntimeError(f"chat workload timed out: {done} of "
                                   f"{workload.sessions * workload.turns} turns done")
            for job_id, event in mux.read():
                if isinstance(event, ErrorEvent):
                    raise RuntimeError(f"job {job_id} failed: {event}")
                if not isinstance(event, DoneEvent):
                    continue
                if event.completion_tokens != workload.max_tokens:
                    raise RuntimeError(f"job {job_id} ended with {event.completion_tokens} tokens")
                done += 1
                session, turn = turn_of[job_id]
                if turn > 0:
                    later_ttft.append(event.ttft_ms)
                if turn + 1 < workload.turns:
                    chats.answered(session)
                    spec = chats.spec(session, turn + 1, tag)
                    mux.follow(producer.submit(**spec).id)  # type: ignore[arg-type]
                    turn_of[str(spec["id"])] = (session, turn + 1)
        wall_s = time.monotonic() - start
    client.close()
    jobs = workload.sessions * workload.turns
    return ChatRun(jobs, jobs * workload.max_tokens, wall_s,
                   statistics.median(later_ttft) if later_ttft else 0.0)


_COUNTER = re.compile(r"^(qworker_prefix_cache_(?:queries|hits)_total) ([0-9.e+]+)$", re.M)


def prefix_cache_counts(ports: list[int]) -> tuple[float, float]:
    """(prompt tokens admitted, of those found cached), summed over the workers' /metrics."""
    queries = hits = 0.0
    for port in ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        for name, value in _COUNTER.findall(text):
            if name.endswith("queries_total"):
                queries += float(value)
            else:
                hits += float(value)
    return queries, hits
