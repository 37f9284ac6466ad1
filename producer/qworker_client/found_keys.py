"""The keys readers find by SCAN rather than by name: the live workers' liveness keys, the
per-model streams and the per-model delayed sets. A SCAN looks at every key in Redis (about 200
calls over the keys of 100,000 jobs), so a reader that shows them often (the dashboard) finds
them once in a while (`dashboard/directory.py`) and reads each by name in between."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import redis
import redis.asyncio

from qworker_client.connect import is_cluster_client
from qworker_client.protocol import Keys

SCAN_COUNT = 1000  # keys SCAN looks at a call


@dataclass(frozen=True)
class FoundKeys:
    workers: tuple[str, ...]  # liveness keys, sorted
    streams: tuple[str, ...]  # per-model streams (new jobs and requeued work), unsorted
    delayed: tuple[str, ...]  # per-model delayed sets, unsorted


def find_keys(client: redis.Redis, keys: Keys) -> FoundKeys:
    return FoundKeys(worker_keys(client, keys), model_stream_keys(client, keys),
                     delayed_keys(client, keys))


def worker_keys(client: redis.Redis, keys: Keys) -> tuple[str, ...]:
    return tuple(sorted(_text(k) for k in client.scan_iter(match=keys.worker_pattern,
                                                          count=SCAN_COUNT)))


def model_stream_keys(client: redis.Redis, keys: Keys) -> tuple[str, ...]:
    return tuple(_text(k) for pattern in keys.model_stream_patterns
                 for k in client.scan_iter(match=pattern, count=SCAN_COUNT, _type="stream"))


def delayed_keys(client: redis.Redis, keys: Keys) -> tuple[str, ...]:
    """Each model's delayed set (`<prefix>:delayed:{<model>}`), not the model-less one."""
    head = keys.delayed_of(None) + ":{"
    found = map(_text, client.scan_iter(match=keys.delayed_pattern, count=SCAN_COUNT,
                                        _type="zset"))
    return tuple(k for k in found if k.startswith(head) and k.endswith("}"))


def values_of(client: redis.Redis, names: Sequence[str]) -> list[Any]:
    """GET of each key: one MGET, or on a Cluster (keys of several slots) one per slot."""
    if not names:
        return []
    if is_cluster_client(client):
        return list(cast(Any, client).mget_nonatomic(list(names)))
    return list(client.mget(names))


async def values_of_async(client: redis.asyncio.Redis, names: Sequence[str]) -> list[Any]:
    """`values_of` over `redis.asyncio`."""
    if not names:
        return []
    if is_cluster_client(client):
        return list(await cast(Any, client).mget_nonatomic(list(names)))
    return list(await client.mget(names))


def dead_keys(keys: Keys, cluster: bool, streams: Sequence[str]) -> list[str]:
    """The dead-letter streams: `<prefix>:dead`, or on a Cluster one per model of `streams`
    (each model's in its slot)."""
    if not cluster:
        return [keys.dead]
    models = dict.fromkeys(m for s in streams if (m := keys.stream_model(s)) is not None)
    return [keys.in_slot(model).dead for model in models]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
