"""Queue health from Redis alone: lengths, lag, pending (of the model-less streams and of each
model's), dead letters, live workers."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import redis
import redis.asyncio
from pydantic import ValidationError

from qworker_client.found_keys import (
    SCAN_COUNT,
    dead_keys,
    model_stream_keys,
    values_of,
    values_of_async,
    worker_keys,
)
from qworker_client.protocol import (
    BANDS,
    DEFAULT_GROUP,
    OFFERED_CONSUMER,
    PARKED_CONSUMER,
    Keys,
    WorkerInfo,
)


@dataclass(frozen=True)
class StreamStats:
    """One work stream and the workers' consumer group on it (zeros when either is missing)."""

    key: str
    length: int = 0
    group_exists: bool = False
    consumers: int = 0
    pending: int = 0  # delivered to a worker, not yet acked: in flight (parked ones aside)
    lag: int | None = 0  # entries not yet delivered to any worker; None when Redis cannot tell
    last_delivered_id: str | None = None
    parked: int = 0  # of `pending`, those the fair read parked (`~ready`): waiting their turn

    @property
    def waiting(self) -> int:
        """Entries not yet delivered to any worker, parked ones included. Where Redis reports no
        lag (the last delivered entry was deleted while older ones are pending: the normal state
        under load), `length - pending`, exact since workers delete the entries they
        acknowledge."""
        in_group = self.pending + self.parked
        undelivered = self.lag if self.lag is not None else max(self.length - in_group, 0)
        return undelivered + self.parked


@dataclass(frozen=True)
class Stats:
    jobs: StreamStats
    requeue: StreamStats
    dead_letters: int
    workers: list[dict[str, Any]] = field(default_factory=list)
    # every other work stream: the high and low bands' (model-less first), each model's, by
    # model, then band
    models: list[StreamStats] = field(default_factory=list)

    @property
    def streams(self) -> list[StreamStats]:
        """Every work stream: the model-less ones, then each model's (jobs, then requeue)."""
        return [self.jobs, self.requeue, *self.models]

    @property
    def live_workers(self) -> int:
        return len(self.workers)

    @property
    def backlog(self) -> int:
        """Work not yet taken by any worker, over every stream."""
        return sum(s.waiting for s in self.streams)

    @property
    def unfinished(self) -> int:
        """Jobs not yet finished, taken or not: the streams' lengths (acked entries are deleted).
        What the KEDA ScaledObject scales on (deploy/k8s/keda-scaledobject.yaml)."""
        return sum(s.length for s in self.streams)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "live_workers": self.live_workers, "backlog": self.backlog,
                "unfinished": self.unfinished}


def collect_stats(client: redis.Redis, keys: Keys, group: str = DEFAULT_GROUP,
                  cluster: bool = False) -> Stats:
    """`cluster`: Redis is a Cluster (dead letters are per model there)."""
    streams = model_streams(client, keys)
    return Stats(
        jobs=stream_stats(client, keys.jobs, group),
        requeue=stream_stats(client, keys.requeue, group),
        dead_letters=sum(int(client.xlen(key)) for key in dead_keys(keys, cluster, streams)),
        workers=live_workers(client, keys),
        models=[stream_stats(client, key, group) for key in streams],
    )


def model_streams(client: redis.Redis, keys: Keys,
                  found: Sequence[str] | None = None) -> list[str]:
    """The per-model streams there are (`<prefix>:jobs:{<model>}`, `<prefix>:requeue:{...}`),
    in order; `found`: their names as found before (else found now, by SCAN)."""
    return streams_in_order(keys, model_stream_keys(client, keys) if found is None else found)


def streams_in_order(keys: Keys, found: Sequence[bytes | str]) -> list[str]:
    """Per-model streams by model, band (high first), new jobs before requeued work."""
    names = {k.decode() if isinstance(k, bytes) else k for k in found}
    return sorted(names, key=lambda s: (keys.stream_model(s) or "",
                                        BANDS.index(keys.stream_band(s)), keys.is_requeue(s), s))


async def collect_stats_async(
    client: redis.asyncio.Redis, keys: Keys, group: str = DEFAULT_GROUP, cluster: bool = False
) -> Stats:
    """`collect_stats` over `redis.asyncio`."""

    async def stream(key: str) -> StreamStats:
        length = int(await client.xlen(key))
        exists = length > 0 or bool(await client.exists(key))
        stats = _stream_stats(key, length, await client.xinfo_groups(key) if exists else None,
                              group)
        if not stats.pending:
            return stats
        return with_parked(stats, await client.xpending(key, group))

    names = sorted([n async for n in client.scan_iter(match=keys.worker_pattern,
                                                      count=SCAN_COUNT)])
    values = await values_of_async(client, names)
    found = [key for pattern in keys.model_stream_patterns
             async for key in client.scan_iter(match=pattern, count=SCAN_COUNT, _type="stream")]
    streams = streams_in_order(keys, found)
    return Stats(
        jobs=await stream(keys.jobs),
        requeue=await stream(keys.requeue),
        dead_letters=sum([int(await client.xlen(key))
                          for key in dead_keys(keys, cluster, streams)]),
        workers=_workers(keys, names, values),
        models=[await stream(key) for key in streams],
    )


