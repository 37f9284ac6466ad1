"""KV events: what the prefix cache gained and lost, for routers outside the worker.

The schema is vLLM's (`vllm/distributed/kv_events.py`), which NVIDIA Dynamo and llm-d read:
`BlockStored` (full blocks registered in the cache, a chain: each block's parent is the one
before it, the first's is `parent_block_hash`), `BlockRemoved` (cached blocks evicted) and
`AllBlocksCleared` (the whole cache dropped). A consumer that applies them in order to a set of
(group, hash) holds exactly what the block managers cache (docs/protocol.md, "KV events").

The block managers record into a `KVEventLog`; the engine hands its events out
(`EngineCore.take_kv_events`). Off unless a log is attached (`EngineCore.record_kv_events`). The
log is bounded: past `limit` blocks buffered it drops what it holds and asks the engine to drop
its prefix cache (`overflowed`), so that the `AllBlocksCleared` it then holds is true: the events
are never wrong, at the price of the cache where nobody takes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

DEFAULT_LIMIT = 65_536  # blocks' events a log holds between two takes
FULL_ATTENTION = "full_attention"  # vLLM's KVCacheSpecKind values
SLIDING_WINDOW = "sliding_window"


@dataclass(frozen=True)
class KVGroupSpec:
    """What a block manager's events say of its pool: vLLM's group fields."""

    group_idx: int = 0
    sliding_window: int | None = None

    @property
    def kind(self) -> str:
        return FULL_ATTENTION if self.sliding_window is None else SLIDING_WINDOW


@dataclass
class BlockStored:
    """Consecutive full blocks of one sequence newly cached: `token_ids` are theirs, in order
    (`block_size` each); the first block's parent is `parent_block_hash` (None: it is first)."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    group: KVGroupSpec = field(default_factory=KVGroupSpec)

    def wire(self, medium: str) -> dict[str, Any]:
        return {"type": "BlockStored", "block_hashes": [h.hex() for h in self.block_hashes],
                "parent_block_hash": _hex(self.parent_block_hash), "token_ids": self.token_ids,
                "block_size": self.block_size, "lora_id": None, "medium": medium,
                "lora_name": None, "group_idx": self.group.group_idx,
                "kv_cache_spec_kind": self.group.kind,
                "kv_cache_spec_sliding_window": self.group.sliding_window}


@dataclass
class BlockRemoved:
    """Cached blocks evicted (their pool handed them out for other tokens)."""

    block_hashes: list[bytes]
    group: KVGroupSpec = field(default_factory=KVGroupSpec)

    def wire(self, medium: str) -> dict[str, Any]:
        return {"type": "BlockRemoved", "block_hashes": [h.hex() for h in self.block_hashes],
                "medium": medium, "group_idx": self.group.group_idx}


@dataclass
class AllBlocksCleared:
    """Every cached block of every group forgotten."""

    def wire(self, medium: str) -> dict[str, Any]:
        return {"type": "AllBlocksCleared"}


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def _hex(h: bytes | None) -> str | None:
    return None if h is None else h.hex()


class KVEventLog:
    """The events since the last `take`, adjacent ones of a kind merged; at most `limit` blocks."""

    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        assert limit >= 1
        self.limit = limit
        self.overflowed = False  # the engine must drop its cache (then `cleared` resets this)
        self._events: list[KVEvent] = []
        self._blocks = 0

    def stored(self, group: KVGroupSpec, h: bytes, parent: bytes | None,
               tokens: Sequence[int]) -> None:
        last = self._events[-1] if self._events else None
        if (isinstance(last, BlockStored) and last.group == group
                and last.block_hashes[-1] == parent):
            last.block_hashes.append(h)
            last.token_ids.extend(tokens)
        else:
            self._add(BlockStored([h], parent, list(tokens), len(tokens), group))
        self._count()

    def removed(self, group: KVGroupSpec, h: bytes) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved) and last.group == group:
            last.block_hashes.append(h)
        else:
            self._add(BlockRemoved([h], group))
        self._count()

    def cleared(self) -> None:
        """The cache is dropped: whatever came before no longer matters."""
        self._events, self._blocks, self.overflowed = [AllBlocksCleared()], 0, False

    def take(self) -> list[KVEvent]:
        events, self._events, self._blocks = self._events, [], 0
        return events

    def _add(self, event: KVEvent) -> None:
        if not self.overflowed:
            self._events.append(event)

    def _count(self) -> None:
        self._blocks += 1
        if self._blocks > self.limit and not self.overflowed:
            self.overflowed = True
            self._events = []
