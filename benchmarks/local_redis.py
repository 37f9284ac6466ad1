"""A throwaway redis-server of the benchmark's own, on a free port (stopped on exit)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from qworker_client.local_redis import local_redis as temporary_redis

OPTIONS = ("--save", "", "--appendonly", "yes", "--appendfsync", "everysec")


@contextmanager
def local_redis() -> Iterator[str]:
    """Its URL, while it runs."""
    with temporary_redis(*OPTIONS) as server:
        yield server.url
