"""What the `redis+sentinel://` and `redis+cluster://` URL forms share: a list of `host[:port]`
addresses, and redis-py's own parse of the options every node's connection gets."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote

import redis.connection

_ADDRESS = re.compile(r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[^:\[\]]+))(?::(?P<port>\d+))?$")


def addresses(hosts: str, what: str, default_port: int, hint: str = ""
              ) -> tuple[tuple[str, int], ...]:
    """`host[:port],...` as (host, port) pairs (IPv6 in brackets), or a ValueError naming `what`
    (`sentinel`, `cluster node`) and what is wrong."""
    if not hosts:
        raise ValueError(f"no {what} address (host:port[,host:port...]{hint})")
    found = []
    for address in hosts.split(","):
        match = _ADDRESS.match(address.strip())
        if match is None:
            raise ValueError(f"{what} address {address!r} is not host[:port]")
        port = int(match["port"] or default_port)
        if not 0 < port < 65536:
            raise ValueError(f"{what} port {port} is out of range")
        found.append((unquote(match["v6"] or match["host"]), port))
    return tuple(found)


def node_kwargs(tls: bool, userinfo: str, query: str, db: str | None) -> dict[str, Any]:
    """redis-py's own parse of the same URL to one node: username/password, the options, ssl
    with TLS, and the database unless `db` is None (host and port left out)."""
    at = f"{userinfo}@" if userinfo else ""
    scheme = "rediss" if tls else "redis"
    kwargs = dict(redis.connection.parse_url(
        f"{scheme}://{at}node/{db or ''}" + (f"?{query}" if query else "")))
    for placed in ("host", "port", "connection_class", *(("db",) if db is None else ())):
        kwargs.pop(placed, None)
    if tls:
        kwargs["ssl"] = True  # the pools pick their TLS connection class from this
    return kwargs
