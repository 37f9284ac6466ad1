"""The turn's Redis round trip (`Publisher.flush`), on a thread of its own beside the next engine
step: launched with copies of the outboxes, landed (its reply awaited) after the step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from qworker.service.job import ActiveJob, Entry
from qworker.service.outcome import FlushResult
from qworker.service.publisher import Publisher


@dataclass
class Flight:
    """A round trip under way: how many events of each outbox it writes, and its reply to come."""

    sent: dict[str, int]
    reply: Future[FlushResult]


class RoundTrip:
    def __init__(self, publisher: Publisher, hold: Callable[[list[Entry]], None],
                 name: str) -> None:
        self.publisher = publisher  # its `flush` looked up at each launch (tests wrap it)
        self.hold = hold  # entries read are kept owned from the moment they are read
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-redis")
        self._flight: Flight | None = None

    def launch(self, jobs: Sequence[ActiveJob], running: Sequence[str],
               caps: Sequence[tuple[str, int]]) -> None:
        """Write `jobs`' outboxes (copies) and requeues, read the cancel flags of `running` and
        the new entries `caps` allow; nothing to do: no round trip."""
        if not jobs and not running and not caps:
            return
        reply = self._thread.submit(self.publisher.flush, jobs, running, caps, self.hold)
        self._flight = Flight({job.job_id: len(job.outbox) for job in jobs}, reply)

    def land(self) -> tuple[FlushResult, dict[str, int]] | None:
        """The reply of the round trip under way (awaited; a Redis error raised), with how many
        events of each outbox it wrote; None when none is out."""
        flight, self._flight = self._flight, None
        if flight is None:
            return None
        return flight.reply.result(), flight.sent

    def shutdown(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
