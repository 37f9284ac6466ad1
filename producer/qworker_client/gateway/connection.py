"""The gateway's Redis client: one pool for every request, that waits for a free connection.

redis-py's default asyncio pool holds at most 100 connections and fails a command past them
(`MaxConnectionsError`), so a few hundred requests arriving together got 503s. A blocking pool
makes a request wait its turn instead (up to `wait_s`, then a ConnectionError, retried as any
dropped connection is).

redis-py looks its own version up (importlib.metadata, about a millisecond) for every connection
it opens, unless given its driver info: it is looked up once here.
"""

from __future__ import annotations

import redis
import redis.asyncio

from qworker_client.connect import ClientOptions

MAX_CONNECTIONS = 256
WAIT_S = 20.0
_DRIVER = redis.DriverInfo()  # redis-py's name and version, for CLIENT SETINFO


def gateway_client(url: str, options: ClientOptions, max_connections: int = MAX_CONNECTIONS,
                   wait_s: float = WAIT_S) -> redis.asyncio.Redis:
    pool = redis.asyncio.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=wait_s, driver_info=_DRIVER,
        **options.kwargs())
    return redis.asyncio.Redis.from_pool(pool)  # closing the client closes its pool
