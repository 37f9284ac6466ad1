"""A throwaway redis-server of the benchmark's own, on a free port (stopped on exit)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from qworker_client.local_redis import local_redis as temporary_redis

OPTIONS = ("--save", "", "--appendonly", "yes", "--appendfsync", "everysec")
NO_AOF = ("--save", "", "--appendonly", "no")


@contextmanager
def local_redis(aof: bool = True) -> Iterator[str]:
    """Its URL, while it runs: with an AOF fsynced every second, as a production Redis that keeps
    its jobs would run (`aof` False: no persistence at all)."""
    with temporary_redis(*(OPTIONS if aof else NO_AOF)) as server:
        yield server.url
