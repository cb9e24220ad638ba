"""Structured output in the engine: a grammar matcher per sequence, applied as a token bitmask once the
output reaches the serving extension's trigger. Two grammar engines behind one small matcher interface
(`accept`, `fill`, `done`): llguidance (the default) and xgrammar (--grammar-backend)."""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal, NamedTuple, Protocol

import numpy as np
import torch

from sluice.base.checkpoint import Background
from sluice.base.grammar_errors import DEAD_END, nothing_allowed, unsatisfiable

_CACHE_BYTES = 512 << 20  # loaded grammars kept for requests that repeat a constraint
Backend = Literal["llguidance", "xgrammar"]


class Matcher(Protocol):
    def accept(self, token: int) -> bool:
        """Takes a sampled token; False if the grammar does not allow it."""
        ...

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """The tokens allowed next, as bits of `bitmask`'s row (raises when the grammar cannot go on)."""
        ...

    @property
    def done(self) -> bool:
        """The grammar has accepted a whole output (and, where the request has them, its stop token)."""
        ...


class Unsatisfiable(NamedTuple):
    """The request's own constraints leave its output no way on: the client's error (a 400 naming `param`),
    not the engine's."""

    param: str
    message: str


class GrammarState:
    def __init__(self, matcher: Matcher, trigger: list[int], vocab_size: int,
                 param: str = "structured output") -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.trigger = trigger
        self.param = param  # the request field the grammar comes from (its errors name it)
        self.active = not trigger
        # Set when the grammar cannot go on: the request fails, alone. A str: the engine's own fault (a 500).
        self.error: str | Unsatisfiable | None = None
        self.taken: int | None = None  # the last token the active grammar took (a stop id taken as text too)
        self.steps = 0  # tokens the active grammar has taken

    @property
    def terminated(self) -> bool:
        """The grammar has accepted a whole output: the output ends here."""
        return self.active and self.matcher.done

    def observe(self, token_ids: list[int], token: int) -> None:
        """Takes the token just sampled after `token_ids`."""
        if self.active:
            self.taken = token
            self.steps += 1
            try:
                fits = self.matcher.accept(token)
            except (RuntimeError, ValueError) as e:  # the grammar itself failed on it (see _Guidance.accept)
                return self._unsatisfiable(str(e), self.steps - 1)
            if self.error is None and not fits:
                self.error = f"structured output: the sampled token {token} does not fit the grammar"
        elif token == self.trigger[-1] and token_ids[len(token_ids) - len(self.trigger) + 1:] == self.trigger[:-1]:
            self.active = True

    def allows(self, token: int) -> bool:
        """Whether the grammar allows `token` next."""
        bitmask = torch.zeros(1, -(-self.vocab_size // 32), dtype=torch.int32)
        self.fill(bitmask, 0)
        return bool((int(bitmask[0, token >> 5]) >> (token & 31)) & 1)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the tokens allowed next into `bitmask`'s row (on failure, the error; the row stays open)."""
        try:
            self.matcher.fill(bitmask, row)
        except (RuntimeError, ValueError) as e:  # either engine's own errors: the grammar goes no further
            return self._unsatisfiable(str(e), self.steps)
        if not bitmask[row].any() and not self.matcher.done:  # (xgrammar says nothing: its row is empty)
            self._unsatisfiable(DEAD_END, self.steps)

    def starve(self, field: str) -> None:
        """The request's `field` (allowed_token_ids, bad_words) rules out every token the grammar allows next."""
        if self.error is None:
            self.error = Unsatisfiable(field, nothing_allowed(field, self.param, self.steps))

    def _unsatisfiable(self, raw: str, after: int) -> None:
        if self.error is None:
            self.error = Unsatisfiable(self.param, unsatisfiable(self.param, raw, after=after))


def _set_bits(row: torch.Tensor, ids) -> None:
    words = row.numpy().view(np.uint32)
    for t in ids:
        words[t >> 5] |= np.uint32(1 << (t & 31))


class _Guidance:
    """An llguidance matcher. llguidance ends a grammar with the model's EOS; a request ends with its own stop
    ids (harmony's <|return|>, none with ignore_eos), so those are what the grammar's end allows here."""

    def __init__(self, matcher, stop_ids: list[int]) -> None:
        self._m = matcher
        self._stops = set(stop_ids)
        self._ended = False

    def accept(self, token: int) -> bool:
        if token in self._stops and (self._m.is_accepting() or self._m.is_stopped()):
            self._ended = True
            return True
        if self._m.consume_token(token):
            return True
        if self._m.is_error():  # the grammar failed as it took the token (its forced output never ends, ...)
            raise RuntimeError(self._m.get_error())
        return False

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        if self._m.is_stopped():
            bitmask[row] = 0
        else:
            self._m.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), bitmask.shape[1] * 4)
            if self._m.is_error():
                raise RuntimeError(self._m.get_error())
        if self._m.is_accepting() or self._m.is_stopped():
            _set_bits(bitmask[row], self._stops)

    @property
    def done(self) -> bool:
        return self._ended or (self._m.is_stopped() and not self._stops)


