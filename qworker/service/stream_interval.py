"""`--stream-interval-ms`: how often the worker's round trip goes out while its engine runs.

Every step's round trip costs Redis a script call, the keys of every job it touches, the cancel
flags and a read, whatever the number of tokens. With an interval, the tokens of the steps within
it go out together (each still its own entry: the wire contract does not change), so a fleet
that prefers throughput pays those once per interval. What a client waits on is not held back:
a job's first token, its end (done, error, requeue), and anything when the engine is idle or
draining go out at the next step."""

from __future__ import annotations

from collections.abc import Iterable

from qworker.service.job import ActiveJob
from qworker_client.protocol import TokenEvent


class StreamInterval:
    def __init__(self, interval_ms: int) -> None:
        self.interval_s = interval_ms / 1000
        self._last = float("-inf")

    def due(self, now: float, jobs: Iterable[ActiveJob], busy: bool) -> bool:
        """Whether the round trip goes out now: no interval, an idle (or draining) engine, the
        interval passed since the last one, or a job with something a client waits on."""
        if self.interval_s == 0 or not busy or now - self._last >= self.interval_s:
            return True
        return any(_urgent(job) for job in jobs)

    def launched(self, now: float) -> None:
        self._last = now


def _urgent(job: ActiveJob) -> bool:
    """Ended or requeued, or its first token is waiting (after the prompt_logprobs event)."""
    return not job.in_engine or any(isinstance(e, TokenEvent) and e.i == 0
                                    for e in job.outbox[:2])
