"""The pool of KV-cache blocks and the block table of each sequence.

Blocks are reference counted: with prefix caching (prefix_cache.py) a full block may be shared by
several sequences with the same prefix. A block is always exactly one of: owned (by as many live
sequences as its count says), parked (cached, held by nobody, valid until the pool needs it) or
plain free. The pool hands out plain free blocks first, then the least recently parked ones.

A pool serves one KV group (docs/engine.md): the model's full-attention layers, whose blocks a
sequence holds from its first token on (`Sequence.block_table`), or its sliding-window layers
(`window`), whose blocks a sequence holds only while a query still to come can see them: a block
wholly before the window of the next query is dropped from the table as the sequence grows (its
entry becomes `NULL_BLOCK`, block 0, never handed out, never read). The second group of a model
with both kinds keeps its tables in `Sequence.window_table` (`second`).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable

from qworker.engine.kv_events import KVEventLog, KVGroupSpec
from qworker.engine.prefix_cache import PrefixCache, block_hash
from qworker.engine.sequence import Sequence

NULL_BLOCK = 0  # a windowed pool's: the table entry of a block dropped behind the window


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False,
                 window: int | None = None, max_chunk: int = 1, second: bool = False) -> None:
        """`window`: the group's sliding window (its pool has `NULL_BLOCK` besides the others);
        `max_chunk`: the most tokens a sequence computes in one step (bounds what a windowed
        sequence holds at once); `second`: the tables are `Sequence.window_table`."""
        assert block_size >= 1 and num_blocks >= (2 if window else 1)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.window = window
        self.second = second
        first = NULL_BLOCK + 1 if window else 0
        self.capacity = num_blocks - first  # blocks sequences can hold
        self._free: deque[int] = deque(range(first, num_blocks))  # plain free blocks
        self._refs = [0] * num_blocks  # live sequences holding each block
        self.cache = PrefixCache() if prefix_caching else None
        self.events: KVEventLog | None = None  # KV events recorded here (kv_events.py), if set
        self.group = KVGroupSpec(1 if second else 0, window)
        # a windowed sequence holds at most these blocks at once: its window and a chunk
        self._peak = self.blocks_for((window or 0) + max_chunk) + 1

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
        """Blocks `seq` must still get to hold its first `num_tokens` tokens (windowed: those a
        query from its next token on sees, less what dropping the ones behind returns)."""
        table = self.table(seq)
        need = max(0, self.blocks_for(num_tokens) - len(table))
        if self.window is None:
            return need
        behind = self._behind(seq)
        held = len(table) - behind.stop  # the dropped ones lead the table, then those behind
        returned = sum(1 for i in behind if self._refs[table[i]] == 1)
        return max(0, min(need, self._peak - held) - returned)

    def can_grow(self, seq: Sequence, num_tokens: int, reserve: int = 0) -> bool:
        return self.blocks_needed(seq, num_tokens) + reserve <= self.num_free

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        if self.window is not None:
            self._drop_behind(seq)
        table = self.table(seq)
        need = self.blocks_for(num_tokens) - len(table)
        assert need <= self.num_free, "grow() without can_grow()"
        table.extend(self._take() for _ in range(need))

    def table(self, seq: Sequence) -> list[int]:
        """The block table of `seq` in this pool's group."""
        return seq.window_table if self.second else seq.block_table

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
        a sequence that wants its prompt's logprobs: each prompt position must be computed.
        Windowed, the rule is the same: every block from the first must still be cached."""
        if self.cache is None or self.table(seq) or seq.wants_prompt_logprobs:
            return []
        return self.cache.lookup(self._hashes(seq, (len(seq.token_ids) - 1) // self.block_size))

    def in_flight(self, seq: Sequence) -> list[bytes]:
        """The hashes of the full blocks a running `seq` holds but has not completed yet (being
        computed by this step or waiting for its budget): where a waiting sequence with the same
        prefix waits to find them cached rather than compute them too."""
        if self.cache is None:
            return []
        full = min(len(self.table(seq)), len(seq.token_ids) // self.block_size)
        return self._hashes(seq, full)[self._registered(seq):full]

    def awaited_prefix(self, seq: Sequence, cached: int, in_flight: set[bytes],
                       others: tuple[BlockManager, ...] = ()) -> int:
        """How many full blocks from the start a waiting `seq` whose first `cached` are cached
        will find there once the blocks `in_flight` land (its `cached_prefix` hashed them); a
        block counts as cached only where the pools of the model's `others` groups cache it
        too (a prefix is found only in every group at once)."""
        if self.cache is None or seq.wants_prompt_logprobs:
            return cached
        hashes = seq.block_hashes[:(len(seq.token_ids) - 1) // self.block_size]
        caches = [self.cache.block_of, *(o.cache.block_of for o in others if o.cache)]
        known = cached
        while known < len(hashes) and (hashes[known] in in_flight
                                       or all(hashes[known] in c for c in caches)):
            known += 1
        return known

    def admission_cost(self, prefix: list[int], num_tokens: int) -> int:
        """Free blocks a sequence starting from cached `prefix` takes to hold `num_tokens`: its new
        blocks, and the parked ones of `prefix` it holds (held ones cost nothing; windowed, it
        holds only those its first query sees)."""
        kept = self._first_kept(len(prefix) * self.block_size) if self.window else 0
        parked = sum(1 for block in prefix[kept:] if self._refs[block] == 0)
        return max(0, self.blocks_for(num_tokens) - len(prefix)) + parked

    def can_admit(self, seq: Sequence, prefix: list[int], num_tokens: int, reserve: int) -> bool:
        """Whether `seq`, from cached `prefix`, fits `num_tokens` with `reserve` blocks to spare."""
        return self.admission_cost(prefix, num_tokens) + reserve <= self.num_free

    def share(self, seq: Sequence, prefix: list[int]) -> None:
        """`seq` is admitted starting from cached `prefix` (from `cached_prefix`, maybe [])."""
        assert not self.table(seq)
        if self.cache is None:
            return
        kept = self._first_kept(len(prefix) * self.block_size) if self.window else 0
        for block in prefix[kept:]:
            if self._refs[block] == 0:
                self.cache.unpark(block)
            self._refs[block] += 1
        self._set_table(seq, [NULL_BLOCK] * kept + prefix[kept:], len(prefix))
        seq.num_computed = len(prefix) * self.block_size
        self.cache.queries += len(seq.token_ids)
        self.cache.hits += seq.num_computed

    def commit(self, seq: Sequence) -> None:
        """After a step computed tokens of `seq`: the blocks it completed become cached."""
        if self.cache is None:
            return
        full = seq.num_computed // self.block_size
        hashes = self._hashes(seq, full)
        table, registered = self.table(seq), self._registered(seq)
        for i in range(registered, full):
            if ((table[i] != NULL_BLOCK or self.window is None)
                    and self.cache.register(table[i], hashes[i]) and self.events is not None):
                self._stored(seq, hashes, i)
        self._set_table(seq, table, max(registered, full))

    def release(self, seq: Sequence) -> None:
        # the last blocks first: parked in that order, a sequence's tail is evicted before its head
        for block in reversed(self.table(seq)):
            if block != NULL_BLOCK or self.window is None:
                self._unref(block)
        self._set_table(seq, [], 0)
        seq.num_computed = 0

    def drop_cache(self) -> None:
        """Forgets every cached block (before anything writes blocks outside the tables)."""
        if self.cache:
            self._free.extend(self.cache.clear())  # the owned ones become plain blocks too
            if self.events is not None:
                self.events.cleared()

    @property
    def managers(self) -> tuple[BlockManager, ...]:
        """The pools of the model's KV groups: this one (BlockGroups has two)."""
        return (self,)

    def record_events(self, log: KVEventLog | None) -> None:
        """KV events of this pool go to `log` from now on (None: none)."""
        self.events = log

    def _first_kept(self, position: int) -> int:
        """The first block a query at `position` (or after) sees through the window."""
        assert self.window is not None
        return max(0, position - self.window + 1) // self.block_size

    def _behind(self, seq: Sequence) -> range:
        """The entries of the blocks `seq` still holds that no query from its next token on
        sees (those dropped earlier, null, lead the table)."""
        table = self.table(seq)
        kept = min(self._first_kept(seq.num_computed), len(table))
        first = kept
        while first > 0 and table[first - 1] != NULL_BLOCK:
            first -= 1
        return range(first, kept)

    def _drop_behind(self, seq: Sequence) -> None:
        """Gives back the blocks no query of `seq` from its next token on can see, oldest first
        (so parked, the oldest is evicted first)."""
        table = self.table(seq)
        for i in self._behind(seq):
            self._unref(table[i])
            table[i] = NULL_BLOCK

    def _unref(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0 and not (self.cache and self.cache.park(block)):
            self._free.append(block)

    def _registered(self, seq: Sequence) -> int:
        return seq.window_registered if self.second else seq.num_registered

    def _set_table(self, seq: Sequence, table: list[int], registered: int) -> None:
        if self.second:
            seq.window_table, seq.window_registered = table, registered
        else:
            seq.block_table, seq.num_registered = table, registered

    def _take(self) -> int:
        block = self._free.popleft() if self._free else self._evict()
        assert self._refs[block] == 0
        self._refs[block] = 1
        return block

    def _evict(self) -> int:
        assert self.cache is not None and self.cache.free_lru, "no free block"
        block, h = self.cache.evict()
        if self.events is not None:
            self.events.removed(self.group, h)
        return block

    def _stored(self, seq: Sequence, hashes: list[bytes], i: int) -> None:
        """Block `i` of `seq` (hash `hashes[i]`) was newly cached: a KV event."""
        assert self.events is not None
        size = self.block_size
        self.events.stored(self.group, hashes[i], hashes[i - 1] if i else None,
                           seq.token_ids[i * size:(i + 1) * size])

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
        writes to a shared or cached block. Windowed: the null block is none of them, and no
        sequence holds more blocks than its window and a chunk need."""
        live = list(live)
        windowed = self.window is not None
        tables = [[b for b in self.table(seq) if b != NULL_BLOCK or not windowed] for seq in live]
        owners = Counter(block for table in tables for block in table)
        assert all(self._refs[b] == owners[b] for b in range(self.num_blocks)), "refcount"
        parked = set(self.cache.free_lru) if self.cache else set()
        plain = set(self._free)
        assert len(plain) == len(self._free), "a block is free twice"
        assert not (plain & parked) and not (set(owners) & (plain | parked)), \
            "a block is owned and free, or free twice"
        assert len(owners) + len(plain) + len(parked) == self.capacity, "a block leaked"
        if windowed:
            assert NULL_BLOCK not in plain | parked, "the null block was handed out"
            assert all(len(table) <= self._peak for table in tables), "a window holds too much"
        if self.cache is None:
            return
        cache = self.cache
        assert {b: h for h, b in cache.block_of.items()} == cache.hash_of, "cache maps differ"
        assert parked <= set(cache.hash_of) and not plain & set(cache.hash_of), "parked uncached"
        for seq in live:
            complete = seq.num_computed // self.block_size
            for i, block in enumerate(self.table(seq)):
                if windowed and block == NULL_BLOCK:
                    continue
                if block in cache.hash_of:
                    assert i < complete and cache.hash_of[block] == seq.block_hashes[i], \
                        "a cached block holds other tokens, or is not complete"
                if i >= complete:
                    assert self._refs[block] == 1, "a block still to write is shared"
