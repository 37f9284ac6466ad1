"""A fake worker for the producer's tests: writes protocol events to `<prefix>:out:<id>`."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import redis

from qworker_client.protocol import DoneEvent, ErrorEvent, Keys, TokenEvent, event_to_fields

Event = TokenEvent | DoneEvent | ErrorEvent


def token_events(texts: list[str]) -> list[TokenEvent]:
    return [TokenEvent(i=i, token_id=100 + i, text=t) for i, t in enumerate(texts)]


def done_event(texts: list[str], finish_reason: str = "length") -> DoneEvent:
    return DoneEvent(
        finish_reason=finish_reason, text="".join(texts), prompt_tokens=3,
        completion_tokens=len(texts), queue_ms=1, ttft_ms=2, total_ms=3,
    )


def completion(texts: list[str], finish_reason: str = "length") -> list[Event]:
    return [*token_events(texts), done_event(texts, finish_reason)]


class FakeWorker(threading.Thread):
    """Writes `events` for `job_id`, `delay_s` apart. Before event `pause_at` it calls `pause`
    (e.g. to wait until the test has dropped connections). Its client reconnects through
    redis-py's retries."""

    def __init__(
        self, url: str, job_id: str, events: list[Event], *, prefix: str = "qw",
        delay_s: float = 0.005, pause_at: int | None = None,
        pause: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(daemon=True)
        self.client = redis.Redis.from_url(url, decode_responses=True)
        self.key = Keys(prefix).out(job_id)
        self.events = events
        self.delay_s = delay_s
        self.pause_at = pause_at
        self.pause = pause
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for n, event in enumerate(self.events):
                if n == self.pause_at and self.pause is not None:
                    self.pause()
                self.client.xadd(self.key, event_to_fields(event))
                time.sleep(self.delay_s)
        except BaseException as exc:  # surfaced by finish()
            self.error = exc

    def finish(self, timeout: float = 30) -> None:
        self.join(timeout)
        assert not self.is_alive(), "fake worker did not finish"
        self.client.close()
        if self.error is not None:
            raise self.error


def wait_for(condition: Callable[[], bool], timeout: float = 10, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def blocked_readers(client: redis.Redis) -> int:
    """Clients now blocked in XREAD."""
    return sum(
        1 for c in client.client_list(_type="normal")
        if c.get("cmd") == "xread" and "b" in c.get("flags", "")
    )
