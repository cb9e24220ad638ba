"""Structured output in the engine: an xgrammar matcher per sequence, applied as
a token bitmask once the output reaches the serving extension's trigger."""
from __future__ import annotations

import torch


class GrammarState:
    def __init__(self, matcher, trigger: list[int]) -> None:
        self.matcher = matcher
        self.trigger = trigger
        self.active = not trigger

    def observe(self, token_ids: list[int], token: int) -> None:
        """Takes the token just sampled after `token_ids`."""
        if self.active:
            self.matcher.accept_token(token)
        elif token == self.trigger[-1] and token_ids[len(token_ids) - len(self.trigger) + 1:] == self.trigger[:-1]:
            self.active = True


class Grammars:
    """Builds matchers from serialized grammars. The tokenizer info (and xgrammar itself) is loaded on a
    thread when the first constrained request arrives, not at startup: the engine spends nothing on
    structured output until someone uses it."""

    def __init__(self, model_path: str, vocab_size: int) -> None:
        from sluice.checkpoint import Background, tokenizer_info

        self._info = Background(lambda: tokenizer_info(model_path, vocab_size), lazy=True)

    def ready(self) -> bool:
        """Whether matchers can be built now; starts loading what they need if not."""
        self._info.start()
        return self._info.ready

    def state(self, grammar: str, trigger: list[int], stop_token_ids) -> GrammarState:
        import xgrammar as xgr

        compiled = xgr.CompiledGrammar.deserialize_json(grammar, self._info.get())
        return GrammarState(xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids)), trigger)


def apply_grammars(logits: torch.Tensor, rows: list[int], states: list[GrammarState]) -> None:
    """Masks, in place, every token the grammar does not allow next in the given rows."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])
    for row, state in zip(rows, states):
        state.matcher.fill_next_token_bitmask(bitmask, row)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
