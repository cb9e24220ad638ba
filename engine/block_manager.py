"""Fixed-size KV blocks: a free list and per-sequence block tables."""
from __future__ import annotations

from collections import deque

from engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def _missing(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether the cache can hold `num_new_tokens` more of `seq`'s tokens."""
        return self._missing(seq, num_new_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        missing = self._missing(seq, num_new_tokens)
        assert missing <= len(self._free), "allocate() without can_allocate()"
        seq.block_table.extend(self._free.popleft() for _ in range(missing))

    def deallocate(self, seq: Sequence) -> None:
        self._free.extend(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
        assert len(self._free) <= self.num_blocks, "a block was freed twice"
