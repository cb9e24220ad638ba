"""Each request's constraints and penalties on the logits, before the sampler draws: in vLLM's order,
allowed_token_ids, the structured-output grammar, bad words, min_tokens, logit_bias, then the repetition /
frequency / presence penalties; and which rows none of them (nor anything else) reads."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sluice.engine.grammar import GrammarState, apply_grammars
from sluice.engine.sequence import Sequence

GREEDY_EPS = 1e-5  # a temperature below this is greedy
NEG_INF = float("-inf")


def _padded(rows: list[list[int]], pad: int, device) -> torch.Tensor:
    width = max(1, max(map(len, rows)))
    out = np.full((len(rows), width), pad, dtype=np.int64)
    for r, ids in enumerate(rows):
        out[r, : len(ids)] = ids
    return torch.from_numpy(out).to(device)


def plain_greedy(seq: Sequence) -> bool:
    """True when the sequence's next token is the argmax of its raw logits and nothing else reads them:
    greedy, no logprobs, and none of `process_logits`'s constraints or penalties can apply."""
    sp = seq.sampling
    return (sp.temperature < GREEDY_EPS and sp.logprobs is None and seq.grammar is None
            and not (sp.allowed_token_ids or sp.bad_words_ids or sp.logit_bias or sp.needs_penalties)
            and not (len(seq.output_ids) < sp.min_tokens and sp.stop_token_ids))


def greedy_held(seq: Sequence) -> bool:
    """True when the sequence's next token is the argmax of its raw logits over what its grammar allows, and
    nothing else reads them: then the plain argmax, if the grammar allows it, is that token."""
    sp = seq.sampling
    return (sp.temperature < GREEDY_EPS and sp.logprobs is None and seq.grammar is not None
            and seq.grammar.active and not (sp.allowed_token_ids or sp.bad_words_ids or sp.logit_bias
                                            or sp.needs_penalties))


@dataclass
class Constraints:
    """What `process_logits` does to a batch, row by row."""

    allowed: list[tuple[int, list[int]]]
    grammar_rows: list[int]
    banned_rows: list[int]
    banned_ids: list[int]
    bias_rows: list[int]
    bias_ids: list[int]
    bias_vals: list[float]
    penalized: list[int]

    @classmethod
    def of(cls, seqs: list[Sequence]) -> "Constraints":
        c = cls([(r, s.sampling.allowed_token_ids) for r, s in enumerate(seqs) if s.sampling.allowed_token_ids],
                [r for r, s in enumerate(seqs) if s.grammar is not None and s.grammar.active], [], [], [], [], [], [])
        grammar_rows = set(c.grammar_rows)
        for r, s in enumerate(seqs):
            sp = s.sampling
            out = s.output_ids
            for word in sp.bad_words_ids:
                if len(word) == 1 or out[len(out) - len(word) + 1 :] == word[:-1]:
                    c.banned_rows.append(r)
                    c.banned_ids.append(word[-1])
            if len(out) < sp.min_tokens and r not in grammar_rows:  # a grammar decides where its output ends
                c.banned_rows += [r] * len(sp.stop_token_ids)
                c.banned_ids += sp.stop_token_ids
            for tok, bias in sp.logit_bias.items():
                c.bias_rows.append(r)
                c.bias_ids.append(tok)
                c.bias_vals.append(bias)
            if sp.needs_penalties:
                c.penalized.append(r)
        return c

    def masks_only(self) -> bool:
        """Whether every constraint only rules tokens out: -inf is exact in any dtype, so they can go in place
        on the model's logits (no float32 copy of the whole batch for one held row)."""
        return not (self.bias_rows or self.penalized)

    def __bool__(self) -> bool:
        """Whether any constraint applies."""
        return bool(self.allowed or self.grammar_rows or self.banned_rows or self.bias_rows or self.penalized)

    def rows(self) -> list[int]:
        return sorted({r for r, _ in self.allowed} | set(self.grammar_rows) | set(self.banned_rows)
                      | set(self.bias_rows) | set(self.penalized))

    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """In place, in vLLM's order."""
        vocab, dev = logits.shape[1], logits.device
        if self.grammar_rows:
            apply_grammars(logits, self.grammar_rows, [_grammar(seqs[r]) for r in self.grammar_rows])
        if self.allowed:
            rows = torch.tensor([r for r, _ in self.allowed], device=dev)
            keep = torch.zeros(len(self.allowed), vocab + 1, dtype=torch.bool, device=dev)
            keep.scatter_(1, _padded([ids for _, ids in self.allowed], vocab, dev).clamp_(max=vocab), True)
            logits[rows] = logits[rows].masked_fill(~keep[:, :vocab], NEG_INF)
            self._starve(logits, seqs, [r for r, _ in self.allowed], "allowed_token_ids")
        if self.banned_rows:
            ids = torch.tensor(self.banned_ids, device=dev)
            ok = ids < vocab
            logits[torch.tensor(self.banned_rows, device=dev)[ok], ids[ok]] = NEG_INF
            self._starve(logits, seqs, self.banned_rows, "bad_words")
        if self.bias_rows:
            ids = torch.tensor(self.bias_ids, device=dev)
            ok = ids < vocab
            logits[torch.tensor(self.bias_rows, device=dev)[ok], ids[ok]] += \
                torch.tensor(self.bias_vals, device=dev)[ok]
        if self.penalized:
            _apply_penalties(logits, [seqs[r] for r in self.penalized], torch.tensor(self.penalized, device=dev))

    def _starve(self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int], field: str) -> None:
        """Fails the grammar rows among `rows` that `field` has left no token (the client's constraints
        contradict each other), rather than let them sample one their grammar refuses."""
        held = sorted(set(rows).intersection(self.grammar_rows))
        if not held:
            return
        alive = torch.isfinite(logits[torch.tensor(held, device=logits.device)]).any(1).tolist()
        for r, ok in zip(held, alive):
            if not ok:
                _grammar(seqs[r]).starve(field)


def _grammar(seq: Sequence) -> GrammarState:
    assert seq.grammar is not None  # (a grammar row's)
    return seq.grammar


def process_logits(logits: torch.Tensor, seqs: list[Sequence], c: Constraints | None = None) -> torch.Tensor:
    """Applies each request's constraints and penalties to logits [B, V] (a new float32 tensor when any
    applies)."""
    if c is None:
        c = Constraints.of(seqs)
    if not c:
        return logits
    logits = logits.to(torch.float32, copy=True)
    c.apply(logits, seqs)
    return logits


def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence], rows: torch.Tensor) -> None:
    vocab, dev = logits.shape[1], logits.device
    out_ids = _padded([s.output_ids for s in seqs], vocab, dev)
    counts = torch.zeros(len(seqs), vocab + 1, device=dev).scatter_add_(1, out_ids, torch.ones_like(
        out_ids, dtype=torch.float32))[:, :vocab]  # [R, V] output token counts
    prompt_ids = _padded([s.token_ids[: s.num_prompt_tokens] for s in seqs], vocab, dev)
    seen = torch.zeros(len(seqs), vocab + 1, dtype=torch.bool, device=dev).scatter_(1, prompt_ids, True)[:, :vocab]
    seen |= counts > 0
    col = lambda values: torch.tensor(values, device=dev, dtype=torch.float32).unsqueeze(1)  # noqa: E731
    rep = col([s.sampling.repetition_penalty for s in seqs])
    sub = logits[rows]
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - col([s.sampling.frequency_penalty for s in seqs]) * counts
    sub = sub - col([s.sampling.presence_penalty for s in seqs]) * (counts > 0)
    logits[rows] = sub
