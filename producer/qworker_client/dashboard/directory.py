"""The keys the dashboard's pages read by name but can only find by SCAN (the live workers', the
per-model streams and delayed sets: `found_keys`), found again every `REFRESH_S` in a thread of
their own while someone looks (a page asked in the last `IDLE_S`), never in a page's request: a
SCAN looks at every key in Redis (~770 calls, 0.3-0.7 s, over the keys of 100,000 jobs), so a
page's calls stay a fixed number. A worker or model that appears is shown within REFRESH_S; one
that goes is shown gone at once (its keys are read by name on every page)."""

from __future__ import annotations

import threading
import time

import redis
import structlog

from qworker_client.found_keys import FoundKeys, find_keys
from qworker_client.protocol import Keys

REFRESH_S = 5.0
IDLE_S = 60.0  # no page asked for this long: nobody looks, the thread ends

log = structlog.get_logger(__name__)


class Directory:
    def __init__(self, client: redis.Redis, keys: Keys, refresh_s: float = REFRESH_S) -> None:
        self.client, self.keys, self.refresh_s = client, keys, refresh_s
        self._found: FoundKeys | None = None
        self._at = 0.0  # when they were found (monotonic)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._asked = time.monotonic()

    def found(self) -> FoundKeys:
        """The keys as last found; the first call finds them (and starts the thread)."""
        with self._lock:
            self._asked = time.monotonic()
            if self._found is None or self._stale():
                self._found, self._at = find_keys(self.client, self.keys), time.monotonic()
            if self._thread is None:
                self._thread = threading.Thread(target=self._refresh, name="dashboard-keys",
                                                daemon=True)
                self._thread.start()
            return self._found

    def _stale(self) -> bool:
        """Found before an idle time (the thread did not refresh them): found again now."""
        return time.monotonic() - self._at > self.refresh_s + IDLE_S

    def _refresh(self) -> None:
        while True:
            time.sleep(self.refresh_s)
            with self._lock:
                if time.monotonic() - self._asked > IDLE_S:  # nobody looks: it ends (the next
                    self._thread = None  # page starts another), and a dashboard gone with it
                    return
            try:
                found = find_keys(self.client, self.keys)
            except redis.RedisError as exc:  # kept as they were; the pages say what fails
                log.warning("dashboard_keys_not_found", reason=str(exc))
                continue
            with self._lock:
                self._found, self._at = found, time.monotonic()
