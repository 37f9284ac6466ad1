"""The gateway's Redis client: one pool for every request, that waits for a free connection.

redis-py's default asyncio pool holds at most 100 connections and fails a command past them
(`MaxConnectionsError`), so a few hundred requests arriving together got 503s. A blocking pool
makes a request wait its turn instead (up to `wait_s`, then a ConnectionError, retried as any
dropped connection is).

redis-py looks its own version up (importlib.metadata, about a millisecond) for every connection
it opens, unless given its driver info: it is looked up once here.

With a `redis+sentinel://` URL the pool is Sentinel's (see redis_clients.py): a failover costs the
requests under way their connection (retried as any dropped connection), and the next connection
goes to the master the sentinels name.
"""

from __future__ import annotations

import redis
import redis.asyncio

from qworker_client.connect import ClientOptions
from qworker_client.redis_clients import async_waiting_redis

MAX_CONNECTIONS = 256
WAIT_S = 20.0
_DRIVER = redis.DriverInfo()  # redis-py's name and version, for CLIENT SETINFO


def gateway_client(url: str, options: ClientOptions, max_connections: int = MAX_CONNECTIONS,
                   wait_s: float = WAIT_S) -> redis.asyncio.Redis:
    return async_waiting_redis(url, max_connections, wait_s, **connection_options(),
                               **options.kwargs())


def connection_options() -> dict[str, object]:
    """What the gateway's connections get beside the client options (its slot pools' too)."""
    return {"driver_info": _DRIVER}
