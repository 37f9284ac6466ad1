"""Reading the workers' KV events (`<prefix>:kv_events`, docs/protocol.md "KV events"): each
worker's cached blocks rebuilt from the stream alone, and the block hashes of a prompt computed
as the workers compute them, so that a router can ask which worker holds the longest prefix.

An entry is one batch of one worker: `worker`, `token` (the worker process' fencing token, which
names its cache: a restarted worker is a new token), `model`, `seq` (the worker's batch count, from
0: a gap means batches were trimmed away, a repeat is a retry) and `batch`, the JSON of vLLM's
`KVEventBatch` (`ts`, `events`, `data_parallel_rank`) with hashes as hex strings.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Block = tuple[int, str]  # (group_idx, hex hash)


def block_hashes(token_ids: Sequence[int], block_size: int,
                 cache_salt: str | None = None) -> list[str]:
    """The hex hashes of the full blocks of `token_ids`, as the engine chains them
    (qworker/engine/prefix_cache.py): SHA-256 of b"R", then a little-endian signed byte (1 when a
    salt is given) and 8-byte length of the salt's UTF-8, then the salt, for the first block;
    SHA-256 of b"P" and the parent's 32-byte digest for the others; each followed by the block's
    token ids as little-endian signed 8-byte integers."""
    hashes: list[str] = []
    parent: bytes | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        if parent is not None:
            h = hashlib.sha256(b"P" + parent)
        else:
            salt = b"" if cache_salt is None else cache_salt.encode()
            h = hashlib.sha256(b"R" + struct.pack("<bq", cache_salt is not None, len(salt)) + salt)
        block = token_ids[start:start + block_size]
        h.update(struct.pack(f"<{len(block)}q", *block))
        parent = h.digest()
        hashes.append(parent.hex())
    return hashes


@dataclass(frozen=True)
class KVEventEntry:
    """One stream entry: a batch of one worker's events."""

    worker: str
    token: str
    model: str
    seq: int
    ts: float
    events: list[dict[str, Any]]

    @classmethod
    def parse(cls, fields: Mapping[bytes | str, bytes | str]) -> KVEventEntry:
        text = {_text(k): _text(v) for k, v in fields.items()}
        batch = json.loads(text["batch"])
        return cls(text["worker"], text["token"], text.get("model", ""), int(text["seq"]),
                   float(batch["ts"]), list(batch["events"]))


@dataclass
class WorkerBlocks:
    """What one worker process caches, by (group, hash), and the last batch applied."""

    blocks: set[Block] = field(default_factory=set)
    seq: int = -1
    gaps: int = 0  # batches missed (trimmed from the stream before they were read)


class CachedBlocks:
    """Each worker's cached blocks, rebuilt by applying its batches in stream order."""

    def __init__(self) -> None:
        self.workers: dict[str, WorkerBlocks] = {}  # by worker token

    def apply_entry(self, fields: Mapping[bytes | str, bytes | str]) -> None:
        entry = KVEventEntry.parse(fields)
        worker = self.workers.setdefault(entry.token, WorkerBlocks())
        if entry.seq <= worker.seq:
            return  # a batch written twice (a retry after a lost reply)
        worker.gaps += entry.seq - worker.seq - 1
        worker.seq = entry.seq
        apply(worker.blocks, entry.events)

    def blocks_of(self, token: str) -> set[Block]:
        worker = self.workers.get(token)
        return set(worker.blocks) if worker is not None else set()


def apply(blocks: set[Block], events: Sequence[Mapping[str, Any]]) -> None:
    """Applies events (the `events` of a batch, in order) to a set of cached blocks."""
    for event in events:
        kind = event["type"]
        if kind == "AllBlocksCleared":
            blocks.clear()
            continue
        group = int(event.get("group_idx") or 0)
        if kind == "BlockStored":
            blocks.update((group, h) for h in event["block_hashes"])
        elif kind == "BlockRemoved":
            blocks.difference_update((group, h) for h in event["block_hashes"])


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
