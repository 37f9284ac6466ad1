"""Workers' intakes on a real redis-server, without engines: what the fair read hands each one
(tests of the fair share)."""

from __future__ import annotations

import math
from typing import Any

import redis

from qworker.service.config import ServiceConfig
from qworker.service.groups import Groups
from qworker.service.intake import Intake
from qworker.service.job import Entry
from qworker.service.logs import get_logger
from qworker.service.scripts import Scripts
from qworker_client.protocol import Keys


def intake(client: redis.Redis, keys: Keys, name: str, **config: Any) -> Intake:
    cfg = ServiceConfig(redis_url="redis://unused", prefix=keys.prefix, name=name, **config)
    it = Intake(client, keys, cfg, Scripts(), token=f"{name}/1")
    Groups(client, it.streams, cfg.group, get_logger()).ensure()
    Scripts.load(client)
    return it


def submit(client: redis.Redis, keys: Keys, tenant: str | None, job_id: str,
           max_tokens: int = 8, prompt: str = "four", stream: str | None = None) -> str:
    fields = {"id": job_id, "prompt": prompt, "max_tokens": str(max_tokens)}
    if tenant is not None:
        fields["tenant"] = tenant
    return str(client.xadd(stream or keys.jobs, fields))  # type: ignore[arg-type]


def cost(prompt: str, max_tokens: int) -> int:
    """What the fair read charges a job (lua_fair.cost_of)."""
    return math.ceil(len(prompt) / 4) + max_tokens


def field(entry: Entry, name: str) -> str | None:
    value = entry.fields.get(name.encode(), entry.fields.get(name))
    return value.decode() if isinstance(value, bytes) else value


def finish(client: redis.Redis, entries: list[Entry], group: str = "workers") -> None:
    for e in entries:
        client.xack(e.stream, group, e.entry_id)
        client.xdel(e.stream, e.entry_id)
