"""A response as kept in Redis: `<prefix>:resp:<response id>`, JSON, with the result TTL.

The record holds what the response object shows of its request, its input items, the chat
messages of the conversation before it (a `previous_response_id` chain, flattened: one read
continues it), its owner, its job, and once its end has been seen, its final state (output
items, usage, status), so that it is served without its job's output stream. Until then the
response is read from that stream (`follow.py`), by any gateway.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

import redis.asyncio

from qworker_client.gateway.owners import Owner
from qworker_client.protocol import Keys

MAX_CHAIN_DEPTH = 64  # responses in one `previous_response_id` chain
_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


@dataclass
class Final:
    """How a response ended, as its object shows it."""

    status: str  # completed | incomplete | failed | cancelled
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    completed_at: int | None = None


@dataclass
class StoredResponse:
    id: str
    job_id: str
    created_at: int
    model: str
    request: dict[str, Any]  # the response object's fields taken from the request
    input: list[dict[str, Any]]  # the input items
    history: list[dict[str, Any]]  # chat messages of the chain before this response
    depth: int = 1  # responses in its chain, itself included
    owner: Owner = None
    background: bool = False
    store: bool = True
    cancelled: bool = False  # a cancel was asked (its job may not have seen it yet)
    final: Final | None = None

    def to_json(self) -> str:
        return _encode(asdict(self))

    @classmethod
    def from_json(cls, raw: str | bytes) -> StoredResponse:
        data = json.loads(raw)
        final = data.pop("final")
        return cls(**data, final=None if final is None else Final(**final))


def key(keys: Keys, response_id: str) -> str:
    return keys.response(response_id)


async def load(client: redis.asyncio.Redis, keys: Keys, response_id: str
               ) -> StoredResponse | None:
    raw = await client.get(key(keys, response_id))
    return None if raw is None else StoredResponse.from_json(raw)


async def update(client: redis.asyncio.Redis, keys: Keys, stored: StoredResponse,
                 ttl_s: int | None) -> bool:
    """Write the record again, only if it is still there (a delete stays a delete): its TTL
    `ttl_s` from now, or (None) the one it has. False when it was gone."""
    value = stored.to_json()
    if ttl_s is None:
        return bool(await client.set(key(keys, stored.id), value, xx=True, keepttl=True))
    return bool(await client.set(key(keys, stored.id), value, xx=True, ex=ttl_s))


async def delete(client: redis.asyncio.Redis, keys: Keys, response_id: str) -> bool:
    return bool(await client.delete(key(keys, response_id)))
