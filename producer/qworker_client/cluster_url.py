"""The `redis+cluster://` URL form: some nodes of a Redis Cluster (any will do: the client asks
one for the slot map and finds the rest), and how to talk to every node.

    redis+cluster://[user:password@]host[:port][,host[:port]...][/0][?options]
    rediss+cluster://...  (TLS to every node)

A node's port defaults to 6379. A cluster has only database 0. `user:password@` and the options
(`ssl_cert_reqs`, `ssl_ca_certs`, `protocol`, ...) are redis-py URL options for every node's
connections, parsed by redis-py itself.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import redis.connection

CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")
DEFAULT_PORT = 6379
_ADDRESS = re.compile(r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[^:\[\]]+))(?::(?P<port>\d+))?$")


@dataclass(frozen=True)
class ClusterTarget:
    """What a `redis+cluster://` URL says: the nodes to start from, and every node's settings
    (username/password, ssl and its options, URL options)."""

    nodes: tuple[tuple[str, int], ...]
    node_kwargs: dict[str, Any] = field(default_factory=dict)


def is_cluster_url(url: str) -> bool:
    return url.lower().startswith(CLUSTER_SCHEMES)


def parse_cluster_url(url: str) -> ClusterTarget:
    """The URL's parts, or a ValueError saying what is wrong with it."""
    scheme, rest = url.split("://", 1)
    tls = scheme.lower() == "rediss+cluster"
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    if path not in ("", "0"):
        raise ValueError("a Redis Cluster has only database 0 (the path must be empty or /0)")
    userinfo, _, hosts = netloc.rpartition("@")
    return ClusterTarget(_addresses(hosts), _node_kwargs(tls, userinfo, query))


def _addresses(hosts: str) -> tuple[tuple[str, int], ...]:
    if not hosts:
        raise ValueError("no cluster node address (host:port[,host:port...])")
    addresses = []
    for address in hosts.split(","):
        match = _ADDRESS.match(address.strip())
        if match is None:
            raise ValueError(f"cluster node address {address!r} is not host[:port]")
        port = int(match["port"] or DEFAULT_PORT)
        if not 0 < port < 65536:
            raise ValueError(f"cluster node port {port} is out of range")
        addresses.append((unquote(match["v6"] or match["host"]), port))
    return tuple(addresses)


def _node_kwargs(tls: bool, userinfo: str, query: str) -> dict[str, Any]:
    """redis-py's own parse of the same URL to one node (host, port and db left out)."""
    at = f"{userinfo}@" if userinfo else ""
    scheme = "rediss" if tls else "redis"
    kwargs = dict(redis.connection.parse_url(
        f"{scheme}://{at}cluster-node/0" + (f"?{query}" if query else "")))
    for placed in ("host", "port", "db", "connection_class"):
        kwargs.pop(placed, None)
    if tls:
        kwargs["ssl"] = True
    return kwargs
