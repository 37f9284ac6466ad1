"""Every Redis client of qworker comes from a URL here: sync, asyncio, or asyncio on a waiting pool.

`redis://`, `rediss://` and `unix://` go to redis-py's `from_url`; `redis+sentinel://` and
`rediss+sentinel://` (see sentinel_url.py) to a client of the master that redis-py's Sentinel
support finds, and finds again after a failover; `redis+cluster://` and `rediss+cluster://` (see
cluster_url.py) to redis-py's cluster client, typed as a `redis.Redis`: it answers the same
commands, as long as each multi-key command (and script) names keys of one hash slot.

`options` are redis-py connection keyword arguments (timeouts, decode_responses, retry,
client_name, ...); as with `from_url`, an option written in the URL wins over the same one given
here.

The sentinels themselves are asked with the caller's connect timeout as both connect and read
timeout (a dead sentinel costs that long, then the next one is asked), without retries.
"""

from __future__ import annotations

from typing import Any, cast

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.asyncio.sentinel
import redis.cluster
import redis.sentinel

from qworker_client.cluster_url import is_cluster_url, parse_cluster_url
from qworker_client.sentinel_pools import AsyncBlockingSentinelPool, AsyncSentinelPool, SentinelPool
from qworker_client.sentinel_url import SentinelTarget, is_sentinel_url, parse_sentinel_url

SENTINEL_TIMEOUT_S = 5.0  # when the caller gives no connect timeout


def sync_redis(url: str, **options: Any) -> redis.Redis:
    if is_cluster_url(url):
        cluster = parse_cluster_url(url)
        nodes = [redis.cluster.ClusterNode(host, port) for host, port in cluster.nodes]
        return cast(redis.Redis, redis.cluster.RedisCluster(
            startup_nodes=nodes, **{**options, **cluster.node_kwargs}))
    if not is_sentinel_url(url):
        return redis.Redis.from_url(url, **options)
    target = parse_sentinel_url(url)
    sentinel = redis.sentinel.Sentinel(target.sentinels,
                                       sentinel_kwargs=_sentinel_kwargs(target, options))
    return sentinel.master_for(target.service_name, connection_pool_class=SentinelPool,
                               **{**options, **target.node_kwargs})


def async_redis(url: str, **options: Any) -> redis.asyncio.Redis:
    if is_cluster_url(url):
        return _async_cluster(url, options)
    if not is_sentinel_url(url):
        return redis.asyncio.Redis.from_url(url, **options)
    return _async_master(url, AsyncSentinelPool, options)


def async_waiting_redis(url: str, max_connections: int, wait_s: float,
                        **options: Any) -> redis.asyncio.Redis:
    """An asyncio client whose pool holds at most `max_connections` and makes a command wait up
    to `wait_s` for a free one (then a ConnectionError). On a Cluster: at most `max_connections`
    to each node, and a command finding none free fails at once."""
    if is_cluster_url(url):
        return _async_cluster(url, {**options, "max_connections": max_connections})
    if not is_sentinel_url(url):
        pool = redis.asyncio.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=wait_s, **options)
        return redis.asyncio.Redis.from_pool(pool)  # closing the client closes its pool
    return _async_master(url, AsyncBlockingSentinelPool,
                         {**options, "max_connections": max_connections, "timeout": wait_s})


def _async_cluster(url: str, options: dict[str, Any]) -> redis.asyncio.Redis:
    target = parse_cluster_url(url)
    nodes = [redis.asyncio.cluster.ClusterNode(host, port) for host, port in target.nodes]
    return cast(redis.asyncio.Redis, redis.asyncio.cluster.RedisCluster(
        startup_nodes=nodes, **{**options, **target.node_kwargs}))


def _async_master(url: str, pool_class: type[AsyncSentinelPool],
                  options: dict[str, Any]) -> redis.asyncio.Redis:
    target = parse_sentinel_url(url)
    sentinel = redis.asyncio.sentinel.Sentinel(target.sentinels,
                                               sentinel_kwargs=_sentinel_kwargs(target, options))
    client: redis.asyncio.Redis = sentinel.master_for(
        target.service_name, connection_pool_class=pool_class,
        **{**options, **target.node_kwargs})
    return client


def _sentinel_kwargs(target: SentinelTarget, options: dict[str, Any]) -> dict[str, Any]:
    timeout = options.get("socket_connect_timeout") or SENTINEL_TIMEOUT_S
    return {"socket_connect_timeout": timeout, "socket_timeout": timeout,
            **target.sentinel_kwargs}