def stream_stats(client: redis.Redis, key: str, group: str) -> StreamStats:
    length = int(client.xlen(key))
    exists = length > 0 or bool(client.exists(key))
    stats = _stream_stats(key, length, client.xinfo_groups(key) if exists else None, group)
    return with_parked(stats, client.xpending(key, group)) if stats.pending else stats


def with_parked(stats: StreamStats, summary: Any) -> StreamStats:
    """The stream's parked entries (XPENDING's count for the consumers `~ready`, the fair
    share's, and `~offered`, prefix affinity's offers) moved from in flight to waiting."""
    parked = sum(int(c["pending"]) for c in (summary or {}).get("consumers") or ()
                 if (c["name"].decode() if isinstance(c["name"], bytes) else c["name"])
                 in (PARKED_CONSUMER, OFFERED_CONSUMER))
    return replace(stats, pending=stats.pending - parked, parked=parked)


def live_workers(client: redis.Redis, keys: Keys,
                 found: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Every live worker's info; `found`: the liveness keys as found before (else by SCAN)."""
    names = list(worker_keys(client, keys) if found is None else found)
    return _workers(keys, names, values_of(client, names))


def visible_workers(client: redis.Redis, keys: Keys) -> list[dict[str, Any]] | None:
    """`live_workers`, or None where this Redis user may not look (no SCAN: the producer ACL
    role, since SCAN would show every key's name): then nobody can tell who is there."""
    try:
        return live_workers(client, keys)
    except redis.exceptions.NoPermissionError:
        return None


def served_model(info: Mapping[str, Any]) -> str | None:
    """The model a live worker's key names: `served_model_name`, else `model`."""
    model = info.get("served_model_name") or info.get("model")
    return model if isinstance(model, str) and model else None


def live_models(client: redis.Redis, keys: Keys) -> set[str]:
    """The models the live workers serve now."""
    return {m for info in live_workers(client, keys) if (m := served_model(info)) is not None}


def why_not_served(workers: Sequence[Mapping[str, Any]], model: str | None) -> str | None:
    """None when one of the live `workers` would run a job of `model` now (None: a model-less
    job, which any worker runs); else why not, in words. The gateway's rule for its 503
    `no_live_worker` and 404 `model_not_found`."""
    if not workers:
        return "no worker is live"
    served = sorted({m for w in workers if (m := served_model(w)) is not None})
    if model is None or model in served:
        return None
    return f"no live worker serves model {model!r} (live workers serve: {', '.join(served)})"


def serving(workers: Sequence[Mapping[str, Any]], model: str | None) -> list[Mapping[str, Any]]:
    """The live `workers` that would run a job of `model` (None: every one)."""
    return [w for w in workers if model is None or served_model(w) == model]


def _stream_stats(
    key: str, length: int, groups: list[dict[str, Any]] | None, group: str
) -> StreamStats:
    """From XLEN and XINFO GROUPS (None: the stream does not exist)."""
    if groups is None:
        return StreamStats(key)
    info = next((g for g in groups if g["name"] == group), None)
    if info is None:
        return StreamStats(key, length=length, lag=length)
    return StreamStats(
        key,
        length=length,
        group_exists=True,
        consumers=int(info["consumers"]),
        pending=int(info["pending"]),
        lag=None if info.get("lag") is None else int(info["lag"]),
        last_delivered_id=info.get("last-delivered-id"),
    )


def _workers(keys: Keys, names: list[str], values: Sequence[bytes | str | None]
             ) -> list[dict[str, Any]]:
    """Every worker whose liveness key has not expired, as its `WorkerInfo` (sorted by name).

    A key whose value does not parse is still a live worker: it is listed with its name only."""
    workers = []
    for name, raw in zip(names, values, strict=True):
        if raw is None:  # expired between SCAN and MGET
            continue
        workers.append(_worker_info(keys.worker_name(name), raw))
    return workers


def _worker_info(name: str, raw: bytes | str) -> dict[str, Any]:
    try:
        return WorkerInfo.model_validate(json.loads(raw)).model_dump()
    except (ValueError, ValidationError):
        return {"name": name}
