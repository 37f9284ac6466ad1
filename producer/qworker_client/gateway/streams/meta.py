"""What the gateway remembers of a job so that any gateway can resume its stream: its response's
shape, its choice index and its owner (`owners`), in `<prefix>:gw:<id>` (JSON, for the workers'
`result_ttl`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

import redis.asyncio

from qworker_client.gateway.chat.shaping import Shape
from qworker_client.gateway.owners import Owner
from qworker_client.protocol import Keys


@dataclass(frozen=True)
class JobMeta:
    shape: Shape
    index: int
    include_usage: bool
    owner: Owner = None

    def to_json(self) -> str:
        data = {name: getattr(self.shape, name) for name in _SHAPE_FIELDS}  # not asdict: it
        data.update(index=self.index, include_usage=self.include_usage)  # deep-copies, 10x slower
        if self.owner is not None:
            data["owner"] = self.owner
        return _encode(data)

    @classmethod
    def from_json(cls, raw: str | bytes) -> JobMeta:
        data = json.loads(raw)
        index, include_usage = data.pop("index"), data.pop("include_usage")
        owner = data.pop("owner", None)
        return cls(Shape(**data), index, include_usage, owner)


_SHAPE_FIELDS = tuple(f.name for f in fields(Shape))
_encode = json.JSONEncoder(separators=(",", ":")).encode  # json.dumps made one per call


def meta_key(prefix: str, job_id: str) -> str:
    return Keys(prefix).gateway_job(job_id)


async def load(client: redis.asyncio.Redis, prefix: str, job_id: str) -> JobMeta | None:
    raw = await client.get(meta_key(prefix, job_id))
    return None if raw is None else JobMeta.from_json(raw)
