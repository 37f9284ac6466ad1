"""The `redis+cluster://` URL form: some nodes of a Redis Cluster (any will do: the client asks
one for the slot map and finds the rest), and how to talk to every node.

    redis+cluster://[user:password@]host[:port][,host[:port]...][/0][?options]
    rediss+cluster://...  (TLS to every node)

A node's port defaults to 6379. A cluster has only database 0. `user:password@` and the options
(`ssl_cert_reqs`, `ssl_ca_certs`, `protocol`, ...) are redis-py URL options for every node's
connections, parsed by redis-py itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from qworker_client.url_parts import addresses, node_kwargs

CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")
DEFAULT_PORT = 6379


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
    return ClusterTarget(addresses(hosts, "cluster node", DEFAULT_PORT),
                         node_kwargs(tls, userinfo, query, None))
