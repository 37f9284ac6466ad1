"""The pool of KV-cache blocks and the block table of each sequence."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from qworker.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks >= 1 and block_size >= 1
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` must still get to hold its first `num_tokens` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        need = self.blocks_needed(seq, num_tokens)
        assert need <= self.num_free, "grow() without can_grow()"
        seq.block_table.extend(self._free.popleft() for _ in range(need))

    def release(self, seq: Sequence) -> None:
        self._free.extend(seq.block_table)
        seq.block_table = []
        seq.num_computed = 0

    def check(self, live: Iterable[Sequence]) -> None:
        """Every block is either free or owned by exactly one live sequence."""
        owned = [block for seq in live for block in seq.block_table]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert not set(owned) & set(self._free), "a block is both owned and free"
        assert len(owned) + len(self._free) == self.num_blocks, "a block leaked"
