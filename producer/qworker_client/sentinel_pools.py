"""redis-py's Sentinel pools and connections, with two gaps closed.

- A connection that lost its server reconnected, when next used, to the address it had: its
  `send_packed_command` reconnects through `connect_check_health`, past the Sentinel connection's
  `connect` (which asks the sentinels where the master is now). A connection taken from the pool
  for each command is connected through `connect` by the pool; one held for long (the gateway's
  stream reader holds one) kept knocking at the dead master. Here a send reconnects through
  `connect`, so through the sentinels.
- Closing a client closed only its pool: the sentinels' connections stayed open until the garbage
  collector came by. A full disconnect (a client's close) now closes them too; the partial one
  that a failover does (idle connections only) leaves them be.

`AsyncBlockingSentinelPool` is the gateway's waiting pool (see gateway/connection.py) on top of
Sentinel: a request waits for a free connection instead of failing past `max_connections`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import redis.asyncio
import redis.asyncio.sentinel
import redis.sentinel


class SentinelConnection(redis.sentinel.SentinelManagedConnection):
    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if not self._sock:
            self.connect()  # through the sentinels, to the master they name now
        super().send_packed_command(command, check_health)


class SentinelSSLConnection(SentinelConnection, redis.connection.SSLConnection):
    pass


class AsyncSentinelConnection(redis.asyncio.sentinel.SentinelManagedConnection):
    async def send_packed_command(self, command: bytes | str | Iterable[bytes],
                                  check_health: bool = True) -> None:
        if not self.is_connected:
            await self.connect()  # through the sentinels, to the master they name now
        await super().send_packed_command(command, check_health)


class AsyncSentinelSSLConnection(AsyncSentinelConnection, redis.asyncio.connection.SSLConnection):
    pass


class SentinelPool(redis.sentinel.SentinelConnectionPool):
    def __init__(self, service_name: str, sentinel_manager: redis.sentinel.Sentinel,
                 **kwargs: Any) -> None:
        tls = kwargs.pop("ssl", False)
        kwargs.setdefault("connection_class", SentinelSSLConnection if tls else SentinelConnection)
        super().__init__(service_name, sentinel_manager, **kwargs)

    def disconnect(self, inuse_connections: bool = True) -> None:
        super().disconnect(inuse_connections)
        if inuse_connections:
            for sentinel in self.sentinel_manager.sentinels:
                sentinel.connection_pool.disconnect()


class AsyncSentinelPool(redis.asyncio.sentinel.SentinelConnectionPool):
    def __init__(self, service_name: str, sentinel_manager: redis.asyncio.sentinel.Sentinel,
                 **kwargs: Any) -> None:
        tls = kwargs.pop("ssl", False)
        kwargs.setdefault("connection_class",
                          AsyncSentinelSSLConnection if tls else AsyncSentinelConnection)
        super().__init__(service_name, sentinel_manager, **kwargs)

    async def disconnect(self, inuse_connections: bool = True) -> None:
        await super().disconnect(inuse_connections)
        if inuse_connections:
            for sentinel in self.sentinel_manager.sentinels:
                await sentinel.connection_pool.disconnect()


class AsyncBlockingSentinelPool(AsyncSentinelPool, redis.asyncio.BlockingConnectionPool):
    """Sentinel's master discovery with BlockingConnectionPool's wait for a free connection."""
