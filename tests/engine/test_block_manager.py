"""Block accounting under any sequence of allocate / append / free / preempt."""
from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sluice.engine.block_manager import BlockManager
from tests.engine.helpers import seq

NUM_BLOCKS, BLOCK_SIZE = 12, 4


class BlockMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
        self.live = []
        self.counter = 0

    @rule(n=st.integers(1, 20))
    def allocate_new(self, n):
        s = seq(f"s{self.counter}", [1] * n)
        self.counter += 1
        if self.bm.can_allocate(s, n):
            self.bm.allocate(s, n)
            s.num_computed_tokens = n
            self.live.append(s)
        else:
            assert -(-n // BLOCK_SIZE) > self.bm.num_free

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100), n=st.integers(1, 6))
    def append(self, i, n):
        s = self.live[i % len(self.live)]
        if self.bm.can_allocate(s, n):
            self.bm.allocate(s, n)
            s.num_computed_tokens += n

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def free(self, i):  # finishing and preempting both give every block back
        s = self.live.pop(i % len(self.live))
        self.bm.deallocate(s)
        assert s.block_table == [] and s.num_computed_tokens == 0

    @invariant()
    def accounting(self):
        owned = [b for s in self.live for b in s.block_table]
        assert len(owned) == len(set(owned)), "a block has two owners"
        assert len(owned) + self.bm.num_free == NUM_BLOCKS
        for s in self.live:
            assert len(s.block_table) == -(-s.num_computed_tokens // BLOCK_SIZE)

    def teardown(self):
        for s in self.live:
            self.bm.deallocate(s)
        assert self.bm.num_free == NUM_BLOCKS


TestBlockManager = BlockMachine.TestCase