class _XGrammar:
    def __init__(self, matcher) -> None:
        self._m = matcher

    def accept(self, token: int) -> bool:
        return bool(self._m.accept_token(token))

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    @property
    def done(self) -> bool:
        return bool(self._m.is_terminated())


class Grammars:
    """Grammars loaded on a thread: the grammar engine and its view of the vocabulary when the first
    constrained request arrives (the engine spends nothing on structured output until someone uses it), then
    each grammar, cached by digest within a byte budget. Both engines release the GIL while they build a
    grammar, so a large one never stalls the engine's steps; its request waits instead."""

    def __init__(self, model_path: str, vocab_size: int, backend: Backend = "llguidance",
                 cache_bytes: int = _CACHE_BYTES) -> None:
        from sluice.base.checkpoint import guidance_tokenizer, tokenizer_info

        self.backend = backend
        self.vocab_size = vocab_size
        vocabulary = guidance_tokenizer if backend == "llguidance" else tokenizer_info
        self._vocabulary = Background(lambda: vocabulary(model_path, vocab_size), lazy=True)
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="grammar-load")
        self._cache: OrderedDict[bytes, tuple[Any, int]] = OrderedDict()  # touched by the loader only
        self._cache_bytes = 0
        self._limit = cache_bytes

    def load(self, grammar: str) -> Future:
        """The loaded grammar, soon (its exception, if it cannot be loaded)."""
        return self._loader.submit(self._load, grammar)

    def _load(self, grammar: str):
        key = hashlib.blake2b(grammar.encode(), digest_size=16).digest()
        if (hit := self._cache.get(key)) is not None:
            self._cache.move_to_end(key)
            return hit[0]
        loaded, size = self._build(grammar)
        self._cache[key] = (loaded, size)
        self._cache_bytes += size
        while self._cache_bytes > self._limit and len(self._cache) > 1:
            self._cache_bytes -= self._cache.popitem(last=False)[1][1]
        return loaded

    def _build(self, grammar: str) -> tuple[Any, int]:
        if self.backend == "llguidance":
            import llguidance

            prototype = llguidance.LLMatcher(self._vocabulary.get(), grammar, log_level=0)
            if prototype.is_error():
                raise ValueError(prototype.get_error())
            return prototype, 4 * len(grammar)  # (its lexer grows as it goes: a rough share)
        import xgrammar as xgr

        compiled = xgr.CompiledGrammar.deserialize_json(grammar, self._vocabulary.get())
        return compiled, compiled.memory_size_bytes + len(grammar)

    def state(self, loaded, trigger: list[int], stop_token_ids, param: str = "structured output") -> GrammarState:
        """A matcher for one sequence that ends the output on one of `stop_token_ids` (none, e.g. with
        ignore_eos: the grammar's own end ends it, whatever ignore_eos says); `param`: the request field the
        grammar comes from."""
        if self.backend == "llguidance":
            return GrammarState(_Guidance(loaded.deep_copy(), list(stop_token_ids)), trigger, self.vocab_size, param)
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(loaded, override_stop_tokens=list(stop_token_ids) or None)
        return GrammarState(_XGrammar(matcher), trigger, self.vocab_size, param)


def apply_grammars(logits: torch.Tensor, rows: list[int], states: list[GrammarState]) -> None:
    """Masks, in place, every token the grammar does not allow next in the given rows."""
    vocab = logits.shape[1]
    bitmask = torch.zeros(len(rows), -(-vocab // 32), dtype=torch.int32)  # [R, V/32]
    for i, state in enumerate(states):
        state.fill(bitmask, i)
    # token 32 w + j is bit j of word w: bytes in little-endian order, bits from the least significant
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, count=vocab, bitorder="little")  # [R, V]
    banned = torch.from_numpy(bits == 0).to(logits.device)
    for i, r in enumerate(rows):  # row by row, in place (no gathered copy of the rows)
        logits[r].masked_fill_(banned[i], float("-inf"))
