"""The prefix-caching block manager under any sequence of operations."""
from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sluice.engine.block_manager import BlockManager
from tests.engine.helpers import seq

NUM_BLOCKS, BS = 10, 2
tokens = st.lists(st.integers(0, 2), min_size=1, max_size=12)  # a tiny alphabet: prefixes repeat


class PrefixMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BS)
        self.live = []
        self.n = 0

    @rule(prompt=tokens, salt=st.sampled_from(["", "", "x"]))
    def admit(self, prompt, salt):
        s = seq(f"s{self.n}", prompt)
        s.cache_salt = salt
        self.n += 1
        hits = self.bm.cached_prefix(s)
        for i, block in enumerate(hits):  # a hit holds exactly the tokens it stands for
            assert self.bm.block_hash[block] == self.bm._hash(s, i)
        n = len(prompt) - len(hits) * BS
        assert n >= 1
        if self.bm.can_allocate(s, n, hits):
            self.bm.allocate(s, n, hits)
            s.num_computed_tokens += n
            self.bm.register_full_blocks(s)
            self.live.append(s)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 50), new=st.lists(st.integers(0, 2), min_size=1, max_size=3))
    def append(self, i, new):
        s = self.live[i % len(self.live)]
        s.token_ids += new
        if self.bm.can_allocate(s, len(new)):
            self.bm.allocate(s, len(new))
            s.num_computed_tokens += len(new)
            self.bm.register_full_blocks(s)
        else:
            del s.token_ids[-len(new):]

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 50))
    def free(self, i):  # finish or preempt
        self.bm.deallocate(self.live.pop(i % len(self.live)))

    @invariant()
    def accounting(self):
        owners: dict[int, int] = {}
        for s in self.live:
            assert len(s.block_table) == -(-s.num_computed_tokens // BS)
            for b in s.block_table:
                owners[b] = owners.get(b, 0) + 1
        for b in range(NUM_BLOCKS):
            assert self.bm.ref_count[b] == owners.get(b, 0)
        assert self.bm.num_free == NUM_BLOCKS - len(owners)
        for h, b in self.bm.cached.items():
            assert self.bm.block_hash[b] == h
        for s in self.live:  # every registered block holds what its hash says
            for i in range(s.num_registered_blocks):
                b = s.block_table[i]
                if self.bm.block_hash[b] is not None:
                    assert self.bm.block_hash[b] == self.bm._hash(s, i)

    def teardown(self):
        for s in self.live:
            self.bm.deallocate(s)
        assert self.bm.num_free == NUM_BLOCKS and all(r == 0 for r in self.bm.ref_count)


TestPrefixCache = PrefixMachine.TestCase
