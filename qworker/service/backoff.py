"""The loop's wait between retries of Redis: it doubles with each failure up to `max_s`, jittered,
and goes back to the shortest only after twice `max_s` without one (longer than any wait, loop
turn included).

A turn has several Redis phases, and while Redis refuses writes (out of memory, say) the reads
among them still succeed: a wait that a success reset would stay the shortest forever (20 retries
and log lines a second). So a success only ends the wait under way, not the growth."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class Backoff:
    min_s: float
    max_s: float
    delay: float = 0.0  # the last wait chosen, before jitter (0: none since the last quiet spell)
    until: float = 0.0  # no Redis call before this (time.monotonic())
    last_failure: float = float("-inf")

    def ready(self, now: float) -> bool:
        return now >= self.until

    def failed(self, now: float) -> float:
        if now - self.last_failure >= 2 * self.max_s:  # the first failure after a quiet spell
            self.delay = 0.0
        self.last_failure = now
        self.delay = min(self.max_s, max(self.min_s, self.delay * 2))
        self.until = now + self.delay * (0.5 + random.random() / 2)
        return self.delay

    def succeeded(self) -> None:
        self.until = 0.0
