"""The pool of KV-cache blocks and the block table of each sequence.

Blocks are reference counted: with prefix caching (prefix_cache.py) a full block may be shared by
several sequences with the same prefix. A block is always exactly one of: owned (by as many live
sequences as its count says), parked (cached, held by nobody, valid until the pool needs it) or
plain free. The pool hands out plain free blocks first, then the least recently parked ones.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable

from qworker.engine.prefix_cache import PrefixCache, block_hash
from qworker.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False) -> None:
        assert num_blocks >= 1 and block_size >= 1
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))  # plain free blocks
        self._refs = [0] * num_blocks  # live sequences holding each block
        self.cache = PrefixCache() if prefix_caching else None

    @property
    def num_free(self) -> int:
        """Blocks the pool can hand out: plain free and parked."""
        return len(self._free) + (len(self.cache.free_lru) if self.cache else 0)

    @property
    def num_cached(self) -> int:
        return len(self.cache.hash_of) if self.cache else 0

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
        seq.block_table.extend(self._take() for _ in range(need))

    def shrink(self, seq: Sequence, num_tokens: int) -> None:
        """Frees the blocks of `seq` past those that hold its first `num_tokens` tokens (the slots
        of a rejected speculative draft): its own, never cached (nothing past its tokens is)."""
        keep = self.blocks_for(num_tokens)
        for block in seq.block_table[keep:]:
            assert self._refs[block] == 1 and not (self.cache and block in self.cache.hash_of)
            self._refs[block] = 0
            self._free.append(block)
        del seq.block_table[keep:]

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks a waiting `seq` may start from: its longest cached prefix of full
        blocks, never reaching its last token (which must be computed to sample from). None for
        a sequence that wants its prompt's logprobs: each prompt position must be computed."""
        if self.cache is None or seq.block_table or seq.wants_prompt_logprobs:
            return []
        return self.cache.lookup(self._hashes(seq, (len(seq.token_ids) - 1) // self.block_size))

    def in_flight(self, seq: Sequence) -> list[bytes]:
        """The hashes of the full blocks a running `seq` holds but has not completed yet (being
        computed by this step or waiting for its budget): where a waiting sequence with the same
        prefix waits to find them cached rather than compute them too."""
        if self.cache is None:
            return []
        full = min(len(seq.block_table), len(seq.token_ids) // self.block_size)
        return self._hashes(seq, full)[seq.num_registered:full]

    def awaited_prefix(self, seq: Sequence, cached: int, in_flight: set[bytes]) -> int:
        """How many full blocks from the start a waiting `seq` whose first `cached` are cached
        will find there once the blocks `in_flight` land (its `cached_prefix` hashed them)."""
        if self.cache is None or seq.wants_prompt_logprobs:
            return cached
        hashes = seq.block_hashes[:(len(seq.token_ids) - 1) // self.block_size]
        known = cached
        while known < len(hashes) and (hashes[known] in in_flight
                                       or hashes[known] in self.cache.block_of):
            known += 1
        return known

    def admission_cost(self, prefix: list[int], num_tokens: int) -> int:
        """Free blocks a sequence starting from cached `prefix` takes to hold `num_tokens`: its new
        blocks, and the parked ones of `prefix` (held ones cost nothing)."""
        parked = sum(1 for block in prefix if self._refs[block] == 0)
        return max(0, self.blocks_for(num_tokens) - len(prefix)) + parked

    def share(self, seq: Sequence, prefix: list[int]) -> None:
        """`seq` is admitted starting from cached `prefix` (from `cached_prefix`, maybe [])."""
        assert not seq.block_table and seq.num_computed == 0
        if self.cache is None:
            return
        for block in prefix:
            if self._refs[block] == 0:
                self.cache.unpark(block)
            self._refs[block] += 1
        seq.block_table = list(prefix)
        seq.num_computed = len(prefix) * self.block_size
        seq.num_registered = len(prefix)
        self.cache.queries += len(seq.token_ids)
        self.cache.hits += seq.num_computed

    def commit(self, seq: Sequence) -> None:
        """After a step computed tokens of `seq`: the blocks it completed become cached."""
        if self.cache is None:
            return
        full = seq.num_computed // self.block_size
        hashes = self._hashes(seq, full)
        for i in range(seq.num_registered, full):
            self.cache.register(seq.block_table[i], hashes[i])
        seq.num_registered = max(seq.num_registered, full)

    def release(self, seq: Sequence) -> None:
        # the last blocks first: parked in that order, a sequence's tail is evicted before its head
        for block in reversed(seq.block_table):
            self._refs[block] -= 1
            if self._refs[block] == 0 and not (self.cache and self.cache.park(block)):
                self._free.append(block)
        seq.block_table = []
        seq.num_computed = seq.num_registered = 0

    def drop_cache(self) -> None:
        """Forgets every cached block (before anything writes blocks outside the tables)."""
        if self.cache:
            self._free.extend(self.cache.clear())  # the owned ones become plain blocks too

    def _take(self) -> int:
        block = self._free.popleft() if self._free else self._evict()
        assert self._refs[block] == 0
        self._refs[block] = 1
        return block

    def _evict(self) -> int:
        assert self.cache is not None and self.cache.free_lru, "no free block"
        return self.cache.evict()

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The chained hashes of the first `num_blocks` full blocks of `seq` (computed once)."""
        hashes, size = seq.block_hashes, self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(block_hash(hashes[-1] if hashes else None,
                                     seq.token_ids[i * size:(i + 1) * size], seq.cache_salt))
        return hashes

    def check(self, live: Iterable[Sequence]) -> None:
        """Each block's count is its owners; every block is exactly one of owned, parked (cached)
        or plain free; a cached block holds what its owners' hashes say, and is complete: nobody
        writes to a shared or cached block."""
        live = list(live)
        owners = Counter(block for seq in live for block in seq.block_table)
        assert all(self._refs[b] == owners[b] for b in range(self.num_blocks)), "refcount"
        parked = set(self.cache.free_lru) if self.cache else set()
        plain = set(self._free)
        assert len(plain) == len(self._free), "a block is free twice"
        assert not (plain & parked) and not (set(owners) & (plain | parked)), \
            "a block is owned and free, or free twice"
        assert len(owners) + len(plain) + len(parked) == self.num_blocks, "a block leaked"
        if self.cache is None:
            return
        cache = self.cache
        assert {b: h for h, b in cache.block_of.items()} == cache.hash_of, "cache maps differ"
        assert parked <= set(cache.hash_of) and not plain & set(cache.hash_of), "parked uncached"
        for seq in live:
            complete = seq.num_computed // self.block_size
            for i, block in enumerate(seq.block_table):
                if block in cache.hash_of:
                    assert i < complete and cache.hash_of[block] == seq.block_hashes[i], \
                        "a cached block holds other tokens, or is not complete"
                if i >= complete:
                    assert self._refs[block] == 1, "a block still to write is shared"
