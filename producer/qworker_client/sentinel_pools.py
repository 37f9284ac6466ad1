"""redis-py's Sentinel pools, closing their sentinels' connections with their own.

redis-py's master pool asks the sentinels where the master is whenever it opens a connection
(and after a failover it is told so by a refused connection or a READONLY reply), but closing a
client closes only its pool: the sentinels' connections stayed open until the garbage collector
came by. A full disconnect (a client's close) now closes them too; the partial one that a
failover does (idle connections only) leaves them be.

`AsyncBlockingSentinelPool` is the gateway's waiting pool (see gateway/connection.py) on top of
Sentinel: a request waits for a free connection instead of failing past `max_connections`.
"""

from __future__ import annotations

import redis.asyncio
import redis.asyncio.sentinel
import redis.sentinel


class SentinelPool(redis.sentinel.SentinelConnectionPool):
    def disconnect(self, inuse_connections: bool = True) -> None:
        super().disconnect(inuse_connections)
        if inuse_connections:
            for sentinel in self.sentinel_manager.sentinels:
                sentinel.connection_pool.disconnect()


class AsyncSentinelPool(redis.asyncio.sentinel.SentinelConnectionPool):
    async def disconnect(self, inuse_connections: bool = True) -> None:
        await super().disconnect(inuse_connections)
        if inuse_connections:
            for sentinel in self.sentinel_manager.sentinels:
                await sentinel.connection_pool.disconnect()


class AsyncBlockingSentinelPool(AsyncSentinelPool, redis.asyncio.BlockingConnectionPool):
    """Sentinel's master discovery with BlockingConnectionPool's wait for a free connection."""
