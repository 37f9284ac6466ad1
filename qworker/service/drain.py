"""How a worker stops: the first stop request drains (no new work; running jobs finish until
`drain_timeout`, then are requeued), the second requeues what still runs at once. After either
deadline the worker keeps retrying its Redis writes for EXIT_GRACE_S, then exits."""

from __future__ import annotations

import time
from typing import Any

EXIT_GRACE_S = 5.0  # after a drain/requeue deadline, how long to keep retrying Redis writes


class Drain:
    def __init__(self, timeout_s: float, log: Any) -> None:
        self.timeout_s = timeout_s
        self.log = log
        self.draining = False
        self.requeue_now = False
        self.deadline = float("inf")  # past it, what still runs is requeued
        self.exit_by = float("inf")
        self._requests = 0  # request() calls, and how many were acted on
        self._taken = 0

    def request(self) -> None:
        """Only counts the call, so it is safe in a signal handler (which must not log: the
        handler runs on the loop's thread, maybe inside the logger's lock); the loop acts on it,
        and logs, at its next turn (`take`)."""
        self._requests += 1

    def take(self, jobs: int) -> None:
        """Act on the stop requests made since the last call (`jobs`: how many the worker holds)."""
        while self._taken < self._requests:
            self._taken += 1
            self._stop(jobs)

    def _stop(self, jobs: int) -> None:
        now = time.monotonic()
        if not self.draining:
            self.draining = True
            self.deadline = now + self.timeout_s
            self.exit_by = self.deadline + EXIT_GRACE_S
            self.log.info("draining", timeout_s=self.timeout_s, jobs=jobs)
        else:
            self.requeue_now = True
            self.exit_by = min(self.exit_by, now + EXIT_GRACE_S)
            self.log.info("requeueing at once", jobs=jobs)

    def requeue_due(self) -> bool:
        """Whether what still runs goes back to the queue now (asked twice, or past the drain's
        deadline); once done, `requeued` clears it."""
        return self.requeue_now or time.monotonic() >= self.deadline

    def requeued(self) -> None:
        self.deadline = float("inf")

    def finished(self, holding: bool) -> bool:
        """The loop ends: draining, and nothing held (or past the exit deadline)."""
        return self.draining and (not holding or time.monotonic() >= self.exit_by)
