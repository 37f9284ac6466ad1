"""The gateway's view of one model's keys: a Redis client for them, the keys, and the stream hub
that reads their outputs.

On one Redis (or behind Sentinel) every model shares one view: the gateway's client, `Keys`, one
hub. On a Redis Cluster a model's keys live in its hash slot (`{<model>}`), and the gateway's fast
paths (the submit's round trip, the hub's XREAD of many outputs, the vanished-job lookups) send
several keys' commands down one connection: so each model gets a view of its own, whose pool
connects to the master that serves the model's slot now (asked of the cluster client for each new
connection, the map refreshed when that master is gone: a failover costs the connections under
way, as with Sentinel).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, cast

import redis.asyncio
import redis.asyncio.cluster
from redis.asyncio.connection import Connection, SSLConnection
from redis.exceptions import RedisClusterException

from qworker_client.cluster_url import parse_cluster_url
from qworker_client.connect import is_cluster_client
from qworker_client.gateway.streams.hub import Hub
from qworker_client.protocol import Keys


@dataclass
class SlotView:
    redis: redis.asyncio.Redis
    keys: Keys
    hub: Hub


class SlotConnection(Connection):
    """A connection to whichever master serves its slot when it connects."""

    def __init__(self, *, cluster: redis.asyncio.cluster.RedisCluster, slot_key: str,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.cluster = cluster
        self.slot_key = slot_key

    async def _connect(self) -> None:
        try:
            await self.cluster.initialize()  # nothing to do once the slot map is known
            node = self.cluster.get_node_from_key(self.slot_key)
        except (redis.RedisError, RedisClusterException) as exc:  # mid-failover: no map yet
            raise redis.ConnectionError(f"no master found for {self.slot_key}: {exc}") from exc
        if node is None:
            raise redis.ConnectionError(f"no master serves the slot of {self.slot_key}")
        self.host, self.port = node.host, int(node.port)
        try:
            await super()._connect()
        except OSError:  # that master is gone: the next connection asks a fresh slot map
            with contextlib.suppress(redis.RedisError, RedisClusterException):
                await self.cluster.nodes_manager.initialize()
            raise


class SlotSSLConnection(SlotConnection, SSLConnection):
    pass


class Slots:
    """The view of each model's keys (`of`), made when first asked."""

    def __init__(self, client: redis.asyncio.Redis, keys: Keys, url: str, options: dict[str, Any],
                 max_connections: int, wait_s: float, interval_s: float) -> None:
        self.cluster = (cast(redis.asyncio.cluster.RedisCluster, client)
                        if is_cluster_client(client) else None)
        self.keys = keys
        self.url = url
        self.options = options
        self.max_connections = max_connections
        self.wait_s = wait_s
        self.interval_s = interval_s
        self.shared = SlotView(client, keys, Hub(client, keys, interval_s=interval_s))
        self._views: dict[str, SlotView] = {}

    def of(self, model: str | None) -> SlotView:
        """The view of a job of `model` (one Redis: the shared one, whatever the model)."""
        if self.cluster is None:
            return self.shared
        keys = self.keys.in_slot(model)  # ModelNeededError for a model-less job
        view = self._views.get(keys.slot or "")
        if view is None:
            view = self._views[keys.slot or ""] = self._view(keys)
        return view

    def _view(self, keys: Keys) -> SlotView:
        node_kwargs = parse_cluster_url(self.url).node_kwargs
        tls = bool(node_kwargs.pop("ssl", False))
        pool = redis.asyncio.BlockingConnectionPool(
            connection_class=SlotSSLConnection if tls else SlotConnection,
            max_connections=self.max_connections, timeout=self.wait_s,
            cluster=self.cluster, slot_key=keys.jobs_of(keys.slot),
            **{**self.options, **node_kwargs})
        client = redis.asyncio.Redis.from_pool(pool)
        return SlotView(client, keys, Hub(client, keys, interval_s=self.interval_s))

    @property
    def views(self) -> list[SlotView]:
        return [self.shared, *self._views.values()]

    async def close(self) -> None:
        for view in self.views:
            await view.hub.close()
        for view in self._views.values():
            await view.redis.aclose()
