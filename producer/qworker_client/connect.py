"""Redis clients for the producer: sync and asyncio, from one URL, with timeouts that fit BLOCK."""

from __future__ import annotations

import math
import os
import re
import time
from dataclasses import dataclass
from typing import TypedDict
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.cluster
from redis.backoff import NoBackoff
from redis.retry import Retry

from qworker_client.cluster_url import CLUSTER_SCHEMES, is_cluster_url, parse_cluster_url
from qworker_client.protocol import Keys
from qworker_client.redis_clients import async_redis, sync_redis
from qworker_client.sentinel_url import SENTINEL_SCHEMES, is_sentinel_url, parse_sentinel_url

DEFAULT_REDIS_URL = "redis://localhost:6379/0"
# The producer never trims `<prefix>:jobs`, but it bounds how long it blocks in one read.
DEFAULT_BLOCK_MS = 5_000
# The workers' default `--result-ttl`: how long an output stream outlives its last event. Submit
# markers and cancel flags live no longer, so a job id can be used again once its output is gone.
DEFAULT_RESULT_TTL_S = 3_600
READ_COUNT = 512  # entries per XREAD: a whole burst of tokens in one round trip
URL_SCHEMES = ("redis://", "rediss://", "unix://", *SENTINEL_SCHEMES, *CLUSTER_SCHEMES)
_USERINFO = re.compile(r"([^/:@]*):[^@/]*@")
_PASSWORD_OPTION = re.compile(r"([?&](?:sentinel_)?password=)[^&#]*")


class RedisURLError(ValueError):
    """A Redis URL that redis-py cannot use (a usage error: exit 2)."""


class RedisUnreachable(Exception):
    """No Redis answered at the URL within the connect timeout (a runtime error: exit 3)."""


def redis_url_from_env() -> str:
    return os.environ.get("REDIS_URL") or os.environ.get("QWORKER_REDIS_URL") or DEFAULT_REDIS_URL


class RedisKwargs(TypedDict):
    decode_responses: bool
    socket_timeout: float
    socket_connect_timeout: float


@dataclass(frozen=True)
class ClientOptions:
    """How the producer talks to Redis.

    A blocking read (`XREAD BLOCK block_ms`) needs a socket timeout longer than its BLOCK, or the
    client gives up on a healthy connection; `socket_timeout` is derived from `block_ms`.
    AUTH, ACL users, TLS (`rediss://`) and the database come from the URL (redis-py `from_url`;
    `redis+sentinel://` finds the master through Sentinel, see sentinel_url.py).
    """

    block_ms: int = DEFAULT_BLOCK_MS
    connect_timeout_s: float = 5.0
    socket_margin_s: float = 10.0
    # How long a stream read (or an idempotent submit) keeps retrying a dead connection.
    reconnect_give_up_s: float = 60.0
    # The workers' --result-ttl: the lifetime of submit markers and the longest cancel flag.
    result_ttl_s: int = DEFAULT_RESULT_TTL_S

    def __post_init__(self) -> None:
        if self.block_ms < 1:
            raise ValueError("block_ms must be >= 1 (XREAD BLOCK 0 would block forever)")
        if self.result_ttl_s < 1:
            raise ValueError("result_ttl_s must be >= 1")

    def cancel_ttl(self, ttl_s: int | None) -> int:
        """A cancel flag's TTL: `ttl_s`, at most `result_ttl_s` (a flag that outlived the job's
        output would cancel a later job reusing the id)."""
        return self.result_ttl_s if ttl_s is None else max(1, min(ttl_s, self.result_ttl_s))

    @property
    def socket_timeout_s(self) -> float:
        return self.block_ms / 1000 + self.socket_margin_s

    def block_for(self, deadline: float | None) -> int | None:
        """BLOCK ms for the next read: `block_ms`, shortened to what is left before `deadline`
        (a `time.monotonic()` value); None once the deadline has passed."""
        if deadline is None:
            return self.block_ms
        left_ms = math.ceil((deadline - time.monotonic()) * 1000)
        return min(self.block_ms, left_ms) if left_ms > 0 else None

    def kwargs(self) -> RedisKwargs:
        return {
            "decode_responses": True,
            "socket_timeout": self.socket_timeout_s,
            "socket_connect_timeout": self.connect_timeout_s,
        }


def is_cluster_client(client: object) -> bool:
    """Whether `client` talks to a Redis Cluster (redis-py's cluster clients, sync or asyncio)."""
    return isinstance(client, (redis.cluster.RedisCluster, redis.asyncio.cluster.RedisCluster))


def slot_keys(keys: Keys, cluster: bool, model: str | None) -> Keys:
    """The keys of a job of `model`: on a Cluster those of its model's hash slot (a ValueError
    for a model-less job there), else `keys` as they are."""
    return keys.in_slot(model) if cluster else keys


def sync_client(url: str, options: ClientOptions) -> redis.Redis:
    return sync_redis(url, **options.kwargs())


def async_client(url: str, options: ClientOptions) -> redis.asyncio.Redis:
    return async_redis(url, **options.kwargs())


def masked(url: str) -> str:
    """`url` with its passwords, if any, as `***` (what error and ready lines print): the one
    before `@` and those of `?password=` and `?sentinel_password=`."""
    url = _PASSWORD_OPTION.sub(r"\1***", url)
    try:
        parts = urlsplit(url)
    except ValueError:  # e.g. several bracketed IPv6 sentinels
        return _USERINFO.sub(r"\1:***@", url, count=1)
    if parts.password is None:  # none, or a URL too broken to parse: any `user:secret@` hidden
        return _USERINFO.sub(r"\1:***@", url, count=1)
    user = parts.username or ""
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def checked_url(url: str) -> str:
    """`url` if redis-py can use it, else a `RedisURLError` saying what is wrong."""
    if not url.startswith(URL_SCHEMES):
        raise RedisURLError(f"invalid Redis URL {masked(url)!r}: it must start with "
                            f"{', '.join(URL_SCHEMES)} (e.g. redis://localhost:6379/0)")
    try:
        if is_sentinel_url(url):
            parse_sentinel_url(url)
        elif is_cluster_url(url):
            parse_cluster_url(url)
        else:
            redis.connection.parse_url(url)
    except ValueError as exc:
        raise RedisURLError(f"invalid Redis URL {masked(url)!r}: {exc}") from None
    return url


def check_reachable(url: str, options: ClientOptions) -> None:
    """One PING, on a connection of its own, given `connect_timeout_s` to connect and as long to
    answer, without retries: a `RedisUnreachable` saying where and why when it fails (before a
    command would sit in a blocking read or a long reconnect loop). A refusal of the password or
    the ACL is raised as is: that is no reachability problem."""
    client = sync_redis(
        url, socket_connect_timeout=options.connect_timeout_s,
        socket_timeout=options.connect_timeout_s, retry=Retry(NoBackoff(), 0))
    try:
        client.ping()
    except redis.AuthenticationError:
        raise
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
        why = " ".join(str(exc).split()) or type(exc).__name__
        raise RedisUnreachable(f"cannot reach Redis at {masked(url)} within "
                               f"{options.connect_timeout_s:g} s: {why}") from None
    finally:
        client.close()
