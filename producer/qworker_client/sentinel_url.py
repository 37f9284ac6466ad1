"""The `redis+sentinel://` URL form: where the sentinels are, which master they watch, and how to
talk to the master and to the sentinels.

    redis+sentinel://[user:password@]host[:port][,host[:port]...]/service_name[/db][?options]
    rediss+sentinel://...  (TLS to the master and to the sentinels)

redis-py has no URL form for Sentinel; this is the one Prefect/docket and the Redis-Sentinel-Url
package use. A sentinel's port defaults to 26379. `user:password@` authenticates to the master
(and replicas), not to the sentinels: `?sentinel_username=...&sentinel_password=...` do that.
Every other option is a redis-py URL option (`ssl_cert_reqs`, `ssl_ca_certs`, `protocol`, ...)
for the master's connections, parsed by redis-py itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode

from qworker_client.url_parts import addresses, node_kwargs

SENTINEL_SCHEMES = ("redis+sentinel://", "rediss+sentinel://")
DEFAULT_SENTINEL_PORT = 26379
SENTINEL_AUTH_OPTIONS = {"sentinel_username": "username", "sentinel_password": "password"}


@dataclass(frozen=True)
class SentinelTarget:
    """What a `redis+sentinel://` URL says."""

    sentinels: tuple[tuple[str, int], ...]
    service_name: str
    # For the master's connections: db, username/password, ssl and its options, URL options.
    node_kwargs: dict[str, Any] = field(default_factory=dict)
    # For the sentinels' connections: their username/password; ssl and its options with TLS.
    sentinel_kwargs: dict[str, Any] = field(default_factory=dict)


def is_sentinel_url(url: str) -> bool:
    return url.lower().startswith(SENTINEL_SCHEMES)


def parse_sentinel_url(url: str) -> SentinelTarget:
    """The URL's parts, or a ValueError saying what is wrong with it."""
    scheme, rest = url.split("://", 1)
    tls = scheme.lower() == "rediss+sentinel"
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, _, hosts = netloc.rpartition("@")
    service_name, db = _service_and_db(path)
    options = parse_qsl(query, keep_blank_values=True)
    sentinel_auth = {SENTINEL_AUTH_OPTIONS[k]: v for k, v in options if k in SENTINEL_AUTH_OPTIONS}
    node_query = urlencode([(k, v) for k, v in options if k not in SENTINEL_AUTH_OPTIONS])
    node = node_kwargs(tls, userinfo, node_query, db)
    sentinels = addresses(hosts, "sentinel", DEFAULT_SENTINEL_PORT, " before the /")
    return SentinelTarget(sentinels, service_name, node,
                          {**sentinel_auth, **_tls_kwargs(node)})


def _service_and_db(path: str) -> tuple[str, str]:
    parts = [unquote(part) for part in path.split("/")] if path else []
    if not parts or not parts[0]:
        raise ValueError("no service name: the master's name the sentinels watch, "
                         "e.g. redis+sentinel://host:26379/mymaster")
    if len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
        raise ValueError("the path must be /service_name or /service_name/db (a number)")
    return parts[0], parts[1] if len(parts) == 2 else ""


def _tls_kwargs(node_kwargs: dict[str, Any]) -> dict[str, Any]:
    """With TLS, the sentinels get the same TLS settings as the master (one CA for the lot)."""
    return {k: v for k, v in node_kwargs.items() if k == "ssl" or k.startswith("ssl_")}
