"""Structured output in the engine: an xgrammar matcher per sequence, applied as
a token bitmask once the output reaches the serving extension's trigger."""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from sluice.checkpoint import Background

_CACHE_BYTES = 512 << 20  # deserialized grammars kept for requests that repeat a schema


class GrammarState:
    def __init__(self, matcher, trigger: list[int]) -> None:
        self.matcher = matcher
        self.trigger = trigger
        self.active = not trigger
        self.error: str | None = None  # set when the grammar cannot go on: the request fails, alone

    @property
    def terminated(self) -> bool:
        """The grammar has accepted a whole output (and its stop token): the output ends here."""
        return self.active and self.matcher.is_terminated()

    def observe(self, token_ids: list[int], token: int) -> None:
        """Takes the token just sampled after `token_ids`."""
        if self.active:
            if self.error is None and not self.matcher.accept_token(token):
                self.error = f"structured output: the sampled token {token} does not fit the grammar"
        elif token == self.trigger[-1] and token_ids[len(token_ids) - len(self.trigger) + 1:] == self.trigger[:-1]:
            self.active = True

    def fill(self, bitmask, row: int) -> None:
        """Writes the tokens allowed next into `bitmask`'s row (on failure, the error; the row stays open)."""
        try:
            self.matcher.fill_next_token_bitmask(bitmask, row)
        except RuntimeError as e:  # xgrammar's own errors, e.g. a matcher that has terminated
            self.error = f"structured output: {e}"


class Grammars:
    """Compiled grammars from their serialized form, loaded on a thread: xgrammar and the tokenizer info when
    the first constrained request arrives (the engine spends nothing on structured output until someone
    uses it), then each grammar, cached by digest within a byte budget. xgrammar releases the GIL while it
    deserializes, so a large grammar never stalls the engine's steps; its request waits instead."""

    def __init__(self, model_path: str, vocab_size: int, cache_bytes: int = _CACHE_BYTES) -> None:
        from sluice.checkpoint import tokenizer_info

        self._info = Background(lambda: tokenizer_info(model_path, vocab_size), lazy=True)
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="grammar-load")
        self._cache: OrderedDict[bytes, tuple[object, int]] = OrderedDict()  # touched by the loader only
        self._cache_bytes = 0
        self._limit = cache_bytes

    def load(self, grammar: str) -> Future:
        """The compiled grammar, soon (its exception, if it cannot be loaded)."""
        return self._loader.submit(self._load, grammar)

    def _load(self, grammar: str):
        import xgrammar as xgr

        key = hashlib.blake2b(grammar.encode(), digest_size=16).digest()
        if (hit := self._cache.get(key)) is not None:
            self._cache.move_to_end(key)
            return hit[0]
        compiled = xgr.CompiledGrammar.deserialize_json(grammar, self._info.get())
        size = compiled.memory_size_bytes + len(grammar)
        self._cache[key] = (compiled, size)
        self._cache_bytes += size
        while self._cache_bytes > self._limit and len(self._cache) > 1:
            self._cache_bytes -= self._cache.popitem(last=False)[1][1]
        return compiled

    @staticmethod
    def state(compiled, trigger: list[int], stop_token_ids) -> GrammarState:
        """A matcher that ends the output on one of `stop_token_ids` (none, e.g. with ignore_eos: the
        checkpoint's EOS ids: a finished grammar ends the output whatever ignore_eos says)."""
        import xgrammar as xgr

        return GrammarState(xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids) or None), trigger)


def apply_grammars(logits: torch.Tensor, rows: list[int], states: list[GrammarState]) -> None:
    """Masks, in place, every token the grammar does not allow next in the given rows."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])
    for row, state in zip(rows, states):
        state.fill(bitmask, row)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
