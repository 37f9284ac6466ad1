"""Standard workload v1: the request mix every throughput figure of qworker is measured on."""

from __future__ import annotations

import hashlib
import json
import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkItem:
    prompt_ids: list[int]
    output_len: int


def standard_workload(seed: int = 0, vocab_size: int = 49152, count: int = 64) -> list[WorkItem]:
    rng = random.Random(seed)
    items = []
    for _ in range(count):
        prompt_len = min(512, max(16, round(math.exp(rng.uniform(math.log(16), math.log(512))))))
        output_len = rng.randint(16, 256)
        items.append(WorkItem([rng.randrange(32, vocab_size) for _ in range(prompt_len)],
                              output_len))
    return items


def fingerprint(items: list[WorkItem]) -> str:
    """sha256 fed request by request with the compact JSON of [prompt_ids, output_len], as the
    peers' figures are keyed (v1 at seed 0: 20f1b11a1993c1a6)."""
    digest = hashlib.sha256()
    for item in items:
        request = [item.prompt_ids, item.output_len]
        digest.update(json.dumps(request, separators=(",", ":")).encode())
    return digest.hexdigest()[:16]


def shared_prefix_workload(seed: int = 0, vocab_size: int = 49152, requests: int = 64,
                           prefix_len: int = 1024, suffix: tuple[int, int] = (16, 256),
                           output_len: int = 64) -> list[WorkItem]:
    """Issue 16's target 1: `requests` prompts sharing one `prefix_len`-token prefix, each with
    its own suffix of suffix[0]..suffix[1] tokens (seed 0, defaults: e5dcba7d99af8fcb)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(32, vocab_size) for _ in range(prefix_len)]
    return [WorkItem(prefix + [rng.randrange(32, vocab_size)
                               for _ in range(rng.randint(*suffix))], output_len)
            for _ in range(requests)]
