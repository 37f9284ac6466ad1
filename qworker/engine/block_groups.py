"""The block pools of a model whose layers keep KV in two groups (docs/engine.md): its
full-attention layers (`Sequence.block_table`) and its sliding-window layers
(`Sequence.window_table`), each group a `BlockManager` of its own pool. The scheduler asks this
what it asks a single pool; a sequence grows, is admitted or preempted only where every group has
room, and a cached prefix is the one both groups still hold.

A model of one group (no window, or a window on every layer) runs its `BlockManager` alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from qworker.engine.block_manager import BlockManager
from qworker.engine.kv_events import KVEventLog
from qworker.engine.prefix_cache import PrefixCache
from qworker.engine.sequence import Sequence


@dataclass(frozen=True)
class KVGroup:
    """One group's pool: its blocks (a windowed one's null block included) and its window."""

    num_blocks: int
    window: int | None = None


class BlockGroups:
    def __init__(self, full: BlockManager, windowed: BlockManager) -> None:
        assert full.window is None and windowed.window is not None and windowed.second
        assert full.block_size == windowed.block_size
        self.full, self.windowed = full, windowed
        self.block_size = full.block_size
        self.num_blocks, self.capacity = full.num_blocks, full.capacity

    @property
    def num_free(self) -> int:
        """The full group's free blocks, or the windowed group's where it has fewer."""
        return min(self.full.num_free, self.windowed.num_free)

    @property
    def cache(self) -> PrefixCache | None:
        return self.full.cache  # its counters are the engine's

    @property
    def num_cached(self) -> int:
        return self.full.num_cached

    def blocks_for(self, num_tokens: int) -> int:
        return self.full.blocks_for(num_tokens)

    def can_grow(self, seq: Sequence, num_tokens: int, reserve: int = 0) -> bool:
        return (self.full.can_grow(seq, num_tokens, reserve)
                and self.windowed.can_grow(seq, num_tokens, reserve))

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        self.full.grow(seq, num_tokens)
        self.windowed.grow(seq, num_tokens)

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The full group's cached prefix, as long as the windowed group's too."""
        full = self.full.cached_prefix(seq)
        return full[:len(self.windowed.cached_prefix(seq))] if full else full

    def in_flight(self, seq: Sequence) -> list[bytes]:
        return self.full.in_flight(seq)

    def awaited_prefix(self, seq: Sequence, cached: int, in_flight: set[bytes]) -> int:
        return self.full.awaited_prefix(seq, cached, in_flight, (self.windowed,))

    def can_admit(self, seq: Sequence, prefix: list[int], num_tokens: int, reserve: int) -> bool:
        return (self.full.can_admit(seq, prefix, num_tokens, reserve)
                and self.windowed.can_admit(seq, self._windowed_prefix(seq, prefix), num_tokens,
                                            reserve))

    def share(self, seq: Sequence, prefix: list[int]) -> None:
        windowed = self._windowed_prefix(seq, prefix)
        self.full.share(seq, prefix)
        self.windowed.share(seq, windowed)

    def commit(self, seq: Sequence) -> None:
        self.full.commit(seq)
        self.windowed.commit(seq)

    def release(self, seq: Sequence) -> None:
        self.full.release(seq)
        self.windowed.release(seq)

    def drop_cache(self) -> None:
        self.full.drop_cache()
        self.windowed.drop_cache()

    @property
    def managers(self) -> tuple[BlockManager, ...]:
        return self.full, self.windowed

    def record_events(self, log: KVEventLog | None) -> None:
        self.full.events = self.windowed.events = log

    def check(self, live: Iterable[Sequence]) -> None:
        live = list(live)
        self.full.check(live)
        self.windowed.check(live)

    def _windowed_prefix(self, seq: Sequence, prefix: list[int]) -> list[int]:
        """The windowed group's blocks of the prefix whose full group's blocks are `prefix`."""
        if not prefix:
            return []
        blocks = self.windowed.cached_prefix(seq)[:len(prefix)]
        assert len(blocks) == len(prefix), "a prefix the windowed group does not hold"
        return blocks


Blocks = BlockManager | BlockGroups


def make_blocks(groups: tuple[KVGroup, ...], block_size: int, prefix_caching: bool,
                max_chunk: int) -> Blocks:
    """The pools of a model's KV groups: one, or a full group and a windowed one."""
    first = BlockManager(groups[0].num_blocks, block_size, prefix_caching, groups[0].window,
                         max_chunk)
    if len(groups) == 1:
        return first
    assert len(groups) == 2
    second = BlockManager(groups[1].num_blocks, block_size, prefix_caching, groups[1].window,
                          max_chunk, second=True)
    return BlockGroups(first, second)
