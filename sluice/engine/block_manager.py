"""Fixed-size KV blocks: ref counts, block tables, and a prefix cache.

A full block is content-addressed by a hash of its parent block's hash, the
request's cache salt and its token ids, so a request reuses every cached block
of its prompt and tenants with different salts share nothing. A block whose
ref count falls to zero stays cached in an LRU of free blocks until it is
needed for something else; uncached free blocks are handed out first.

With a sliding window, blocks that fell out of the window are freed while the
sequence runs; its table keeps -1 in their place. A model whose sliding-window
layers sit beside full-attention ones (gpt-oss) gives them a pool of their own
(a second BlockManager over `window_table`), cached under the same hashes.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from sluice.engine.sequence import Sequence


@dataclass
class CacheEvents:
    """Hashes the prefix cache stored and dropped since they were last taken (for a KV-aware router)."""

    stored: list[bytes] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 table: str = "block_table") -> None:
        """`table`: the Sequence attribute this pool's blocks go in. The primary pool ("block_table")
        also owns the sequence's computed-token count; a model whose sliding-window layers keep their
        KV apart has a second pool ("window_table") that follows it."""
        assert table in ("block_table", "window_table"), table
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.table = table
        self.primary = table == "block_table"
        self.registered = "num_registered_blocks" if self.primary else "num_registered_window_blocks"
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block
        self.events: CacheEvents | None = None  # set to record them (the primary pool's, published by the engine)
        # Free blocks in the order they are handed out: uncached first, then cached ones, least recent first.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    # ---- prefix cache ---------------------------------------------------------

    def _hash(self, seq: Sequence, i: int) -> bytes:
        """Hash of seq's full block i (computed once per sequence, chained from its parent)."""
        bs = self.block_size
        while len(seq.block_hashes) <= i:
            j = len(seq.block_hashes)
            h = hashlib.blake2b(seq.block_hashes[j - 1] if j else seq.cache_salt.encode(), digest_size=16)
            h.update(np.asarray(seq.token_ids[j * bs : (j + 1) * bs], dtype=np.int32).tobytes())
            seq.block_hashes.append(h.digest())
        return seq.block_hashes[i]

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks that hold the start of seq's tokens (never its last token: that one's logits are needed)."""
        if not self.enable_prefix_caching or getattr(seq, self.table) or seq.scores_prompt:
            return []
        hits = []
        for i in range((seq.num_tokens - 1) // self.block_size):
            block = self.cached.get(self._hash(seq, i))
            if block is None:
                break
            hits.append(block)
        return hits

    def free_outside_window(self, seq: Sequence, first_needed: int) -> None:
        """Frees seq's blocks that hold only positions before `first_needed` (a sliding window slid past them)."""
        table = seq.block_table if self.primary else seq.window_table
        end = min(first_needed // self.block_size, len(table))
        start = end
        while start > 0 and table[start - 1] >= 0:  # the blocks freed before are a prefix of the table
            start -= 1
        for i in range(start, end):
            self._release(table[i])
            table[i] = -1

    def register_full_blocks(self, seq: Sequence) -> None:
        """Makes seq's newly computed full blocks reusable by others."""
        if not self.enable_prefix_caching:
            return
        table = getattr(seq, self.table)
        full = min(seq.num_computed_tokens // self.block_size, len(table))
        registered = getattr(seq, self.registered)
        if full <= registered:  # no block filled up (most decode steps)
            return
        for i in range(registered, full):
            h, block = self._hash(seq, i), table[i]
            if block >= 0 and self.block_hash[block] is None and h not in self.cached:
                self.block_hash[block] = h
                self.cached[h] = block
                if self.events is not None:
                    self.events.stored.append(h)
        setattr(seq, self.registered, full)

    def cached_blocks(self, seq: Sequence, first: int, end: int) -> list[int] | None:
        """seq's blocks first..end-1 if every one is cached here (a window pool's part of a prefix hit)."""
        hits = []
        for i in range(first, end):
            block = self.cached.get(self._hash(seq, i))
            if block is None:
                return None
            hits.append(block)
        return hits

    # ---- the five verbs -------------------------------------------------------

    def _missing(self, seq: Sequence, num_new_tokens: int, hits: list[int] | tuple[int, ...], skip: int) -> int:
        computed = (skip + len(hits)) * self.block_size if hits else seq.num_computed_tokens
        have = len(getattr(seq, self.table)) + skip + len(hits)
        return max(0, -(-(computed + num_new_tokens) // self.block_size) - have)

    def has_room(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether seq's blocks already hold `num_new_tokens` more tokens (most decode steps: nothing to
        allocate)."""
        table = seq.block_table if self.primary else seq.window_table
        return seq.num_computed_tokens + num_new_tokens <= len(table) * self.block_size

    def can_allocate(self, seq: Sequence, num_new_tokens: int, hits: list[int] | tuple[int, ...] = (),
                     skip: int = 0) -> bool:
        """Whether the cache can hold `num_new_tokens` more of seq's tokens (after the cached `hits`, which
        stand for its blocks skip.. : a window pool needs no blocks before the window)."""
        return self._missing(seq, num_new_tokens, hits, skip) + self._revived(hits) <= len(self._free)

    def _revived(self, hits: list[int] | tuple[int, ...]) -> int:
        """How many of the cached `hits` sit in the free list."""
        return sum(1 for b in hits if self.ref_count[b] == 0) if hits else 0

    def allocate(self, seq: Sequence, num_new_tokens: int, hits: list[int] | tuple[int, ...] = (),
                 skip: int = 0) -> None:
        missing = self._missing(seq, num_new_tokens, hits, skip)
        assert missing + self._revived(hits) <= len(self._free), "allocate() without can_allocate()"
        table = getattr(seq, self.table)
        table.extend([-1] * skip if hits else [])
        for block in hits:
            if self.ref_count[block] == 0:
                del self._free[block]
            self.ref_count[block] += 1
            table.append(block)
        if hits:
            setattr(seq, self.registered, skip + len(hits))
            if self.primary:
                seq.num_computed_tokens = len(hits) * self.block_size
        for _ in range(missing):
            block, _ = self._free.popitem(last=False)
            if (h := self.block_hash[block]) is not None:  # evict the least recently used cached block
                del self.cached[h]
                self.block_hash[block] = None
                if self.events is not None:
                    self.events.removed.append(h)
            self.ref_count[block] = 1
            table.append(block)

    def deallocate(self, seq: Sequence) -> None:
        # Tail blocks first, so a prefix outlives the blocks that extend it.
        for block in reversed(getattr(seq, self.table)):
            if block >= 0:
                self._release(block)
        setattr(seq, self.table, [])
        setattr(seq, self.registered, 0)
        if self.primary:
            seq.num_computed_tokens = 0

    def _release(self, block: int) -> None:
        self.ref_count[block] -= 1
        assert self.ref_count[block] >= 0, "a block was freed twice"
        if self.ref_count[block] == 0:
            self._free[block] = None
            if self.block_hash[block] is None:
                self._free.move_to_end(block, last=False)
