"""What the gateway remembers of a job so that any gateway can resume its stream: its response's
shape and its choice index, in `<prefix>:gw:<id>` (JSON, for the workers' `result_ttl`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

import redis.asyncio

from qworker_client.gateway.shaping import Shape


@dataclass(frozen=True)
class JobMeta:
    shape: Shape
    index: int
    include_usage: bool

    def to_json(self) -> str:
        data = {name: getattr(self.shape, name) for name in _SHAPE_FIELDS}  # not asdict: it
        data.update(index=self.index, include_usage=self.include_usage)  # deep-copies, 10x slower
        return _encode(data)

    @classmethod
    def from_json(cls, raw: str | bytes) -> JobMeta:
        data = json.loads(raw)
        index, include_usage = data.pop("index"), data.pop("include_usage")
        return cls(Shape(**data), index, include_usage)


_SHAPE_FIELDS = tuple(f.name for f in fields(Shape))
_encode = json.JSONEncoder(separators=(",", ":")).encode  # json.dumps made one per call


def meta_key(prefix: str, job_id: str) -> str:
    return f"{prefix}:gw:{job_id}"


async def load(client: redis.asyncio.Redis, prefix: str, job_id: str) -> JobMeta | None:
    raw = await client.get(meta_key(prefix, job_id))
    return None if raw is None else JobMeta.from_json(raw)
