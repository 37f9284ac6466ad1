"""Backoff for idempotent reads that survive dropped connections and Redis restarts."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import redis

# What a dropped connection or a restarting server looks like to redis-py (sync and asyncio raise
# the same classes). OSError covers a refused connect that slipped through unwrapped.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    ConnectionError,
)
# Subclasses of those that no retry can mend: a wrong password or user.
PERMANENT_ERRORS: tuple[type[BaseException], ...] = (redis.AuthenticationError,)

T = TypeVar("T")


@dataclass
class Backoff:
    """Exponential backoff with full jitter; gives up after `give_up_s` of continuous failure."""

    base_s: float = 0.05
    cap_s: float = 2.0
    give_up_s: float = 60.0
    failures: int = 0
    _first_failure: float | None = field(default=None, repr=False)

    def failed(self, exc: BaseException) -> float:
        """Record a failure: the delay to sleep, or `exc` re-raised once it is time to stop (at
        once for a permanent one)."""
        if isinstance(exc, PERMANENT_ERRORS):
            raise exc
        now = time.monotonic()
        if self._first_failure is None:
            self._first_failure = now
        if now - self._first_failure > self.give_up_s:
            raise exc
        self.failures += 1
        return random.uniform(0, min(self.cap_s, self.base_s * 2 ** (self.failures - 1)))


def capped(delay: float, deadline: float | None) -> float:
    """`delay`, cut short so a sleep does not run past `deadline` (a `time.monotonic()` value)."""
    if deadline is None:
        return delay
    return max(0.0, min(delay, deadline - time.monotonic()))


def with_retry(call: Callable[[], T], give_up_s: float) -> T:
    """Run an idempotent Redis call, retrying dropped connections with backoff."""
    backoff = Backoff(give_up_s=give_up_s)
    while True:
        try:
            return call()
        except TRANSIENT_ERRORS as exc:
            time.sleep(backoff.failed(exc))
