"""Prefix caching: full KV blocks found again by the hash of everything they hold.

A full block's hash chains its parent block's hash, the block's token ids and the request's
`cache_salt`, so equal hashes mean the same tokens at the same positions after the same prefix,
for the same tenant. SHA-256: a tenant cannot craft a collision to read another's cache.

The cache maps hash -> block for blocks whose K/V are complete (written by a step that succeeded)
and keeps an LRU of the cached blocks that no sequence holds any more: they are free (the pool
hands them out, oldest first, once no plain free block is left) but their K/V stay valid until
then, so a later sequence with the same prefix takes them instead of computing them again.
Only full blocks are cached, and a cached block is never written again: a sequence's last, partly
filled block is always its own.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence as Tokens

BlockHash = bytes


def block_hash(parent: BlockHash | None, tokens: Tokens[int], salt: str | None) -> BlockHash:
    """The hash of a full block: its parent's hash, its tokens, the tenant's salt."""
    if parent is not None:
        h = hashlib.sha256(b"P" + parent)
    else:  # the first block carries the salt; every later one has it through its parent
        salt_bytes = b"" if salt is None else salt.encode()
        head = struct.pack("<bq", salt is not None, len(salt_bytes))
        h = hashlib.sha256(b"R" + head + salt_bytes)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return h.digest()


class PrefixCache:
    def __init__(self) -> None:
        self.block_of: dict[BlockHash, int] = {}  # complete blocks, owned or free
        self.hash_of: dict[int, BlockHash] = {}  # the reverse map
        self.free_lru: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody holds
        self.queries = 0  # prompt tokens of admitted sequences
        self.hits = 0  # of those, tokens found in the cache

    def register(self, block: int, h: BlockHash) -> bool:
        """`block` (owned, complete) holds the K/V of hash `h` (True), unless an equal block is
        cached already (two sequences computed the same prefix at once): then it stays a plain
        block (False)."""
        if h in self.block_of or block in self.hash_of:
            return False
        self.block_of[h] = block
        self.hash_of[block] = h
        return True

    def lookup(self, hashes: Tokens[BlockHash]) -> list[int]:
        """The cached blocks of the longest run of `hashes` from the first."""
        blocks = []
        for h in hashes:
            block = self.block_of.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def park(self, block: int) -> bool:
        """A block nobody holds any more: kept (True) if it is cached, most recent last."""
        if block not in self.hash_of:
            return False
        self.free_lru[block] = None
        return True

    def unpark(self, block: int) -> None:
        """A parked block taken again by a sequence that shares it."""
        del self.free_lru[block]

    def evict(self) -> tuple[int, BlockHash]:
        """The least recently parked block, forgotten, for the pool to hand out, and its hash."""
        block, _ = self.free_lru.popitem(last=False)
        h = self.hash_of.pop(block)
        del self.block_of[h]
        return block, h

    def clear(self) -> list[int]:
        """Forgets every cached block; returns the parked ones (now plain free)."""
        parked = list(self.free_lru)
        self.block_of.clear()
        self.hash_of.clear()
        self.free_lru.clear()
        return parked
